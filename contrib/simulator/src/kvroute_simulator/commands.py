"""kvroute-simulator's plugin module (entry point ``simulator`` in group ``kvroute``): its commands.

``kvroute emulate`` serves HTTP with the proxy's server code, so it needs kvroute-server too
(``pip install "kvroute[emulator]"``); without it the command is listed as needing that extra
and, whatever its arguments, says what to install. A module of kvroute or kvroute-simulator
itself that is missing is a broken installation, not a missing extra: that error propagates
(the plugin manager reports it naming this plugin).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvroute

if TYPE_CHECKING:
    import click

#: `kvroute --help`'s line for emulate when kvroute-server is missing (as kvroute lists a missing command).
EMULATE_NEEDS_SERVER = 'Run an engine emulator (a fake vLLM server). [needs: pip install "kvroute[emulator]"]'


@kvroute.hookimpl
def kvroute_register_commands(cli: click.Group) -> None:
    from kvroute.cli import missing_command
    from kvroute_simulator.cli import simulate

    cli.add_command(simulate, "simulate")
    try:
        from kvroute_simulator.emulator.cli import emulate
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] in ("kvroute", "kvroute_simulator"):
            raise
        hint = (
            f"'kvroute emulate' needs kvroute-server (missing module {exc.name!r}). "
            'Install it with: pip install "kvroute[emulator]"'
        )
        stand_in = missing_command("emulate", hint)
        stand_in.short_help = EMULATE_NEEDS_SERVER
        cli.add_command(stand_in, "emulate")
    else:
        cli.add_command(emulate, "emulate")
