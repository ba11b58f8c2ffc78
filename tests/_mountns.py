"""A tmpfs seen by this process and its children only (a mount namespace of their own; root).

Used by ``_tcp_workers`` (a writer whose directory fills up) and by ``_private_shm`` (a test
worker process with a /dev/shm of its own). Imports nothing of the package: ``_private_shm``
runs it before the interpreter it starts has imported anything.
"""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18


def private_tmpfs(directory: str, size: str, mode: str = "0700") -> None:
    """Move this process into a mount namespace of its own, its mounts private (nothing mounted
    here reaches the host's namespace), and mount a tmpfs of ``size`` on ``directory``. Raises
    ``OSError`` where that is not allowed (not root, no ``CAP_SYS_ADMIN``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    options = f"size={size},mode={mode}".encode()
    check(libc.mount(b"tmpfs", directory.encode(), b"tmpfs", 0, options), f"mount -t tmpfs tmpfs {directory}")
