"""A small typed facade over pluggy: loads ``kvroute`` entry points, collects registrations.

Environment switches (as pytest and tox offer):

* ``KVROUTE_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points except those named in
  ``KVROUTE_PLUGINS`` (comma-separated entry-point names).
* ``KVROUTE_BLOCK_PLUGINS=a,b``: never load the entry points named ``a`` and ``b``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import attrs
import pluggy

from kvroute import hookspecs
from kvroute._markers import PROJECT
from kvroute.errors import ConfigError, PluginLoadError
from kvroute.logs import get_logger
from kvroute.strategy import Strategy, StrategyFactory, build_strategy

__all__ = [
    "BLOCK_ENV",
    "DISABLE_AUTOLOAD_ENV",
    "ENTRY_POINT_GROUP",
    "LIFECYCLE_HOOKS",
    "PLUGINS_ENV",
    "PluginInfo",
    "PluginManager",
    "Registration",
]

log = get_logger(__name__)

ENTRY_POINT_GROUP = "kvroute"
DISABLE_AUTOLOAD_ENV = "KVROUTE_DISABLE_PLUGIN_AUTOLOAD"
PLUGINS_ENV = "KVROUTE_PLUGINS"
BLOCK_ENV = "KVROUTE_BLOCK_PLUGINS"
#: Hooks that notify plugins of events; called through `PluginManager.notify`, failures logged.
LIFECYCLE_HOOKS = ("kvroute_fleet_changed", "kvroute_request_routed", "kvroute_request_finished")


def _csv_env(name: str) -> set[str]:
    return {part.strip() for part in os.environ.get(name, "").split(",") if part.strip()}


@attrs.frozen
class PluginInfo:
    """Where a plugin came from: its registered name, distribution and version."""

    name: str
    distribution: str | None = None
    version: str | None = None

    def describe(self) -> str:
        if self.distribution:
            return f"plugin {self.name!r} (distribution {self.distribution} {self.version})"
        return f"plugin {self.name!r}"


@attrs.frozen
class Registration:
    """One registered strategy or backend kind, with the plugin that registered it."""

    name: str
    factory: Callable[..., Any]
    plugin: PluginInfo


class PluginManager:
    """Finds plugins, calls their registration hooks, and exposes what they registered.

    ``autoload=None`` follows ``KVROUTE_DISABLE_PLUGIN_AUTOLOAD``. Registration hooks are
    called lazily, on first use of :attr:`strategies` or :attr:`backend_kinds`.
    """

    def __init__(self, *, autoload: bool | None = None, blocked: set[str] | None = None) -> None:
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._info: dict[str, PluginInfo] = {}
        self._strategies: dict[str, Registration] | None = None
        self._kinds: dict[str, Registration] | None = None
        self._discovery: dict[str, Registration] | None = None
        self._blocked = (blocked if blocked is not None else set()) | _csv_env(BLOCK_ENV)
        from kvroute import _builtin

        self.register(_builtin, name="kvroute.builtin", info=PluginInfo("kvroute.builtin", "kvroute", _own_version()))
        if autoload is None:
            autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in ("1", "true", "yes")
        if autoload:
            self.load_entrypoints()
        else:
            self.load_entrypoints(only=_csv_env(PLUGINS_ENV))

    # -- loading -----------------------------------------------------------------------

    @property
    def hook(self) -> Any:
        """pluggy's hook relay, for lifecycle hooks (``pm.hook.kvroute_fleet_changed(...)``)."""
        return self._pm.hook

    def has_implementations(self, hook_name: str) -> bool:
        """Whether any plugin implements ``hook_name`` (the router skips hooks nobody wants)."""
        caller = getattr(self._pm.hook, hook_name)
        return bool(caller.get_hookimpls())

    def register(self, plugin: ModuleType | object, name: str | None = None, info: PluginInfo | None = None) -> None:
        """Register a plugin object (a module or an instance with ``@hookimpl`` methods).

        Raises `PluginLoadError` when it implements a lifecycle hook as a wrapper: those are
        called one implementation at a time (see :meth:`notify`), so there is nothing to wrap.
        """
        registered = self._pm.register(plugin, name=name)
        if registered is None:
            return
        info = info or PluginInfo(registered)
        for hook_name in LIFECYCLE_HOOKS:
            for impl in getattr(self._pm.hook, hook_name).get_hookimpls():
                if impl.plugin_name == registered and (impl.wrapper or impl.hookwrapper):
                    self._pm.unregister(name=registered)
                    raise PluginLoadError(
                        f"{info.describe()} implements lifecycle hook {hook_name} as a wrapper; "
                        "expected a plain @hookimpl (lifecycle hooks take no wrappers)."
                    )
        self._info[registered] = info
        self._strategies = self._kinds = self._discovery = None

    def load_entrypoints(self, only: set[str] | None = None) -> None:
        """Import every entry point of group ``kvroute`` (or just those in ``only``)."""
        from importlib import metadata  # imported here: ~25 ms that `import kvroute` need not pay

        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in self._blocked or (only is not None and ep.name not in only):
                continue
            if self._pm.has_plugin(ep.name):
                continue
            dist = getattr(ep, "dist", None)
            info = PluginInfo(ep.name, dist.name if dist else None, dist.version if dist else None)
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginLoadError(
                    f"{info.describe()} failed to import {ep.value!r}: {type(exc).__name__}: {exc}"
                ) from exc
            self.register(plugin, name=ep.name, info=info)

    def notify(self, hook_name: str, **kwargs: Any) -> None:
        """Call every implementation of lifecycle hook ``hook_name``; a failure is logged, never raised.

        Each implementation is called on its own, in pluggy's order, so that an exception
        names the plugin that raised it and does not keep the others from being called. The
        log event is ``plugin_hook_failed`` with ``plugin``, ``distribution``, ``version``,
        ``hook`` and ``error``, at error level with the traceback.
        """
        for impl in reversed(getattr(self._pm.hook, hook_name).get_hookimpls()):
            try:
                impl.function(*[kwargs[arg] for arg in impl.argnames])
            except Exception as exc:
                info = self._info.get(impl.plugin_name, PluginInfo(impl.plugin_name))
                log.exception(
                    "plugin_hook_failed",
                    plugin=info.name,
                    distribution=info.distribution,
                    version=info.version,
                    hook=hook_name,
                    error=f"{type(exc).__name__}: {exc}",
                )

    def plugins(self) -> list[PluginInfo]:
        """Every registered plugin."""
        return list(self._info.values())

    # -- registrations -----------------------------------------------------------------

    def _collect(self, hook_name: str, what: str) -> dict[str, Registration]:
        found: dict[str, Registration] = {}
        caller = getattr(self._pm.hook, hook_name)
        # Call each implementation on its own, so a failure and a registration are
        # attributed to the plugin that made them (public pluggy API: get_hookimpls()).
        for impl in reversed(caller.get_hookimpls()):
            info = self._info.get(impl.plugin_name, PluginInfo(impl.plugin_name))

            def register(name: str, factory: Callable[..., Any], _info: PluginInfo = info) -> None:
                if not isinstance(name, str) or not name:
                    raise PluginLoadError(
                        f"{_info.describe()} registered a {what} with name {name!r}; expected a non-empty string."
                    )
                if not callable(factory):
                    raise PluginLoadError(f"{_info.describe()} registered {what} {name!r} with a non-callable factory.")
                if name in found:
                    raise PluginLoadError(
                        f"{what} {name!r} is registered twice: by {found[name].plugin.describe()} "
                        f"and by {_info.describe()}; block one with {BLOCK_ENV}."
                    )
                found[name] = Registration(name, factory, _info)

            try:
                impl.function(register=register)
            except PluginLoadError:
                raise
            except Exception as exc:
                raise PluginLoadError(
                    f"{info.describe()} failed in hook {hook_name}: {type(exc).__name__}: {exc}"
                ) from exc
        return found

    @property
    def strategies(self) -> Mapping[str, Registration]:
        """Registered strategies by name."""
        if self._strategies is None:
            self._strategies = self._collect("kvroute_register_strategies", "strategy")
        return self._strategies

    @property
    def backend_kinds(self) -> Mapping[str, Registration]:
        """Registered backend kinds by name."""
        if self._kinds is None:
            self._kinds = self._collect("kvroute_register_backend_kinds", "backend kind")
        return self._kinds

    @property
    def discovery_kinds(self) -> Mapping[str, Registration]:
        """Registered discovery kinds by name."""
        if self._discovery is None:
            self._discovery = self._collect("kvroute_register_discovery", "discovery kind")
        return self._discovery

    def register_commands(self, cli: Any) -> dict[str, PluginInfo]:
        """Let every plugin add its subcommands to ``cli`` (a `click.Group`); returns who added which.

        Each implementation is called on its own, so a failure or a name taken twice is an
        error naming the plugin (`PluginLoadError`).
        """
        added: dict[str, PluginInfo] = {}
        for impl in reversed(self._pm.hook.kvroute_register_commands.get_hookimpls()):
            info = self._info.get(impl.plugin_name, PluginInfo(impl.plugin_name))
            before = dict(cli.commands)
            try:
                impl.function(cli=cli)
            except PluginLoadError:
                raise
            except Exception as exc:
                raise PluginLoadError(
                    f"{info.describe()} failed in hook kvroute_register_commands: {type(exc).__name__}: {exc}"
                ) from exc
            for name, command in cli.commands.items():
                if name in before and before[name] is not command:
                    owner = added[name].describe() if name in added else "kvroute itself"
                    raise PluginLoadError(
                        f"command {name!r} is registered twice: by {owner} and by {info.describe()}; "
                        f"block one with {BLOCK_ENV}."
                    )
                if name not in before:
                    added[name] = info
        return added

    def create_strategy(self, name: str, options: Mapping[str, Any] | None = None) -> Strategy:
        """Build the strategy registered as ``name`` with ``options``; `ConfigError` if unknown or invalid."""
        registration = self.strategies.get(name)
        if registration is None:
            known = ", ".join(sorted(self.strategies)) or "none installed"
            raise ConfigError(
                f"unknown strategy {name!r} (installed: {known}). "
                f'Strategies are plugins: pip install "kvroute[{name}]".'
            )
        factory: StrategyFactory = registration.factory
        return build_strategy(name, factory, options)


def _own_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("kvroute")
    except metadata.PackageNotFoundError:
        return None
