"""Python with a /dev/shm of its own: ``python tests/_private_shm.py ARGS...`` runs ``python ARGS...``
in a mount namespace of its own, with a fresh tmpfs mounted on /dev/shm.

The test command runs the suite on two worker processes started this way (conftest.py,
``pytest_cmdline_main``): every segment, wake-up socket and semaphore a worker's tests and their
child processes create lives in that worker's /dev/shm, so each test's check that it left
/dev/shm as it found it sees its own files only, as in a serial run. Network namespaces, TCP and
the rest of the file system are shared as usual.

Exits 3, saying why on stderr, where the namespace cannot be made (not root): conftest.py then
runs the suite serially.
"""

from __future__ import annotations

import os
import sys

from _mountns import private_tmpfs


def main() -> None:
    try:
        private_tmpfs("/dev/shm", "50%", mode="1777")
    except OSError as exc:
        print(f"_private_shm: no /dev/shm of its own here: {exc}", file=sys.stderr)
        sys.exit(3)
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


if __name__ == "__main__":
    main()
