"""The ``kvroute`` command line.

The library itself adds one subcommand, ``kvroute plugins``. The others come from plugins
through the ``kvroute_register_commands`` hook: ``simulate`` and ``emulate`` from
kvroute-simulator, ``serve`` and ``check-parity`` from kvroute-server, and whatever a third
party adds. A subcommand of kvroute's own distributions that is not installed is still listed
by ``kvroute --help``, marked with the pip command that brings it, and running it (with any
arguments) prints that command and exits 1 instead of "No such command".
"""

from __future__ import annotations

import difflib
import logging
import sys
from typing import Any

import attrs
import click
import structlog

from kvroute import __version__
from kvroute.errors import KvrouteError
from kvroute.logs import filtering_bound_logger, render_json, stamp_utc


@attrs.frozen
class _KnownCommand:
    """A subcommand one of kvroute's own distributions adds, listed even when it is not installed."""

    help: str
    distribution: str
    extra: str

    def install_hint(self, name: str) -> str:
        return (
            f"'kvroute {name}' comes with the {self.distribution} distribution, which is not installed. "
            f'Install it with: pip install "kvroute[{self.extra}]"'
        )


#: The subcommands of kvroute's own distributions (they add them through the
#: ``kvroute_register_commands`` hook). A missing one is still listed by `kvroute --help`, and
#: running it says what to install.
_KNOWN_COMMANDS: dict[str, _KnownCommand] = {
    "simulate": _KnownCommand("Simulate a fleet and compare strategies.", "kvroute-simulator", "simulator"),
    "emulate": _KnownCommand("Run an engine emulator (a fake vLLM server).", "kvroute-simulator", "emulator"),
    "serve": _KnownCommand("Run the OpenAI-compatible routing proxy.", "kvroute-server", "server"),
    "check-parity": _KnownCommand("Compare the router's tokenizer with an engine's.", "kvroute-server", "server"),
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
        raise click.BadParameter(
            f"expected one of debug, info, warning, error (got {level!r})", param_hint="--log-level"
        )
    renderer: Any = render_json if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            stamp_utc,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=filtering_bound_logger(numeric),
        # One write and a flush per line (PrintLogger's print writes the newline separately).
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
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


def missing_command(name: str, message: str) -> click.Command:
    """A stand-in for a command that cannot run here: whatever it is given, it says what to install."""

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


class _PluginGroup(click.Group):
    """The ``kvroute`` group: its subcommands come from plugins (``kvroute_register_commands``).

    Plugins are asked once, the first time a command is looked up or listed. A known
    subcommand whose distribution is missing is listed with what to install, and running it
    says so; a broken plugin is an error naming it.
    """

    _loaded = False

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        from kvroute.plugins import PluginManager

        try:
            PluginManager().register_commands(self)
        except KvrouteError as exc:
            raise click.ClickException(str(exc)) from None

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._load()
        return sorted(set(super().list_commands(ctx)) | set(_KNOWN_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        self._load()
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        known = _KNOWN_COMMANDS.get(cmd_name)
        return missing_command(cmd_name, known.install_hint(cmd_name)) if known else None

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
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
            command = super().get_command(ctx, name)
            if command is not None:
                if not command.hidden:
                    rows.append((name, command.get_short_help_str(limit)))
            else:
                known = _KNOWN_COMMANDS[name]
                rows.append((name, f'{known.help} [needs: pip install "kvroute[{known.extra}]"]'))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=_PluginGroup, context_settings={"help_option_names": ["-h", "--help"]})
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

    from kvroute.plugins import PluginManager

    try:
        pm = PluginManager()
        rows = (
            [("strategy", r) for r in pm.strategies.values()]
            + [("backend kind", r) for r in pm.backend_kinds.values()]
            + [("discovery", r) for r in pm.discovery_kinds.values()]
        )
    except KvrouteError as exc:
        raise click.ClickException(str(exc)) from None
    rows.sort(key=lambda row: (row[0], row[1].name))
    if as_json:
        data = [
            {
                "type": kind,
                "name": r.name,
                "plugin": r.plugin.name,
                "distribution": r.plugin.distribution,
                "version": r.plugin.version,
            }
            for kind, r in rows
        ]
        click.echo(json.dumps(data, indent=2))
        return
    header = ("type", "name", "distribution", "version", "plugin")
    table = [header] + [
        (kind, r.name, r.plugin.distribution or "-", r.plugin.version or "-", r.plugin.name) for kind, r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            click.echo("  ".join("-" * width for width in widths))


if __name__ == "__main__":  # pragma: no cover
    main()
