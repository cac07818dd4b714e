"""kvroute-server's plugin module (entry point ``server`` in group ``kvroute``): its commands and discovery kinds.

Importing it is cheap: the proxy itself is imported when ``kvroute serve`` runs, a provider's
module when a source of its kind is configured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import kvroute

if TYPE_CHECKING:
    from collections.abc import Callable

    import click

    from kvroute.discovery import DiscoveryProvider


@kvroute.hookimpl
def kvroute_register_commands(cli: click.Group) -> None:
    from kvroute_server.cli import serve
    from kvroute_server.parity import check_parity

    cli.add_command(serve, "serve")
    cli.add_command(check_parity, "check-parity")


def _file(**options: Any) -> DiscoveryProvider:
    from kvroute_server.fleet.providers.file import FileDiscovery

    return FileDiscovery.create(**options)


def _dns(**options: Any) -> DiscoveryProvider:
    from kvroute_server.fleet.providers.dns import DnsDiscovery

    return DnsDiscovery.create(**options)


@kvroute.hookimpl
def kvroute_register_discovery(register: Callable[..., None]) -> None:
    # The factories import their provider on first use, so listing kinds (kvroute plugins) imports neither.
    register("file", _file)
    register("dns", _dns)
