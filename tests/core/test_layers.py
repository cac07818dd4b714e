"""The layers of the house, read from the source with ``ast``: who may import whom.

* The library (core/src/kvroute) imports no other distribution of this repository: no plugin,
  no adapter, neither application (any top-level name starting with ``kvroute_``).
* Strategy plugins and engine adapters import neither application (kvroute_server, kvroute_simulator).
* The proxy (kvroute_server) does not import the simulator.
* Within kvroute, kvroute_server and kvroute_simulator, module-level imports form no cycle.

The first three rules count every import: at module level, under ``if TYPE_CHECKING:`` and
inside functions, plus ``importlib.import_module("...")`` / ``__import__("...")`` with a literal
name. The cycle rule counts what runs when a module is imported: not imports inside functions,
not those under ``if TYPE_CHECKING:``. The checker itself is tested on small synthetic trees.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[2]

LIBRARY = ROOT / "core" / "src"
SERVER = ROOT / "contrib" / "server" / "src"
SIMULATOR = ROOT / "contrib" / "simulator" / "src"
APPLICATIONS = ("kvroute_server", "kvroute_simulator")


@attrs.frozen
class Import:
    """One import statement (or literal dynamic import) of one module."""

    importer: str
    path: Path
    line: int
    #: The absolute dotted name imported: ``a.b`` for ``import a.b`` and ``from a.b import c``.
    target: str
    #: For ``from a.b import c, d``: ``("c", "d")``.
    names: tuple[str, ...] = ()
    #: Runs when the importer is imported: not inside a function, not under ``if TYPE_CHECKING:``.
    at_import_time: bool = True

    def describe(self) -> str:
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{where}:{self.line}: {self.importer} imports {self.target}"


def modules(src: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under the source root ``src``, by dotted name."""
    found: dict[str, Path] = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _literal_import(call: ast.Call) -> str | None:
    """The module a call ``importlib.import_module("x")`` or ``__import__("x")`` imports, if literal and absolute."""
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    if name not in ("import_module", "__import__") or not call.args:
        return None
    first = call.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str) and not first.value.startswith("."):
        return first.value
    return None


def imports_of(module: str, path: Path) -> list[Import]:
    """Every import of ``module`` (source at ``path``), relative ones made absolute."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, at_import_time: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, path, node.lineno, alias.name, (), at_import_time))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            found.append(Import(module, path, node.lineno, target, tuple(a.name for a in node.names), at_import_time))
        elif isinstance(node, ast.Call) and (literal := _literal_import(node)) is not None:
            found.append(Import(module, path, node.lineno, literal, (), at_import_time))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            at_import_time = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            visit(node.test, at_import_time)
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, at_import_time)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, at_import_time)

    visit(tree, True)
    return found


def all_imports(src: Path, package: str) -> Iterator[Import]:
    for module, path in modules(src, package).items():
        yield from imports_of(module, path)


def violations(roots: list[tuple[Path, str]], forbidden: Callable[[str], bool]) -> list[str]:
    """Every import, anywhere in the given packages, of a module whose top-level name is ``forbidden``."""
    return [
        imp.describe()
        for src, package in roots
        for imp in all_imports(src, package)
        if imp.target and forbidden(imp.target.partition(".")[0])
    ]


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph(src: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package that importing it executes (module-level imports only).

    ``import a.b.c`` executes ``a``, ``a.b`` and ``a.b.c`` (``from a.b import c`` also ``a.b.c``
    when that is a module), except the packages that enclose the importer: those have already
    started by the time the importer runs, so passing through them adds no edge. Reading a name
    from an enclosing package (``from a import name``, ``name`` not a module) does: it needs
    that package's ``__init__`` to have got that far.
    """
    known = modules(src, package)
    graph: dict[str, set[str]] = {module: set() for module in known}
    for module, path in known.items():
        enclosing = _ancestors(module)
        for imp in imports_of(module, path):
            if not imp.at_import_time or not imp.target:
                continue
            parts = imp.target.split(".")
            executed = {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - enclosing
            executed |= {f"{imp.target}.{name}" for name in imp.names}
            if imp.target in enclosing and any(f"{imp.target}.{name}" not in known for name in imp.names):
                executed.add(imp.target)
            graph[module] |= {m for m in executed if m in known and m != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected group of modules that has one, as ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm; the graphs here are a few dozen modules deep at most
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group: set[str] = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph[node]:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)

    found = []
    for group in groups:
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        cycle: list[str] | None = None
        while frontier and cycle is None:
            following = []
            for node in frontier:
                for succ in sorted(graph[node] & group):
                    if succ == start:
                        cycle = [*paths[node], start]
                        break
                    if succ not in paths:
                        paths[succ] = [*paths[node], succ]
                        following.append(succ)
                if cycle is not None:
                    break
            frontier = following
        assert cycle is not None
        found.append(cycle)
    return sorted(found)


def _plugin_roots() -> list[tuple[Path, str]]:
    """Every strategy plugin (plugins/*) and engine adapter or integration (contrib/* but the two applications)."""
    roots = []
    for src in sorted([*ROOT.glob("plugins/*/src"), *ROOT.glob("contrib/*/src")]):
        for package in sorted(p.name for p in src.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
            if package not in APPLICATIONS:
                roots.append((src, package))
    return roots


class TestLayers:
    def test_library_imports_no_other_distribution(self) -> None:
        """No module of the library imports a plugin, an adapter or an application (any top-level ``kvroute_*``),
        wherever the import is."""
        assert len(modules(LIBRARY, "kvroute")) > 10
        assert violations([(LIBRARY, "kvroute")], lambda top: top.startswith("kvroute_")) == []

    def test_plugins_import_no_application(self) -> None:
        """No strategy plugin or engine adapter imports kvroute_server or kvroute_simulator."""
        roots = _plugin_roots()
        assert {package for _, package in roots} >= {
            "kvroute_random",
            "kvroute_bounded_load",
            "kvroute_vllm",
            "kvroute_litellm",
        }
        assert violations(roots, lambda top: top in APPLICATIONS) == []

    def test_server_does_not_import_the_simulator(self) -> None:
        """The proxy does not depend on the simulator (the emulator depends on the proxy, not the reverse)."""
        assert violations([(SERVER, "kvroute_server")], lambda top: top == "kvroute_simulator") == []

    @pytest.mark.parametrize(
        ("src", "package"), [(LIBRARY, "kvroute"), (SERVER, "kvroute_server"), (SIMULATOR, "kvroute_simulator")]
    )
    def test_no_import_cycle(self, src: Path, package: str) -> None:
        """Importing any module of the package never re-enters one of its own modules still being imported."""
        graph = import_graph(src, package)
        assert sum(map(len, graph.values())) > 0, f"no module-level import found in {package}"
        assert cycles(graph) == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


class TestChecker:
    """The checker catches what it claims to, on synthetic trees (else the layer tests prove nothing)."""

    def test_finds_every_kind_of_import(self, tmp_path: Path) -> None:
        """Imports at module level, in a function, under TYPE_CHECKING, relative, and literal dynamic ones are all
        found, with lines."""
        src = _tree(
            tmp_path,
            {
                "kvroute/__init__.py": "from .fleet import Fleet\n",
                "kvroute/fleet.py": (
                    "from typing import TYPE_CHECKING\n"
                    "import kvroute_random\n"
                    "if TYPE_CHECKING:\n"
                    "    from kvroute_server.proxy.app import App\n"
                    "def late():\n"
                    "    import kvroute_simulator.driver\n"
                    "    return __import__('kvroute_vllm')\n"
                    "class Fleet:\n"
                    "    def load(self):\n"
                    "        import importlib\n"
                    "        return importlib.import_module('kvroute_litellm.routing')\n"
                ),
                "kvroute/sub/__init__.py": "from .. import fleet\nfrom ..fleet import Fleet\n",
            },
        )
        found = {(imp.importer, imp.target, imp.line, imp.at_import_time) for imp in all_imports(src, "kvroute")}
        assert found >= {
            ("kvroute", "kvroute.fleet", 1, True),
            ("kvroute.fleet", "kvroute_random", 2, True),
            ("kvroute.fleet", "kvroute_server.proxy.app", 4, False),
            ("kvroute.fleet", "kvroute_simulator.driver", 6, False),
            ("kvroute.fleet", "kvroute_vllm", 7, False),
            ("kvroute.fleet", "kvroute_litellm.routing", 11, False),
            ("kvroute.sub", "kvroute", 1, True),
            ("kvroute.sub", "kvroute.fleet", 2, True),
        }
        bad = violations([(src, "kvroute")], lambda top: top.startswith("kvroute_"))
        assert [line.rpartition(": ")[2] for line in bad] == [
            "kvroute.fleet imports kvroute_random",
            "kvroute.fleet imports kvroute_server.proxy.app",
            "kvroute.fleet imports kvroute_simulator.driver",
            "kvroute.fleet imports kvroute_vllm",
            "kvroute.fleet imports kvroute_litellm.routing",
        ]
        assert bad[0].startswith(f"{src / 'kvroute' / 'fleet.py'}:2: ")

    def test_clean_tree_has_no_violation(self, tmp_path: Path) -> None:
        """Imports of the standard library, third parties and the package itself are not violations."""
        src = _tree(
            tmp_path,
            {"kvroute/__init__.py": "import os\nimport attrs\nfrom kvroute import fleet\n", "kvroute/fleet.py": ""},
        )
        assert violations([(src, "kvroute")], lambda top: top.startswith("kvroute_")) == []

    def test_finds_a_module_level_cycle(self, tmp_path: Path) -> None:
        """A cycle of module-level imports is reported, through ``from pkg import module`` and relative imports too."""
        src = _tree(
            tmp_path,
            {
                "app/__init__.py": "",
                "app/a.py": "from app import b\n",
                "app/b.py": "from .c import thing\n",
                "app/c.py": "import app.a\nthing = 1\n",
                "app/d.py": "import app.a\n",
            },
        )
        assert cycles(import_graph(src, "app")) == [["app.a", "app.b", "app.c", "app.a"]]

    def test_finds_a_cycle_through_a_package_init(self, tmp_path: Path) -> None:
        """Importing a module of another subpackage runs that subpackage's __init__, which can close a cycle."""
        src = _tree(
            tmp_path,
            {
                "app/__init__.py": "",
                "app/cli.py": "from app.emulator.server import run\n",
                "app/emulator/__init__.py": "from app.cli import main\n",
                "app/emulator/server.py": "run = 1\n",
            },
        )
        assert cycles(import_graph(src, "app")) == [["app.cli", "app.emulator", "app.cli"]]

    def test_ignores_deferred_and_type_only_imports(self, tmp_path: Path) -> None:
        """Imports inside functions or under ``if TYPE_CHECKING:``, and passing through an enclosing package, make no
        cycle; the same imports at module level do."""
        a_typed = (
            "import typing\nif typing.TYPE_CHECKING:\n    from app.b import y\n"
            "import app.b as later\nfrom app import b\nx = 1\n"
        )
        b_deferred = "def f():\n    from app.a import x\n    return x\ny = 2\n"
        src = _tree(
            tmp_path,
            {"app/__init__.py": "VERSION = 1\nfrom app.a import x\n", "app/a.py": a_typed, "app/b.py": b_deferred},
        )
        graph = import_graph(src, "app")
        assert graph == {"app": {"app.a"}, "app.a": {"app.b"}, "app.b": set()}
        assert cycles(graph) == []
        _tree(tmp_path, {"app/a.py": "from app.b import y\nx = 1\n", "app/b.py": "from app.a import x\ny = 2\n"})
        assert cycles(import_graph(src, "app")) == [["app.a", "app.b", "app.a"]]

    def test_name_read_from_an_enclosing_package_is_a_cycle(self, tmp_path: Path) -> None:
        """A module reading a name from the package whose __init__ imports it depends on that __init__'s order: a
        cycle."""
        src = _tree(
            tmp_path,
            {
                "app/__init__.py": "from app.a import x\nVERSION = 1\n",
                "app/a.py": "from app import VERSION\nx = VERSION\n",
            },
        )
        assert cycles(import_graph(src, "app")) == [["app", "app.a", "app"]]
        _tree(tmp_path, {"app/a.py": "from app import b\nimport app.b\nx = 1\n", "app/b.py": ""})
        assert cycles(import_graph(src, "app")) == []
