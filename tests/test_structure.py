"""The layering docs/design.md describes ("Layers"), checked on the source rather than described.

Each rule is its own test, and each has a test that plants a violation (a fake module or tree in
``tmp_path``) and shows the check catching it:

- imports go down only (``test_imports_go_down_only``);
- no import cycle among the package's modules (``test_no_import_cycle``);
- no sideways import between two packages of one layer (``test_no_sideways_import``);
- a package's private modules (``_shm._atomics``, ``cli._common``) are imported by that package only
  (``test_no_import_of_another_packages_private_module``);
- the sans-IO modules import no I/O or event-loop module (``test_sans_io_modules_do_no_io``);
- a reader's modules do not import the writer's, even indirectly
  (``test_readers_do_not_import_the_writer``);
- ``_base.constants`` imports nothing (``test_constants_import_nothing``);
- sizes by job: a class with its in-package bases is at most 250 lines
  (``test_no_class_with_its_bases_is_longer_than_250_lines``), a module at most 600 unless
  ``BIG_MODULES`` names its one job (``test_no_module_is_longer_than_600_lines``).

An import counts wherever it is written (at the top, or inside a function: a lazy import is still
a dependency), except in the body of ``if TYPE_CHECKING:``, which never runs.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator, Mapping

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "aiobroadcast"

#: The package from the bottom up: each layer a tuple of *units*, a unit a subpackage or a
#: top-level module (names relative to ``aiobroadcast``; ``__init__`` is the package's own
#: ``__init__.py``). A module imports modules of its own unit, or of units in lower layers: never
#: one above (upward), never another unit of its own layer (sideways).
LAYERS: list[tuple[str, ...]] = [
    # the shared base: constants, errors, tuning, codecs, handles, step drivers, files, fork,
    # statistics; no role, no transport
    ("_base",),
    # the shared-memory ring: layout, segment, publisher, reader source, wake-ups, arena
    ("_shm",),
    # the TCP transport, sans-IO half (wire, readers, protocol, seal) and its pumps alike: all of
    # it builds on the ring (the server reads the ring as a reader; a remote reader's name is
    # kept and compared as a ring record keeps it, _shm.layout.name_key), so it is a layer above
    # _shm rather than beside it
    ("_tcp",),
    # the role families, each on the ones before it
    ("_broadcast",),
    ("_fanin",),
    ("_calls",),
    # the public faces: the package, the blocking roles' names, vLLM's MessageQueue
    ("__init__", "blocking", "vllm"),
    # the command line
    ("cli",),
    # ``python -m aiobroadcast`` and the console script, which run the command line
    ("__main__",),
]

_FOREIGN_IO = {"zmq", "socket", "select", "selectors", "asyncio", "anyio", "trio", "threading", "sniffio", "subprocess"}

#: Modules that must not do I/O or know of event loops: they are driven from outside. Each maps
#: to the top-level modules it must not import, and the exact modules it may import anyway.
SANS_IO: dict[str, tuple[set[str], set[str]]] = {
    # the TCP protocol and its sealing: frames, bytes and times in (no clock read), frames out
    "_tcp.wire": (_FOREIGN_IO | {"time"}, set()),
    "_tcp.readers": (_FOREIGN_IO | {"time"}, set()),
    "_tcp.protocol": (_FOREIGN_IO | {"time"}, set()),
    "_tcp.serving": (_FOREIGN_IO | {"time"}, set()),
    "_tcp.receiving": (_FOREIGN_IO | {"time"}, set()),
    "_tcp.seal": (_FOREIGN_IO | {"time"}, set()),
    # the step generators and their two drivers: the async driver's one use of an event loop is
    # ``anyio.lowlevel.checkpoint()`` (a CHECKPOINT step); the rest is plain generators
    "_base.steps": (_FOREIGN_IO, {"anyio.lowlevel"}),
}

#: The longest a class may be, counted with its in-package bases (``class`` to its last line):
#: longer, it does more than one job.
MAX_CLASS_LINES = 250

#: The longest a module may be, in lines, unless it is listed in ``BIG_MODULES``.
MAX_MODULE_LINES = 600

#: Modules allowed over ``MAX_MODULE_LINES``, each with the one job it does. A module of two jobs
#: is split instead (as ``_tcp.protocol`` was into the server's and the client's state machines,
#: and ``_broadcast.open`` into opening a writer and opening a reader).
BIG_MODULES: dict[str, str] = {
    "_base.codec": "the encoders and decoders of a message body (pickle with out-of-band buffers, pydantic, JSON)",
    "_tcp.seal": "sealing the TCP data plane: keys, AES-GCM frames, the writer's MAC",
    "vllm": "vLLM's MessageQueue API, one class over the blocking roles",
}


# --- reading the source -----------------------------------------------------------------------


def _modules(root: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    """The package's modules by dotted name relative to it (a subpackage by its own name)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    for stub in sorted(root.rglob("*.pyi")):  # a compiled module (``_shm._atomics``), by its stub
        found.setdefault(".".join(stub.relative_to(root).with_suffix("").parts), stub)
    return found


def _typing_only(tree: ast.AST) -> set[int]:
    """The nodes in the body of an ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``); its
    ``else`` runs, and so does the body of ``if not TYPE_CHECKING:``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}:
            for statement in node.body:
                skip.update(id(inner) for inner in ast.walk(statement))
    return skip


def _run_time_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    skip = _typing_only(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skip:
            yield node


def _own(module: str) -> str:
    """An absolute module name of this package, relative to it (``aiobroadcast`` is ``__init__``)."""
    if module == "aiobroadcast":
        return "__init__"
    return module.removeprefix("aiobroadcast.")


def _imports(name: str, path: pathlib.Path, known: Mapping[str, object] | None = None) -> set[str]:
    """Every module ``name`` imports at run time, as dotted names relative to the package, or
    absolute for other packages. ``from X import y`` counts as importing ``X.y`` where that is a
    module (in ``known``), else ``X``."""
    known = MODULES if known is None else known
    tree = ast.parse(path.read_text())
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    if name == "__init__":
        package = []
    found: set[str] = set()
    for node in _run_time_imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(_own(alias.name) if alias.name.split(".")[0] == "aiobroadcast" else alias.name)
            continue
        if not node.level:
            module = node.module or ""
            if module.split(".")[0] != "aiobroadcast":
                found.add(module)
                continue
            base = _own(module)
        else:
            base = ".".join([*package[: len(package) - (node.level - 1)], *([node.module] if node.module else [])])
        for alias in node.names:
            sub = f"{base}.{alias.name}" if base and base != "__init__" else alias.name
            found.add(sub if sub in known else base or "__init__")
    return found


def _target(module: str, modules: Mapping[str, object]) -> str | None:
    """The package module that importing ``module`` runs last (itself, or its nearest package),
    or None for a module of another distribution."""
    parts = module.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def _graph(modules: Mapping[str, pathlib.Path]) -> dict[str, set[str]]:
    """Which package modules each package module imports at run time."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {_target(t, modules) for t in _imports(name, path, modules)}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def _unit(module: str) -> str:
    """The unit (a subpackage or top-level module) ``module`` belongs to."""
    return module.split(".")[0]


def _layer(module: str) -> int:
    for i, units in enumerate(LAYERS):
        if _unit(module) in units:
            return i
    return -1


MODULES = _modules()
GRAPH = _graph(MODULES)


# --- the checks -------------------------------------------------------------------------------


def test_every_module_has_a_layer() -> None:
    assert [m for m in MODULES if _layer(m) < 0] == []


def _upward(module: str, graph: Mapping[str, set[str]]) -> list[str]:
    return sorted(t for t in graph[module] if _layer(t) > _layer(module))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_only(module: str) -> None:
    upward = _upward(module, GRAPH)
    assert upward == [], f"{module} (layer {_layer(module)}) imports from layers above it: {upward}"


def test_the_checks_see_an_upward_import(tmp_path: pathlib.Path) -> None:
    """An ``_shm`` module importing a role, even lazily inside a function, is caught; one in the
    body of ``if TYPE_CHECKING:`` is not an import at run time (its ``else`` is, and so is the
    body of ``if not TYPE_CHECKING:``)."""
    fake = tmp_path / "fake.py"
    fake.write_text(
        "from typing import TYPE_CHECKING\n"
        "import zmq\n"
        "from .. import cli\n"
        "if TYPE_CHECKING:\n"
        "    from .._calls.roles import Caller\n"
        "else:\n"
        "    from ..vllm import MessageQueue\n"
        "if not TYPE_CHECKING:\n"
        "    from .._fanin import collector\n"
        "def later():\n"
        "    from .._broadcast.writer import Writer\n"
    )
    known = {**MODULES, "_shm.fake": fake}
    found = _imports("_shm.fake", fake, known)
    assert found == {"typing", "zmq", "cli", "vllm", "_fanin.collector", "_broadcast.writer"}
    assert _upward("_shm.fake", _graph(known)) == ["_broadcast.writer", "_fanin.collector", "cli", "vllm"]


def _cycle(graph: Mapping[str, set[str]]) -> list[str]:
    """One import cycle in ``graph`` (its modules in order, the first again at the end), or []."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start: 0}
        todo = [iter(sorted(graph[start]))]
        while todo:
            following = next(todo[-1], None)
            if following is None:
                finished = path.pop()
                del on_path[finished]
                done.add(finished)
                todo.pop()
                continue
            if following in on_path:
                return [*path[on_path[following] :], following]
            if following in done:
                continue
            on_path[following] = len(path)
            path.append(following)
            todo.append(iter(sorted(graph.get(following, ()))))
    return []


def test_no_import_cycle() -> None:
    """No module imports, however indirectly, one that imports it back: each module can be
    understood (and imported) after the ones it uses, with no lazy import holding a cycle."""
    cycle = _cycle(GRAPH)
    assert cycle == [], "import cycle: " + " -> ".join(cycle)


def test_the_checks_see_an_import_cycle(tmp_path: pathlib.Path) -> None:
    """A cycle of three modules in one package, closed by a lazy import, is found and named."""
    (tmp_path / "_shm").mkdir()
    (tmp_path / "_shm" / "__init__.py").write_text("")
    (tmp_path / "_shm" / "a.py").write_text("from . import b\n")
    (tmp_path / "_shm" / "b.py").write_text("from .c import thing\n")
    (tmp_path / "_shm" / "c.py").write_text("def thing():\n    from .a import other\n")
    (tmp_path / "_shm" / "d.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from . import a\n")
    modules = _modules(tmp_path)
    assert _cycle(_graph(modules)) == ["_shm.a", "_shm.b", "_shm.c", "_shm.a"]
    (tmp_path / "_shm" / "c.py").write_text("def thing():\n    from .d import other\n")
    assert _cycle(_graph(_modules(tmp_path))) == []


def _sideways(module: str, graph: Mapping[str, set[str]]) -> list[str]:
    return sorted(t for t in graph[module] if _layer(t) == _layer(module) and _unit(t) != _unit(module))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_sideways_import(module: str) -> None:
    """Two units of one layer (``vllm`` and ``blocking``; ``_shm`` and ``_tcp`` would be, were
    they one layer) do not use each other: each builds on the layers below only."""
    sideways = _sideways(module, GRAPH)
    assert sideways == [], f"{module} imports from its own layer's other units: {sideways}"


def test_the_checks_see_a_sideways_import(tmp_path: pathlib.Path) -> None:
    fake = tmp_path / "vllm.py"
    fake.write_text("from .blocking import BlockingWriter\nfrom ._broadcast.open import open_writer\n")
    known = {**MODULES, "vllm": fake}
    assert _sideways("vllm", _graph(known)) == ["blocking"]


def _private_imports(module: str, imports: set[str]) -> list[str]:
    """The modules ``module`` imports that are private to a package it is not in."""
    found = []
    for target in imports:
        *package, last = target.split(".")
        if last.startswith("_") and not last.startswith("__") and package:
            owner = ".".join(package)
            if module != owner and not module.startswith(owner + "."):
                found.append(target)
    return sorted(found)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_of_another_packages_private_module(module: str) -> None:
    """A module whose name starts with ``_`` inside a package (``_shm._atomics``,
    ``cli._common``) is that package's own: others use what the package exports."""
    private = _private_imports(module, _imports(module, MODULES[module]))
    assert private == [], f"{module} imports other packages' private modules: {private}"


def test_the_checks_see_an_import_of_a_private_module(tmp_path: pathlib.Path) -> None:
    (tmp_path / "_shm").mkdir()
    (tmp_path / "_shm" / "__init__.py").write_text("")
    (tmp_path / "_shm" / "_atomics.py").write_text("")
    (tmp_path / "_shm" / "atomic.py").write_text("from ._atomics import Words\n")
    (tmp_path / "_tcp").mkdir()
    (tmp_path / "_tcp" / "__init__.py").write_text("")
    (tmp_path / "_tcp" / "server.py").write_text(
        "from .._shm import _atomics\nfrom .._shm._atomics import fence\nfrom .._shm.atomic import Words\n"
    )
    modules = _modules(tmp_path)
    assert _private_imports("_shm.atomic", _imports("_shm.atomic", modules["_shm.atomic"], modules)) == []
    found = _private_imports("_tcp.server", _imports("_tcp.server", modules["_tcp.server"], modules))
    assert found == ["_shm._atomics"]
    # the top-level units (``_shm``) are private to the package, whose every module may use them
    assert _private_imports("cli._stats", {"_shm.segment", "_base", "cli._common"}) == []


def _io_imports(module: str, imports: set[str]) -> list[str]:
    forbidden, allowed = SANS_IO[module]
    return sorted(t for t in imports if t.split(".")[0] in forbidden and t not in allowed)


@pytest.mark.parametrize("module", sorted(SANS_IO))
def test_sans_io_modules_do_no_io(module: str) -> None:
    found = _io_imports(module, _imports(module, MODULES[module]))
    assert found == [], f"{module} imports I/O or event-loop modules: {found}"


def test_the_checks_see_an_io_import(tmp_path: pathlib.Path) -> None:
    fake = tmp_path / "steps.py"
    fake.write_text("import anyio.lowlevel\ndef later():\n    import threading\n    from anyio import sleep\n")
    assert _io_imports("_base.steps", _imports("_base.steps", fake)) == ["anyio", "threading"]
    assert _io_imports("_tcp.wire", {"anyio.lowlevel", "zmq.asyncio", "json"}) == ["anyio.lowlevel", "zmq.asyncio"]


#: The modules of a reader (over shared memory or TCP, and its role) and of a writer: a reader
#: imports none of the writer's, even through another module.
READER_SIDE = {
    "_broadcast.reader",
    "_broadcast.wakeup",
    "_shm.subscriber",
    "_shm.place",
    "_tcp.client",
    "_tcp.pump",
    "_tcp.inbox",
    "_tcp.connections",
}
WRITER_SIDE = {
    "_broadcast.writer",
    "_broadcast.channel",
    "_broadcast.channel_put",
    "_broadcast.channel_server",
    "_shm.publisher",
    "_shm.fragments",
    "_shm.records",
    "_tcp.server",
    "_tcp.supervisor",
    "_tcp.settings",
}


def _reach(module: str, graph: Mapping[str, set[str]]) -> set[str]:
    """Every package module that importing ``module`` imports, directly or not."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for following in graph.get(todo.pop(), ()):
            if following not in seen:
                seen.add(following)
                todo.append(following)
    return seen


@pytest.mark.parametrize("module", sorted(READER_SIDE))
def test_readers_do_not_import_the_writer(module: str) -> None:
    assert module in MODULES
    found = sorted(_reach(module, GRAPH) & WRITER_SIDE)
    assert found == [], f"the reader's {module} imports the writer's {found}"


def test_the_checks_see_a_reader_importing_the_writer(tmp_path: pathlib.Path) -> None:
    """Through a module in between (``_shm.layout`` importing ``_shm.records``), too."""
    layout = tmp_path / "layout.py"
    layout.write_text("def later():\n    from .records import ReaderRecords\n")
    graph = _graph({**MODULES, "_shm.layout": layout})
    assert _reach("_shm.subscriber", graph) & WRITER_SIDE == {"_shm.records"}
    assert _reach("_shm.subscriber", GRAPH) & WRITER_SIDE == set()


def _imports_anything(name: str, path: pathlib.Path) -> list[str]:
    return sorted(_imports(name, path) - {"__future__"})


def test_constants_import_nothing() -> None:
    """Names shared across layers without importing them (the TCP server's reader name) live in a
    module that any layer can import without pulling anything in."""
    assert _imports_anything("_base.constants", MODULES["_base.constants"]) == []


def test_the_checks_see_constants_importing(tmp_path: pathlib.Path) -> None:
    fake = tmp_path / "constants.py"
    fake.write_text("from __future__ import annotations\nimport os\nfrom .errors import BroadcastError\n")
    assert _imports_anything("_base.constants", fake) == ["_base.errors", "os"]


# --- sizes by job -----------------------------------------------------------------------------


def _classes(modules: Mapping[str, pathlib.Path]) -> dict[tuple[str, str], tuple[int, list[str]]]:
    """Each class the package defines, by (module, name): its lines and its in-package bases,
    as (module, name) keys again (a base imported from another module is followed there)."""
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}

    def names(module: str) -> dict[str, str]:
        """What the names a module imports from the package refer to: ``name`` -> ``module.name``."""
        found: dict[str, str] = {}
        package = module.split(".")[:-1] if modules[module].name != "__init__.py" else module.split(".")
        if module == "__init__":
            package = []
        for node in ast.walk(trees[module]):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(
                        [*package[: len(package) - (node.level - 1)], *([node.module] if node.module else [])]
                    )
                elif (node.module or "").split(".")[0] == "aiobroadcast":
                    base = _own(node.module or "")
                else:
                    continue
                for alias in node.names:
                    found[alias.asname or alias.name] = f"{base}.{alias.name}" if base else alias.name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "aiobroadcast" and alias.asname:
                        found[alias.asname] = _own(alias.name) + "."
        return found

    def resolve(module: str, dotted: str, seen: frozenset[tuple[str, str]] = frozenset()) -> tuple[str, str] | None:
        """The class ``dotted`` names in ``module``, if the package defines it."""
        head, _, rest = dotted.partition(".")
        if (module, dotted) in seen:
            return None
        seen = seen | {(module, dotted)}
        if not rest and (module, head) in defined:
            return module, head
        imported = imported_names[module].get(head)
        if imported is None:
            return None
        if imported.endswith("."):  # ``import aiobroadcast.x as y``; ``y.Name``
            return resolve(imported[:-1], rest, seen) if imported[:-1] in modules and rest else None
        if imported in modules:  # ``from . import x``; ``x.Name``
            return resolve(imported, rest, seen) if rest else None
        source, _, name = imported.rpartition(".")
        if source not in modules:
            return None
        return resolve(source, ".".join([name, rest]) if rest else name, seen)

    defined: dict[tuple[str, str], ast.ClassDef] = {}
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                defined.setdefault((module, node.name), node)
    imported_names = {module: names(module) for module in modules}
    classes: dict[tuple[str, str], tuple[int, list[str]]] = {}
    for (module, name), node in defined.items():
        bases = []
        for base in node.bases:
            expression = base.value if isinstance(base, ast.Subscript) else base
            if isinstance(expression, ast.Name | ast.Attribute):
                found = resolve(module, ast.unparse(expression))
                if found is not None and found != (module, name):
                    bases.append(".".join(found))
        assert node.end_lineno is not None
        classes[(module, name)] = (node.end_lineno - node.lineno + 1, bases)
    return classes


def _with_bases(classes: Mapping[tuple[str, str], tuple[int, list[str]]]) -> dict[str, tuple[int, list[str]]]:
    """Each class's lines counted with its in-package bases, recursively (each base once), and
    the classes counted, itself first."""
    by_name = {".".join(key): value for key, value in classes.items()}
    totals = {}
    for name in by_name:
        chain, todo = [name], list(by_name[name][1])
        while todo:
            base = todo.pop(0)
            if base not in chain:
                chain.append(base)
                todo.extend(by_name[base][1])
        totals[name] = (sum(by_name[c][0] for c in chain), chain)
    return totals


CLASSES = _with_bases(_classes(MODULES))


def _long_classes(module: str, totals: Mapping[str, tuple[int, list[str]]]) -> list[str]:
    return [
        f"{name} ({lines} lines: {' + '.join(chain)})"
        for name, (lines, chain) in sorted(totals.items())
        if name.rpartition(".")[0] == module and lines > MAX_CLASS_LINES
    ]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_class_with_its_bases_is_longer_than_250_lines(module: str) -> None:
    """A class split into bases (mixins) in the package still does all their jobs: it is counted
    with them."""
    assert _long_classes(module, CLASSES) == []


def test_the_checks_see_a_long_class(tmp_path: pathlib.Path) -> None:
    """250 lines pass, 251 do not; nor do two classes of 126 lines where one is the other's base,
    imported from another module, and generic."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "fits.py").write_text("class Fits:\n" + "    x = 1\n" * (MAX_CLASS_LINES - 1))
    (tmp_path / "pkg" / "long.py").write_text("class Long:\n" + "    x = 1\n" * MAX_CLASS_LINES + "y = 2\n")
    half = "    x = 1\n" * (MAX_CLASS_LINES // 2)
    (tmp_path / "pkg" / "base.py").write_text("class Half:\n" + half)
    (tmp_path / "pkg" / "chain.py").write_text(
        "from . import base\nfrom .base import Half\nclass Whole(Half[int]):\n" + half
    )
    (tmp_path / "pkg" / "chain2.py").write_text("from . import base\nclass Whole(base.Half):\n" + half)
    (tmp_path / "pkg" / "alone.py").write_text("class Alone(Exception):\n" + half)
    totals = _with_bases(_classes(_modules(tmp_path)))
    assert _long_classes("pkg.fits", totals) == []
    assert _long_classes("pkg.long", totals) == ["pkg.long.Long (251 lines: pkg.long.Long)"]
    assert _long_classes("pkg.chain", totals) == ["pkg.chain.Whole (252 lines: pkg.chain.Whole + pkg.base.Half)"]
    assert _long_classes("pkg.chain2", totals) == ["pkg.chain2.Whole (252 lines: pkg.chain2.Whole + pkg.base.Half)"]
    assert _long_classes("pkg.alone", totals) == []


def _too_long(module: str, path: pathlib.Path) -> int | None:
    lines = len(path.read_text().splitlines())
    return lines if lines > MAX_MODULE_LINES and module not in BIG_MODULES else None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_longer_than_600_lines(module: str) -> None:
    lines = _too_long(module, MODULES[module])
    assert lines is None, f"{module} has {lines} lines: split it by job, or name its one job in BIG_MODULES"


def test_big_modules_are_modules_that_are_big() -> None:
    """The list of big modules holds no module that is gone or has become small."""
    assert sorted(m for m in BIG_MODULES if m not in MODULES) == []
    small = [m for m in BIG_MODULES if len(MODULES[m].read_text().splitlines()) <= MAX_MODULE_LINES]
    assert small == []


def test_the_checks_see_a_long_module(tmp_path: pathlib.Path) -> None:
    fits = tmp_path / "fits.py"
    fits.write_text("x = 1\n" * MAX_MODULE_LINES)
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert _too_long("_shm.fits", fits) is None
    assert _too_long("_shm.long", long) == MAX_MODULE_LINES + 1
    assert _too_long(next(iter(BIG_MODULES)), long) is None
