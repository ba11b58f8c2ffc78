"""The test command's workers: each has a /dev/shm of its own (``_private_shm.py``, conftest.py)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

PRIVATE_SHM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_private_shm.py")


def test_a_process_started_by_private_shm_sees_only_its_own_dev_shm() -> None:
    """What it creates in /dev/shm never reaches this process's, and it finds none of this one's
    there: the leftover check of a test on one worker cannot see another worker's files. Not
    root: it refuses with exit code 3 and says why (conftest.py then runs the suite serially)."""
    name = f"suite-probe-{secrets.token_hex(8)}"
    mine = f"/dev/shm/suite-probe-outside-{secrets.token_hex(8)}"
    open(mine, "w").close()
    try:
        code = f"import os; open('/dev/shm/{name}', 'w').close(); print(sorted(os.listdir('/dev/shm')))"
        proc = subprocess.run(
            [sys.executable, PRIVATE_SHM, "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
        if os.geteuid() != 0:
            assert proc.returncode == 3, proc.stderr
            assert "no /dev/shm of its own" in proc.stderr
            return
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == repr([name])  # empty but for its own file
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        os.unlink(mine)
