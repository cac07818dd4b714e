"""kvroute-server's plugin module (entry point ``server`` in group ``kvroute``): its commands.

Importing it is cheap: the proxy itself is imported when ``kvroute serve`` runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvroute

if TYPE_CHECKING:
    import click


@kvroute.hookimpl
def kvroute_register_commands(cli: click.Group) -> None:
    from kvroute_server.cli import serve
    from kvroute_server.parity import check_parity

    cli.add_command(serve, "serve")
    cli.add_command(check_parity, "check-parity")
