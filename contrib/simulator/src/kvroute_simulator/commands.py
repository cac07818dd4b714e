"""kvroute-simulator's plugin module (entry point ``simulator`` in group ``kvroute``): its commands.

``kvroute emulate`` serves HTTP with the proxy's server code, so it needs kvroute-server too
(``pip install "kvroute[emulator]"``); without it the command says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvroute

if TYPE_CHECKING:
    import click


@kvroute.hookimpl
def kvroute_register_commands(cli: click.Group) -> None:
    from kvroute.cli import missing_command
    from kvroute_simulator.cli import simulate

    cli.add_command(simulate, "simulate")
    try:
        from kvroute_simulator.emulator.cli import emulate
    except ModuleNotFoundError as exc:
        hint = (
            f"'kvroute emulate' needs kvroute-server (missing module {exc.name!r}). "
            'Install it with: pip install "kvroute[emulator]"'
        )
        cli.add_command(missing_command("emulate", hint), "emulate")
    else:
        cli.add_command(emulate, "emulate")
