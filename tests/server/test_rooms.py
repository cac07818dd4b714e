"""The proxy's rooms: one-way imports between its modules, bounded sizes, capabilities found by protocol."""

from __future__ import annotations

import ast
from pathlib import Path

import kvroute_server

PACKAGE = Path(kvroute_server.__file__).parent
#: The proxy's parts (sub-packages) and which others each may import; ``config`` and ``parity`` are shared helpers.
PARTS = {
    "http": set(),
    "fleet": {"http", "ops"},
    "ops": {"http", "fleet", "proxy"},
    "proxy": {"http", "fleet", "ops"},
}
#: The rooms (modules) and what each may import of the others (anything else of the package is a helper).
ROOMS = {
    "proxy.app": {"ops.admin", "fleet.backends", "proxy.forwarding"},
    "proxy.forwarding": {"fleet.backends"},
    "ops.admin": {"fleet.backends"},
    "fleet.backends": {"fleet.health"},
    "fleet.health": set(),
}
#: Modules that may import the app: the entry points that run it.
RUNS_THE_APP = {"__init__", "cli", "ops.workers"}
#: Of the fleet, only the metrics of the operations part (every part counts what it does).
FLEET_MAY_IMPORT_OF_OPS = {"ops.metrics"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _path(module: str) -> Path:
    candidate = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
    return candidate if candidate.exists() else PACKAGE.joinpath(*module.split("."), "__init__.py")


def _imports(module: str) -> set[str]:
    """The package's modules ``module`` imports, anywhere in it (in functions and under TYPE_CHECKING too)."""
    tree = ast.parse(_path(module).read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            parts = node.module.split(".")
            if parts[0] == "kvroute_server":
                if len(parts) > 1:
                    found.add(".".join(parts[1:]))
                else:
                    found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("kvroute_server.")}
    return found - {module}


def _graph() -> dict[str, set[str]]:
    return {_module_name(path): _imports(_module_name(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def _part(module: str) -> str:
    return module.split(".")[0]


class TestRooms:
    def test_parts_import_one_way(self) -> None:
        """The http part imports no other part; the fleet imports only the metrics of the operations part."""
        for module, deps in _graph().items():
            part = _part(module)
            if part not in PARTS:
                continue
            others = {dep for dep in deps if _part(dep) in PARTS and _part(dep) != part}
            wrong = sorted(dep for dep in others if _part(dep) not in PARTS[part])
            assert not wrong, f"{module} imports {wrong}"
            if part == "fleet":
                assert {d for d in others if _part(d) == "ops"} <= FLEET_MAY_IMPORT_OF_OPS, (
                    f"{module}: {sorted(others)}"
                )

    def test_layout_is_the_documented_one(self) -> None:
        """Every module of the proxy lives in one of the documented parts (or is a top-level entry point)."""
        top_level = {"__init__", "cli", "commands", "config", "sagemaker"}
        for module in _graph():
            assert _part(module) in {*PARTS, "parity"} or module in top_level, module

    def test_rooms_import_one_way(self) -> None:
        """Each room imports only the rooms below it: admin talks to the backend set, never to the app or forwarding."""
        graph = _graph()
        for room, allowed in ROOMS.items():
            assert graph[room] & set(ROOMS) <= allowed, f"{room} imports {sorted(graph[room] & set(ROOMS) - allowed)}"

    def test_only_entry_points_import_the_app(self) -> None:
        """Nothing but the modules that run the proxy imports kvroute_server.proxy.app."""
        importers = {module for module, deps in _graph().items() if "proxy.app" in deps}
        assert importers <= RUNS_THE_APP, sorted(importers - RUNS_THE_APP)

    def test_no_import_cycle(self) -> None:
        """The package's modules import each other without a cycle."""
        graph = _graph()
        done: set[str] = set()

        def visit(module: str, path: tuple[str, ...]) -> None:
            assert module not in path, " -> ".join((*path, module))
            if module in done:
                return
            for dep in graph.get(module, ()):
                visit(dep, (*path, module))
            done.add(module)

        for module in graph:
            visit(module, ())

    def test_rooms_stay_small(self) -> None:
        """No class in a room is over 300 lines and no room over 500 lines."""
        for room in ROOMS:
            text = _path(room).read_text(encoding="utf-8")
            assert text.count("\n") <= 500, f"{room}.py has {text.count(chr(10))} lines"
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef):
                    size = (node.end_lineno or node.lineno) - node.lineno + 1
                    assert size <= 300, f"{room}.{node.name} has {size} lines"

    def test_capabilities_are_declared_not_probed(self) -> None:
        """The rooms find adapters' and strategies' capabilities with isinstance on protocols, never getattr by name."""
        names = {"probe", "list_models", "poll_load", "run_events", "aclose", "prompt_tokenizer", "health_path"}
        for room in ROOMS:
            for node in ast.walk(ast.parse(_path(room).read_text(encoding="utf-8"))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in {"getattr", "hasattr"}
                ):
                    named = node.args[1] if len(node.args) > 1 else None
                    assert not (isinstance(named, ast.Constant) and named.value in names), f"{room}.py:{node.lineno}"
