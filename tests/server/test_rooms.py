"""The proxy's rooms: one-way imports between its modules, bounded sizes, capabilities found by protocol."""

from __future__ import annotations

import ast
from pathlib import Path

import kvroute_server

PACKAGE = Path(kvroute_server.__file__).parent
#: The rooms and what each may import of the others (anything else of the package is a helper).
ROOMS = {
    "app": {"admin", "backends", "forwarding"},
    "forwarding": {"backends"},
    "admin": {"backends"},
    "backends": {"health"},
    "health": set(),
}
#: Modules that may import the app: the entry points that run it.
RUNS_THE_APP = {"__init__", "cli", "workers"}


def _imports(module: str) -> set[str]:
    """The package's modules ``module`` imports, anywhere in it (in functions and under TYPE_CHECKING too)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            parts = node.module.split(".")
            if parts[0] == "kvroute_server":
                found |= {parts[1]} if len(parts) > 1 else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("kvroute_server.")}
    return found - {module}


def _graph() -> dict[str, set[str]]:
    return {path.stem: _imports(path.stem) for path in sorted(PACKAGE.glob("*.py"))}


class TestRooms:
    def test_rooms_import_one_way(self) -> None:
        """Each room imports only the rooms below it: admin talks to the backend set, never to the app or forwarding."""
        graph = _graph()
        for room, allowed in ROOMS.items():
            assert graph[room] & set(ROOMS) <= allowed, f"{room} imports {sorted(graph[room] & set(ROOMS) - allowed)}"

    def test_only_entry_points_import_the_app(self) -> None:
        """Nothing but the modules that run the proxy imports kvroute_server.app."""
        importers = {module for module, deps in _graph().items() if "app" in deps}
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
            text = (PACKAGE / f"{room}.py").read_text(encoding="utf-8")
            assert text.count("\n") <= 500, f"{room}.py has {text.count(chr(10))} lines"
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef):
                    size = (node.end_lineno or node.lineno) - node.lineno + 1
                    assert size <= 300, f"{room}.{node.name} has {size} lines"

    def test_capabilities_are_declared_not_probed(self) -> None:
        """The rooms find adapters' and strategies' capabilities with isinstance on protocols, never getattr by name."""
        names = {"probe", "list_models", "poll_load", "run_events", "aclose", "prompt_tokenizer", "health_path"}
        for room in ROOMS:
            for node in ast.walk(ast.parse((PACKAGE / f"{room}.py").read_text(encoding="utf-8"))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in {"getattr", "hasattr"}
                ):
                    named = node.args[1] if len(node.args) > 1 else None
                    assert not (isinstance(named, ast.Constant) and named.value in names), f"{room}.py:{node.lineno}"
