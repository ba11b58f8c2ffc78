"""What the command line says when something is wrong, run as a user runs it (real processes,
real sockets): errors name their cause and the fix."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# --- 5. the README's dependencies ----------------------------------------------------------------
def test_the_readme_lists_every_dependency() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in deps}  # type: ignore[union-attr]
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    listed = re.search(r"Dependencies: ([^.]*)\.", readme)
    assert listed is not None
    assert {n.strip().lower() for n in listed.group(1).split(",")} == names


# --- 3. a source tree that shadows the installed package ------------------------------------------
def _copy_tree(dest: Path) -> None:
    """The source tree as a user has it after a clone: no compiled extension in it."""
    shutil.copytree(
        ROOT / "aiobroadcast",
        dest / "aiobroadcast",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"),
    )
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, dest / name)


def test_a_source_tree_that_shadows_a_non_editable_install_says_so_in_one_line(tmp_path: Path) -> None:
    """README command 1 installs the package (not editable) into .venv inside the source tree;
    from there, ``python -m aiobroadcast`` and scripts import the tree's own package, which has
    no compiled extension. That is one line with the fix, not a 12-frame traceback."""
    tree = tmp_path / "src"
    _copy_tree(tree)
    venv = tree / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    # The dependencies (and pip) from this interpreter: no download.
    ours = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "deps.pth").write_text("\n".join(ours) + "\n")
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", str(tree)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    installed = Path(site, "aiobroadcast")
    assert list(installed.glob("_shm/_atomics*.so"))

    # From elsewhere the installed package works.
    res = subprocess.run(
        [python, "-m", "aiobroadcast", "keygen", "--public"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr

    # From the source tree: one line, exit 1.
    res = subprocess.run(
        [python, "-m", "aiobroadcast", "demo"], cwd=tree, capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("aiobroadcast: error: ")
    assert f"the source tree at {tree}" in lines[0] and "shadows the installed package" in lines[0]
    assert str(installed) in lines[0]
    assert "run from another directory" in lines[0] and "pip install -e ." in lines[0]

    # A script in the tree gets an ImportError (tools that catch ImportError keep working) that
    # says the same.
    probe = (
        "try:\n"
        "    import aiobroadcast\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__mro__[1:3], exc.name, str(exc), sep='|')\n"
    )
    (tree / "probe.py").write_text(probe)
    res = subprocess.run([python, "probe.py"], cwd=tree, capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    _mro, name, message = res.stdout.strip().split("|")
    assert name == "aiobroadcast._shm._atomics"
    assert "shadows the installed package" in message and "pip install -e ." in message


def test_a_package_without_its_extension_and_no_install_says_how_to_build_it(tmp_path: Path) -> None:
    """No installed copy to shadow (an editable checkout never built): the line says to build."""
    tree = tmp_path / "src"
    _copy_tree(tree)
    # Only the standard library and the dependencies: not this checkout (nor its editable install).
    env = {**os.environ, "PYTHONPATH": "", "PYTHONNOUSERSITE": "1"}
    script = (
        "import sys\n"
        f"sys.path[:] = [p for p in sys.path if p not in ('', {str(ROOT)!r})]\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
        f"sys.path.insert(0, {str(tree)!r})\n"
        "try:\n"
        "    import aiobroadcast\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 0, res.stderr
    assert "has no compiled extension" in res.stdout and "pip install -e ." in res.stdout
    assert "shadows" not in res.stdout
