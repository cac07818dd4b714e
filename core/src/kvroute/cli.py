"""The ``kvroute`` command line.

Subcommands live in the modules that implement them and are loaded lazily, from the table
`_LAZY_COMMANDS`, so ``kvroute plugins`` or ``kvroute --help`` does not import the proxy or the
simulator. Every subcommand is always listed. One whose extra is not installed (``serve``
without ``kvroute[server]``) is marked with the pip command in ``kvroute --help``, and running
it, with any arguments, prints that command and exits 1 instead of "No such command".
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import logging
import sys
from typing import Any

import attrs
import click
import structlog

from kvroute import __version__
from kvroute.errors import KvrouteError


@attrs.frozen
class _LazyCommand:
    """A subcommand implemented in another module, imported only when it runs.

    ``extra`` is the pip extra that installs its third-party dependencies and ``needs`` the
    top-level modules of that extra it imports, checked without importing them; ``what``
    names them in the message a user sees when one is missing.
    """

    target: str  # "module:attribute" of the click command
    help: str  # its line in `kvroute --help` (listing imports nothing)
    extra: str | None = None
    needs: tuple[str, ...] = ()
    what: str = "its dependencies"

    def missing_module(self) -> str | None:
        """The first module of ``needs`` that cannot be imported here, or ``None``."""
        for module in self.needs:
            try:
                if importlib.util.find_spec(module) is None:
                    return module
            except (ImportError, ValueError):
                return module
        return None

    def install_hint(self, name: str, missing: str) -> str:
        """What to tell a user who runs ``kvroute NAME`` without module ``missing``."""
        what = f"{self.what} (missing module {missing!r})"
        if self.extra is None:
            return f"'kvroute {name}' needs {what}, which is not installed."
        return f'\'kvroute {name}\' needs {what}. Install them with: pip install "kvroute[{self.extra}]"'


_SERVER_MODULES = ("uvicorn", "aiohttp", "prometheus_client")

#: Every subcommand kvroute ships besides `plugins`. Each one is always listed by
#: `kvroute --help`, and says what to install when its extra is missing.
_LAZY_COMMANDS: dict[str, _LazyCommand] = {
    "simulate": _LazyCommand("kvroute.simulation.cli:simulate", "Simulate a fleet and compare strategies."),
    "serve": _LazyCommand(
        "kvroute.server.cli:serve", "Run the OpenAI-compatible routing proxy.", "server", _SERVER_MODULES, "the proxy's dependencies"
    ),
    "emulate": _LazyCommand(
        "kvroute.emulator.cli:emulate", "Run an engine emulator (a fake vLLM server).", "server", _SERVER_MODULES,
        "the emulator's dependencies",
    ),
    "check-parity": _LazyCommand(
        "kvroute.parity:check_parity", "Compare the router's tokenizer with an engine's.", "server", ("aiohttp",),
        "the HTTP client's dependencies",
    ),
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


def _missing_extra_command(name: str, message: str) -> click.Command:
    """A stand-in for a command whose dependencies are missing: whatever it is given, it says what to install."""

    def explain(args: tuple[str, ...]) -> None:
        raise click.ClickException(message)

    return click.Command(
        name,
        callback=explain,
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
        help=message,
        short_help=message,
    )


class _LazyGroup(click.Group):
    """A group whose table-listed commands are imported when invoked, never just to be listed."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(_LAZY_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        spec = _LAZY_COMMANDS.get(cmd_name)
        if spec is None:
            return None
        missing = spec.missing_module()
        if missing is not None:
            return _missing_extra_command(cmd_name, spec.install_hint(cmd_name, missing))
        module_name, attr = spec.target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # A dependency that `needs` does not list (or that is installed but broken). A
            # module of kvroute itself missing is a broken installation: let it surface.
            if exc.name is None or exc.name.partition(".")[0] == "kvroute":
                raise
            return _missing_extra_command(cmd_name, spec.install_hint(cmd_name, exc.name))
        cmd = getattr(module, attr)
        assert isinstance(cmd, click.Command)
        return cmd

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=1)
            if close:
                ctx.fail(f"No such command {name!r}. Did you mean {close[0]!r}?")
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names), default=0)
        rows = []
        for name in names:
            spec = _LAZY_COMMANDS.get(name)
            if spec is None:
                command = super().get_command(ctx, name)
                if command is not None and not command.hidden:
                    rows.append((name, command.get_short_help_str(limit)))
            elif spec.extra is not None and spec.missing_module() is not None:
                rows.append((name, f'{spec.help} [needs: pip install "kvroute[{spec.extra}]"]'))
            else:
                rows.append((name, spec.help))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


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
