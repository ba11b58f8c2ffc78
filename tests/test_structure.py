"""The layering docs/design.md describes ("Layers"), checked on the source rather than described:
imports go down only, and the sans-IO protocol and the step drivers do no I/O."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "aiobroadcast"

#: The package's modules from the bottom up. A module may import its own layer and the layers
#: below it, never one above (names are prefixes of dotted module names under ``aiobroadcast``).
LAYERS: list[tuple[str, ...]] = [
    # the shared base: constants, errors, codecs, handles, step drivers; no role, no transport
    ("_base",),
    # the ring and its wake-ups; the TCP frames, the sealing and the sans-IO protocol
    ("_shm", "_tcp.seal", "_tcp.wire", "_tcp.readers", "_tcp.protocol", "_tcp.serving", "_tcp.receiving"),
    # the TCP pumps, server and supervisor (they read the ring as a reader does)
    ("_tcp",),
    # the role families, each on the ones before it
    ("_broadcast",),
    ("_fanin",),
    ("_calls",),
    # the public faces and the command line
    ("__init__", "blocking", "vllm"),
    ("cli", "__main__"),
]

#: Modules that must not do I/O or know of event loops: they are driven from outside.
SANS_IO = {
    "_tcp.wire": {"zmq", "socket", "select", "asyncio", "anyio", "threading", "sniffio"},
    "_tcp.readers": {"zmq", "socket", "select", "asyncio", "anyio", "threading", "sniffio"},
    "_tcp.protocol": {"zmq", "socket", "select", "asyncio", "anyio", "threading", "sniffio", "time"},
    "_tcp.serving": {"zmq", "socket", "select", "asyncio", "anyio", "threading", "sniffio", "time"},
    "_tcp.receiving": {"zmq", "socket", "select", "asyncio", "anyio", "threading", "sniffio", "time"},
    "_base.steps": {"zmq", "socket", "select", "asyncio", "threading", "sniffio"},
}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every module ``name`` imports at run time (not under ``if TYPE_CHECKING``), as dotted
    names relative to the package, or absolute for other packages."""
    tree = ast.parse(path.read_text())
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(inner) for inner in ast.walk(node))
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    if name == "__init__":
        package = []
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if not node.level:
                module = node.module or ""
                found.add(module.removeprefix("aiobroadcast.") if module.startswith("aiobroadcast.") else module)
                continue
            base = package[: len(package) - (node.level - 1)]
            if node.module:
                found.add(".".join([*base, node.module]))
            else:
                found.update(".".join([*base, alias.name]) for alias in node.names)
    return found


def _layer(module: str) -> int:
    best, where = -1, -1
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), i
    return where


MODULES = _modules()


def test_every_module_has_a_layer() -> None:
    assert [m for m in MODULES if _layer(m) < 0] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_only(module: str) -> None:
    mine = _layer(module)
    upward = sorted(
        target
        for target in _imports(module, MODULES[module])
        if (target in MODULES or target.split(".")[0] in {m.split(".")[0] for m in MODULES}) and _layer(target) > mine
    )
    assert upward == [], f"{module} (layer {mine}) imports from layers above it: {upward}"


@pytest.mark.parametrize("module", sorted(SANS_IO))
def test_sans_io_modules_do_no_io(module: str) -> None:
    found = {target.split(".")[0] for target in _imports(module, MODULES[module])}
    assert found & SANS_IO[module] == set()


def test_the_checks_see_an_upward_import(tmp_path: pathlib.Path) -> None:
    """The import check is not vacuous: an ``_shm`` module importing a role is caught."""
    fake = tmp_path / "fake.py"
    fake.write_text("from .._broadcast.writer import Writer\nfrom ..cli import main\nimport zmq\n")
    found = _imports("_shm.fake", fake)
    assert found == {"_broadcast.writer", "cli", "zmq"}
    assert [t for t in found if _layer(t) > _layer("_shm.fake")] != []


#: the longest a class may be, in lines (``class`` to its last line): longer, it does more than one job
MAX_CLASS_LINES = 250


def _long_classes(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_class_is_longer_than_250_lines(module: str) -> None:
    assert _long_classes(MODULES[module]) == []


def test_the_size_check_sees_a_long_class(tmp_path: pathlib.Path) -> None:
    """The size check is not vacuous: 250 lines pass, 251 do not."""
    fits = tmp_path / "fits.py"
    fits.write_text("class Fits:\n" + "    x = 1\n" * (MAX_CLASS_LINES - 1))
    long = tmp_path / "long.py"
    long.write_text("class Long:\n" + "    x = 1\n" * MAX_CLASS_LINES + "y = 2\n")
    assert _long_classes(fits) == []
    assert _long_classes(long) == ["Long (251 lines)"]
