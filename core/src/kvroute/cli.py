"""The ``kvroute`` command line.

Subcommands live in the modules that implement them and are loaded lazily, so
``kvroute plugins`` does not import the proxy or the simulator. A subcommand whose module
is not part of this installation (for example ``serve`` without ``kvroute[server]``)
explains how to get it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from typing import Any

import click
import structlog

from kvroute import __version__
from kvroute.errors import KvrouteError

#: name -> ("module:attribute", the extra that provides its dependencies, one-line help)
_LAZY_COMMANDS: dict[str, tuple[str, str | None, str]] = {
    "simulate": ("kvroute.simulation.cli:simulate", None, "Simulate a fleet and compare strategies."),
    "serve": ("kvroute.server.cli:serve", "server", "Run the OpenAI-compatible routing proxy."),
    "emulate": ("kvroute.emulator.cli:emulate", "server", "Run an engine emulator (a fake vLLM server)."),
    "check-parity": ("kvroute.parity:check_parity", "server", "Compare the router's tokenizer with an engine's."),
}


#: Top-level logger names of the in-repo plugins and adapters (their modules use kvroute.logs).
_LIBRARY_LOGGERS = (
    "kvroute_tokenizer_prefix",
    "kvroute_vllm",
    "kvroute_tensorrt_llm",
    "kvroute_litellm",
)


def configure_logging(level: str = "warning", fmt: str = "console") -> None:
    """Configure structlog for a command-line process (library code never does this)."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise click.BadParameter(f"expected one of debug, info, warning, error (got {level!r})", param_hint="--log-level")
    renderer: Any = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Library modules log through the standard library (kvroute.logs): show their events on
    # stderr too, rendered by the processors above, one line each.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("kvroute")
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    root.propagate = False
    for name in _LIBRARY_LOGGERS:
        lib = logging.getLogger(name)
        lib.handlers[:] = [handler]
        lib.setLevel(numeric)
        lib.propagate = False


class _LazyGroup(click.Group):
    def _available(self) -> dict[str, tuple[str, str | None, str]]:
        out = {}
        for name, spec in _LAZY_COMMANDS.items():
            module = spec[0].split(":")[0]
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:
                found = False
            if found:
                out[name] = spec
        return out

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._available()))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        spec = self._available().get(cmd_name)
        if spec is None:
            return None
        module_name, attr = spec[0].split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            extra = spec[1]
            hint = f' Install it with: pip install "kvroute[{extra}]"' if extra else ""
            raise click.ClickException(f"'kvroute {cmd_name}' needs {exc.name!r}, which is not installed.{hint}") from None
        cmd = getattr(module, attr)
        assert isinstance(cmd, click.Command)
        return cmd


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvroute")
def main() -> None:
    """kvroute: prefix-aware routing for LLM inference fleets.

    \b
    Examples:
      kvroute plugins              list installed strategies and backend kinds
      kvroute simulate             compare every strategy on the built-in scenario
      kvroute serve --help         run the routing proxy
    """


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plugins(as_json: bool) -> None:
    """List installed strategies and backend kinds, with their distribution and version."""
    import json

    from rich.console import Console
    from rich.table import Table

    from kvroute.plugins import PluginManager

    try:
        pm = PluginManager()
        rows = [("strategy", r) for r in pm.strategies.values()] + [("backend kind", r) for r in pm.backend_kinds.values()]
    except KvrouteError as exc:
        raise click.ClickException(str(exc)) from None
    rows.sort(key=lambda row: (row[0], row[1].name))
    if as_json:
        data = [
            {"type": kind, "name": r.name, "plugin": r.plugin.name, "distribution": r.plugin.distribution, "version": r.plugin.version}
            for kind, r in rows
        ]
        click.echo(json.dumps(data, indent=2))
        return
    table = Table(title="kvroute plugins")
    for column in ("type", "name", "distribution", "version", "plugin"):
        table.add_column(column)
    for kind, r in rows:
        table.add_row(kind, r.name, r.plugin.distribution or "-", r.plugin.version or "-", r.plugin.name)
    Console(width=max(100, Console().width)).print(table)


if __name__ == "__main__":  # pragma: no cover
    main()
