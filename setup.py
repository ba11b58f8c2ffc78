"""The one compiled part (aiobroadcast/_shm/_atomics.c): the ring's atomic loads, stores and
fences, and the lock that a Ctrl-C cannot leave held (Held, aiobroadcast/_shm/owned.py).

Everything else is in pyproject.toml. Building needs a C compiler (GCC or Clang) and Python's
headers: ``apt-get install gcc python3-dev`` on Debian and Ubuntu.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "aiobroadcast._shm._atomics",
            sources=["aiobroadcast/_shm/_atomics.c"],
            extra_compile_args=["-O2", "-std=c11"],
        )
    ]
)
