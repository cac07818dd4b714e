"""Hook specifications: every hook a kvroute plugin may implement.

Hooks serve registration and lifecycle events only. The request path never goes through
pluggy: the router calls the chosen strategy object directly, and the per-request hooks
below are only called when some plugin implements them.

Implement a hook with ``@kvroute.hookimpl`` in the module your ``kvroute`` entry point names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvroute._markers import hookspec

if TYPE_CHECKING:
    import click

    from kvroute.fleet import Fleet, FleetEvent
    from kvroute.request import RouteRequest
    from kvroute.strategy import Decision, Outcome

# -------------------------------------------------------------------------
# Registration hooks
# -------------------------------------------------------------------------


@hookspec
def kvroute_register_strategies(register: Callable[..., None]) -> None:
    """Register routing strategies.

    Call ``register(name, factory)`` once per strategy. ``name`` is what users write in
    ``--strategy``; ``factory(**options)`` returns an object with a ``pick`` method (see
    `kvroute.Strategy`). Options arrive as keyword arguments (strings from the CLI, typed
    values from code): validate them and raise ``ValueError`` with a clear message.

    Not firstresult: every plugin's implementation is called.

    :param register: ``register(name: str, factory: Callable[..., Strategy]) -> None``.

    Since 0.1.
    """


@hookspec
def kvroute_register_backend_kinds(register: Callable[..., None]) -> None:
    """Register backend kinds (engine adapters) such as ``vllm`` or ``tensorrt-llm``.

    Call ``register(kind, factory)`` once per kind. ``factory(backend, **options)`` returns
    an adapter object for one backend of that kind (health probes, served models, load
    telemetry, KV events); the adapter protocol is `kvroute.adapters.BackendAdapter`.

    Not firstresult: every plugin's implementation is called.

    :param register: ``register(kind: str, factory: Callable[..., Any]) -> None``.

    Since 0.1.
    """


@hookspec
def kvroute_register_discovery(register: Callable[..., None]) -> None:
    """Register discovery kinds: sources of backends such as ``dns`` or ``kubernetes``.

    Call ``register(kind, factory)`` once per kind. ``factory(**options)`` returns a
    `kvroute.discovery.DiscoveryProvider`; options come from the host's configuration (the
    TOML ``[[discovery]]`` table, or ``--discovery KIND:TARGET``, which passes ``target``).
    Validate them and raise ``ValueError`` with a clear message.

    Not firstresult: every plugin's implementation is called.

    :param register: ``register(kind: str, factory: Callable[..., DiscoveryProvider]) -> None``.

    Since 0.1.
    """


@hookspec
def kvroute_register_commands(cli: click.Group) -> None:
    """Add subcommands to the ``kvroute`` command line.

    ``cli`` is the top-level `click.Group`: decorate functions with ``@cli.command()`` or call
    ``cli.add_command(command)``. Keep this cheap (``kvroute --help`` calls it): import what a
    command needs inside its callback, not at module level. A name already taken by another
    plugin is refused with an error naming both. Not firstresult.

    :param cli: the ``kvroute`` `click.Group`.

    Since 0.1.
    """


# -------------------------------------------------------------------------
# Lifecycle hooks
# -------------------------------------------------------------------------


@hookspec
def kvroute_fleet_changed(fleet: Fleet, event: FleetEvent) -> None:
    """A backend was added, removed, drained, ejected, restored or re-weighted, or the models it serves changed.

    Called after the change, with the fleet's lock held: do not block, do not change the
    fleet from here. Not firstresult.

    :param fleet: the `kvroute.Fleet` that changed.
    :param event: the `kvroute.FleetEvent` (kind, backend, new version).

    An exception raised here is logged (``plugin_hook_failed``, naming the plugin) and does not
    affect the request or the change; the other plugins' implementations still run. Take no
    wrappers (``hookwrapper``/``wrapper`` implementations are refused at registration).

    Since 0.1.
    """


@hookspec
def kvroute_request_routed(request: RouteRequest, decision: Decision) -> None:
    """A request was given a backend (it now counts as in flight there).

    Runs on the request path: keep it to microseconds (count, log, enqueue). Not firstresult.

    :param request: the `kvroute.RouteRequest`.
    :param decision: the `kvroute.Decision` (strategy, backend, reason, detail, pick duration).

    An exception raised here is logged (``plugin_hook_failed``, naming the plugin) and does not
    affect the request or the change; the other plugins' implementations still run. Take no
    wrappers (``hookwrapper``/``wrapper`` implementations are refused at registration).

    Since 0.1.
    """


@hookspec
def kvroute_request_finished(request: RouteRequest, decision: Decision, outcome: Outcome) -> None:
    """A routed request left its backend: finished, failed or was cancelled.

    Runs on the request path: keep it short. Not firstresult.

    :param request: the `kvroute.RouteRequest`.
    :param decision: the `kvroute.Decision` it was routed with.
    :param outcome: the `kvroute.Outcome` (``ok``/``error``/``cancelled``, duration, error text).

    An exception raised here is logged (``plugin_hook_failed``, naming the plugin) and does not
    affect the request or the change; the other plugins' implementations still run. Take no
    wrappers (``hookwrapper``/``wrapper`` implementations are refused at registration).

    Since 0.1.
    """


def _all_specs() -> dict[str, Any]:
    """Every hook spec in this module, by name (used by docs tests and the CLI)."""
    return {name: obj for name, obj in globals().items() if name.startswith("kvroute_") and callable(obj)}
