"""``kvroute serve``: run the OpenAI-compatible routing proxy."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import click

from kvroute.errors import KvrouteError
from kvroute.plugins import PluginManager
from kvroute.settings import Setting, option
from kvroute_server.config import (
    DEFAULT_STRATEGY,
    ServerConfig,
    apply_settings,
    load_toml,
    parse_backend_flag,
    parse_discovery_flag,
    parse_option_flags,
    parse_shadow_option_flags,
    settings,
)
from kvroute_server.sagemaker import load_sagemaker

__all__ = ["build_config", "serve"]


def build_config(
    *,
    config_file: str | None = None,
    backends: tuple[str, ...] = (),
    strategy: str | None = None,
    options: tuple[str, ...] = (),
    sagemaker_config: str | None = None,
    sagemaker_variant: str | None = None,
    discovery: tuple[str, ...] = (),
    shadow: tuple[str, ...] = (),
    shadow_options: tuple[str, ...] = (),
    cache_view: tuple[str, ...] = (),
    peers: tuple[str, ...] = (),
    peer_discovery: tuple[str, ...] = (),
    **flags: Any,
) -> ServerConfig:
    """Combine the TOML file, a SageMaker import and flags (flags win; ``None`` means not given)."""
    config = load_toml(config_file) if config_file else ServerConfig()
    if sagemaker_config:
        sm_strategy, sm_options = load_sagemaker(sagemaker_config, sagemaker_variant)
        config = attrs.evolve(config, strategy=sm_strategy, options={**sm_options})
    if strategy is not None and strategy != config.strategy:
        config = attrs.evolve(config, strategy=strategy, options={})
    if options:
        config = attrs.evolve(config, options={**config.options, **parse_option_flags(options)})
    if backends:
        config = attrs.evolve(config, backends=config.backends + tuple(parse_backend_flag(b) for b in backends))
    if discovery:
        config = attrs.evolve(config, discovery=config.discovery + tuple(parse_discovery_flag(d) for d in discovery))
    if shadow:  # --shadow replaces the file's list; --shadow-option and --cache-view add to the file's tables
        config = attrs.evolve(config, shadow=tuple(n.strip() for s in shadow for n in s.split(",") if n.strip()))
    if shadow_options:
        merged = {name: dict(opts) for name, opts in config.shadow_options.items()}
        for name, opts in parse_shadow_option_flags(shadow_options).items():
            merged.setdefault(name, {}).update(opts)
        config = attrs.evolve(config, shadow_options=merged)
    if cache_view:
        view = {**config.cache_view}
        for key, value in parse_option_flags(cache_view).items():
            view[key] = value if key == "units" else _integer_flag("--cache-view", key, value)
        config = attrs.evolve(config, cache_view=view)
    values = {_FLAG_PATHS[name]: value for name, value in flags.items() if value is not None}
    if peers:  # --peer replaces the file's list, as --shadow does
        values[("peers", "urls")] = peers
    if peer_discovery:  # --peer-discovery adds to the file's sources, as --discovery does
        found = tuple(parse_discovery_flag(d, "--peer-discovery") for d in peer_discovery)
        values[("peers", "discovery")] = config.peers.discovery + found
    if values.get(("backend_header",)) == "":
        values[("backend_header",)] = None
    # The server's own settings are checked first, then those of its parts ([timeouts], [health]...).
    config = apply_settings(config, {path: value for path, value in values.items() if len(path) == 1})
    config = apply_settings(config, {path: value for path, value in values.items() if len(path) > 1})
    config.peers.check()
    return config


def _integer_flag(flag: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise KvrouteError(f"{flag} {key}= must be an integer (got {value!r}).") from None


def describe(config: ServerConfig) -> dict[str, Any]:
    """The effective configuration as JSON-able data, secrets hidden."""
    data = attrs.asdict(config, recurse=True)
    data["admin_token"] = "***" if config.admin_token else None
    data["peers"]["token"] = "***" if config.peers.token else None
    for backend in data["backends"]:
        backend["api_key"] = "***" if backend.get("api_key") else None
    for source in data["discovery"]:
        source["api_key"] = "***" if source.get("api_key") else None
    for source in data["peers"]["discovery"]:
        source.pop("api_key", None)  # never set for a peer source
    return data


def _check_default_strategy(config: ServerConfig, plugins: PluginManager) -> None:
    """Say what to install when the configured strategy is the default one and its plugin is missing.

    (Another strategy that is not installed gets the plugin manager's own message.)
    """
    if config.strategy != DEFAULT_STRATEGY or DEFAULT_STRATEGY in plugins.strategies:
        return
    installed = ", ".join(sorted(plugins.strategies)) or "none"
    raise click.ClickException(
        f"the strategy {DEFAULT_STRATEGY!r} (kvroute serve's default) is not installed. "
        f'Install it with: pip install "kvroute[{DEFAULT_STRATEGY}]", or choose an installed strategy with '
        f"--strategy NAME (installed: {installed})."
    )


def _param_name(path: tuple[str, ...], meta: Setting) -> str:
    """The option's parameter name: a `ServerConfig` field's own name, else its flag's (``connect_timeout``)."""
    assert meta.flag is not None
    return path[0] if len(path) == 1 else meta.flag.removeprefix("--").replace("-", "_")


_DEFAULTS = ServerConfig()


def _setting_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add a ``--FLAG`` option for every setting that has one, in schema order, its help ending in its default.

    Every option's value is ``None`` unless given, so the file's value stands unless the flag is given.
    """
    for path, field, meta in reversed(list(settings())):
        if meta.flag is None:
            continue
        default: Any = _DEFAULTS
        for name in path:
            default = getattr(default, name)
        command = option(field, default, _param_name(path, meta))(command)
    return command


#: Each generated option's parameter name and the path of the setting it sets.
_FLAG_PATHS = {_param_name(path, meta): path for path, _, meta in settings() if meta.flag is not None}


@click.command()
@click.option(
    "--config", "config_file", type=click.Path(dir_okay=False), help="TOML configuration file (see docs/serve.md)."
)
@click.option(
    "--backend",
    "backends",
    multiple=True,
    metavar="URL|ID=URL",
    help="An upstream server (repeatable); also id=..,url=..,kind=..,weight=..,models=a;b.",
)
@click.option(
    "--discovery",
    multiple=True,
    metavar="KIND:TARGET",
    help="A discovery source (repeatable): file:PATH, dns:NAME:PORT, dns:_svc._tcp.NAME, kubernetes:NS/SVC:PORT.",
)
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE", help="A strategy option (repeatable).")
@click.option(
    "--shadow",
    multiple=True,
    metavar="NAME[,NAME...]",
    help="Shadow strategies, decided in dry run beside the live one (docs/serve.md, 'Shadow strategies').",
)
@click.option(
    "--shadow-option",
    "shadow_options",
    multiple=True,
    metavar="NAME.KEY=VALUE",
    help="An option of shadow NAME's strategy (repeatable).",
)
@click.option(
    "--cache-view",
    multiple=True,
    metavar="KEY=VALUE",
    help="A setting of the cache view scoring strategies: block_size, capacity_tokens, units, chars_per_token.",
)
@click.option(
    "--peer",
    "peers",
    multiple=True,
    metavar="URL",
    help="Another router replica's base URL to share routing holds with (repeatable; docs/serve.md).",
)
@click.option(
    "--peer-discovery",
    "peer_discovery",
    multiple=True,
    metavar="KIND:TARGET",
    help="Find the other router replicas (repeatable), as --discovery finds backends: dns:NAME:PORT, "
    "dns:_svc._tcp.NAME, kubernetes:NS/SVC:PORT, file:PATH.",
)
@click.option(
    "--sagemaker-config",
    type=click.Path(dir_okay=False),
    help="Import RoutingConfig from a SageMaker endpoint-config JSON.",
)
@click.option("--sagemaker-variant", help="Which production variant of --sagemaker-config to import.")
@_setting_options
@click.option("--log-level", default="info", show_default=True, help="debug, info, warning or error.")
@click.option("--log-format", type=click.Choice(["json", "console"]), default="json", show_default=True)
@click.option("--check", is_flag=True, help="Validate the configuration, print it as JSON and exit.")
def serve(
    config_file: str | None,
    backends: tuple[str, ...],
    strategy: str | None,
    options: tuple[str, ...],
    sagemaker_config: str | None,
    sagemaker_variant: str | None,
    discovery: tuple[str, ...],
    shadow: tuple[str, ...],
    shadow_options: tuple[str, ...],
    cache_view: tuple[str, ...],
    peers: tuple[str, ...],
    peer_discovery: tuple[str, ...],
    log_level: str,
    log_format: str,
    check: bool,
    **flags: Any,
) -> None:
    """Run the OpenAI-compatible routing proxy in front of a fleet.

    \b
    Example:
      kvroute serve --backend http://10.0.0.1:8000 --backend http://10.0.0.2:8000 \\
          --strategy bounded-load --option prefix_length=4096
    """
    from kvroute.cli import configure_logging

    try:
        config = build_config(
            config_file=config_file,
            backends=backends,
            strategy=strategy,
            options=options,
            sagemaker_config=sagemaker_config,
            sagemaker_variant=sagemaker_variant,
            discovery=discovery,
            shadow=shadow,
            shadow_options=shadow_options,
            cache_view=cache_view,
            peers=peers,
            peer_discovery=peer_discovery,
            **flags,
        )
        configure_logging(log_level, log_format)
        from kvroute_server.proxy.app import ProxyApp

        plugins = PluginManager()
        _check_default_strategy(config, plugins)
        app = ProxyApp(config, plugins=plugins)
    except KvrouteError as exc:
        raise click.ClickException(str(exc)) from None
    if check:
        click.echo(json.dumps(describe(config), indent=2, sort_keys=True))
        return
    if not config.backends and not config.discovery and config.admin_token is None:
        click.echo("warning: no backends and no admin token: every request will get 503.", err=True)
    if config.workers > 1:
        from kvroute_server.ops.workers import Supervisor

        app.router.close()  # built only to check the configuration: each worker builds its own
        try:
            status = Supervisor(config, log_level=log_level, log_format=log_format, http=config.http).run()
        except KvrouteError as exc:
            raise click.ClickException(str(exc)) from None
        if status:
            raise click.exceptions.Exit(status)
        return
    from kvroute_server.http.runner import run_server

    run_server(
        app,
        config.host,
        config.port,
        log_level=log_level if log_level != "info" else "warning",
        shutdown_timeout=config.shutdown_timeout,
        http=config.http,
    )
