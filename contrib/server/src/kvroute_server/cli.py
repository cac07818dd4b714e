"""``kvroute serve``: run the OpenAI-compatible routing proxy."""

from __future__ import annotations

import json
from typing import Any

import attrs
import click

from kvroute.errors import KvrouteError
from kvroute.plugins import PluginManager
from kvroute_server.config import (
    DEFAULT_STRATEGY,
    DiscoveryPolicy,
    HealthConfig,
    ServerConfig,
    TimeoutConfig,
    WarmJoinConfig,
    load_toml,
    parse_backend_flag,
    parse_discovery_flag,
    parse_option_flags,
    parse_shadow_option_flags,
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
    policy_map = {
        "max_removal_share": "max_removal_share",
        "removal_interval": "removal_interval",
        "on_mass_removal": "on_mass_removal",
        "discovery_stale_after": "stale_after",
    }
    policy = {policy_map[k]: flags.pop(k) for k in list(flags) if k in policy_map and flags[k] is not None}
    timeouts = {k: flags.pop(f"{k}_timeout", None) for k in ("connect", "first_byte", "idle")}
    timeouts = {k: v for k, v in timeouts.items() if v is not None}
    health_map = {
        "health_interval": "interval",
        "health_timeout": "timeout",
        "unhealthy_threshold": "unhealthy_threshold",
        "healthy_threshold": "healthy_threshold",
        "passive_ejection": "passive_ejection",
    }
    health = {health_map[k]: flags.pop(k) for k in list(flags) if k in health_map and flags[k] is not None}
    warm_join = {k: flags.pop(k) for k in list(flags) if k in _WARM_JOIN_FLAGS and flags[k] is not None}
    backend_header = flags.pop("backend_header", None)
    if backend_header is not None:
        config = attrs.evolve(config, backend_header=backend_header or None)
    config = config.merge(**flags)
    try:
        return attrs.evolve(
            config,
            timeouts=attrs.evolve(config.timeouts, **timeouts) if timeouts else config.timeouts,
            health=attrs.evolve(config.health, **health) if health else config.health,
            discovery_policy=attrs.evolve(config.discovery_policy, **policy) if policy else config.discovery_policy,
            warm_join=attrs.evolve(config.warm_join, **warm_join) if warm_join else config.warm_join,
        )
    except (TypeError, ValueError) as exc:
        raise KvrouteError(str(exc)) from None


def _integer_flag(flag: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise KvrouteError(f"{flag} {key}= must be an integer (got {value!r}).") from None


def describe(config: ServerConfig) -> dict[str, Any]:
    """The effective configuration as JSON-able data, secrets hidden."""
    data = attrs.asdict(config, recurse=True)
    data["admin_token"] = "***" if config.admin_token else None
    for backend in data["backends"]:
        backend["api_key"] = "***" if backend.get("api_key") else None
    for source in data["discovery"]:
        source["api_key"] = "***" if source.get("api_key") else None
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


_D_TIMEOUT = TimeoutConfig()
_D_HEALTH = HealthConfig()
_D_POLICY = DiscoveryPolicy()
_D_WARM = WarmJoinConfig()
#: The ``kvroute serve`` flags that set `WarmJoinConfig` fields (same names).
_WARM_JOIN_FLAGS = {f.name for f in attrs.fields(WarmJoinConfig)}
_D = ServerConfig()


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
@click.option(
    "--max-removal-share",
    type=float,
    default=None,
    help=f"Largest share of discovered backends one update removes at once [default: {_D_POLICY.max_removal_share}].",
)
@click.option(
    "--removal-interval",
    type=float,
    default=None,
    help=f"Seconds between removals of a mass removal [default: {_D_POLICY.removal_interval:g}].",
)
@click.option(
    "--on-mass-removal",
    type=click.Choice(["gradual", "hold"]),
    default=None,
    help=f"Apply a mass removal gradually or hold it [default: {_D_POLICY.on_mass_removal}].",
)
@click.option(
    "--discovery-stale-after",
    type=float,
    default=None,
    help=f"Seconds without a good answer before a source is stale [default: {_D_POLICY.stale_after:g}].",
)
@click.option("--strategy", help=f"Routing strategy plugin name [default: {_D.strategy}].")
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
    "--sagemaker-config",
    type=click.Path(dir_okay=False),
    help="Import RoutingConfig from a SageMaker endpoint-config JSON.",
)
@click.option("--sagemaker-variant", help="Which production variant of --sagemaker-config to import.")
@click.option("--host", default=None, help=f"Address to listen on [default: {_D.host}].")
@click.option("--port", type=int, default=None, help=f"Port to listen on [default: {_D.port}].")
@click.option(
    "--admin-token",
    envvar="KVROUTE_ADMIN_TOKEN",
    default=None,
    help="Bearer token of the admin API (env KVROUTE_ADMIN_TOKEN); unset: admin API off.",
)
@click.option(
    "--max-body-bytes", type=int, default=None, help=f"Largest request body accepted [default: {_D.max_body_bytes}]."
)
@click.option(
    "--max-attempts",
    type=int,
    default=None,
    help=f"Backends tried per request before giving up [default: {_D.max_attempts}].",
)
@click.option(
    "--retry-after",
    "retry_after_s",
    type=int,
    default=None,
    help=f"Retry-After seconds on 503 [default: {_D.retry_after_s}].",
)
@click.option(
    "--connect-timeout",
    type=float,
    default=None,
    help=f"Seconds to open an upstream connection [default: {_D_TIMEOUT.connect}].",
)
@click.option(
    "--first-byte-timeout",
    type=float,
    default=None,
    help=f"Seconds until the first response byte [default: {_D_TIMEOUT.first_byte}].",
)
@click.option(
    "--idle-timeout",
    type=float,
    default=None,
    help=f"Longest gap between response chunks [default: {_D_TIMEOUT.idle}].",
)
@click.option(
    "--health-interval",
    type=float,
    default=None,
    help=f"Seconds between probe rounds; 0 = off [default: {_D_HEALTH.interval}].",
)
@click.option("--health-timeout", type=float, default=None, help=f"Probe timeout [default: {_D_HEALTH.timeout}].")
@click.option(
    "--unhealthy-threshold",
    type=int,
    default=None,
    help=f"Failed probes in a row that eject [default: {_D_HEALTH.unhealthy_threshold}].",
)
@click.option(
    "--healthy-threshold",
    type=int,
    default=None,
    help=f"Passed probes in a row that restore [default: {_D_HEALTH.healthy_threshold}].",
)
@click.option(
    "--passive-ejection/--no-passive-ejection",
    default=None,
    help="Eject a backend on a connection error [default: on].",
)
@click.option(
    "--backend-header",
    default=None,
    help=f"Response header naming the chosen backend; '' = off [default: {_D.backend_header}].",
)
@click.option(
    "--forward-authorization/--no-forward-authorization",
    default=None,
    help="Forward the client's Authorization header [default: on].",
)
@click.option("--access-log/--no-access-log", default=None, help="One structured log line per request [default: on].")
@click.option(
    "--workers",
    type=int,
    default=None,
    help=f"Proxy processes sharing the port, with one metrics view [default: {_D.workers}].",
)
@click.option(
    "--shutdown-timeout",
    type=float,
    default=None,
    help=f"Seconds a stop waits for requests in flight [default: {_D.shutdown_timeout:g}].",
)
@click.option(
    "--status",
    type=click.Choice(["on", "admin", "off"]),
    default=None,
    help=f"GET /status and /status.json: on, behind the admin token, or off [default: {_D.status}].",
)
@click.option(
    "--status-decisions",
    type=int,
    default=None,
    metavar="N",
    help=f"Recent routing decisions the status page keeps [default: {_D.status_decisions}].",
)
@click.option(
    "--slow-start",
    type=float,
    default=None,
    metavar="SECONDS",
    help="Ramp a joining backend's weight over this many seconds; 0 = off (docs/warm-join.md) [default: 0].",
)
@click.option(
    "--slow-start-initial",
    type=float,
    default=None,
    help=f"Share of its weight a joining backend starts at [default: {_D_WARM.slow_start_initial}].",
)
@click.option(
    "--slow-start-steps",
    type=int,
    default=None,
    help=f"Equal steps of the weight ramp [default: {_D_WARM.slow_start_steps}].",
)
@click.option(
    "--prefill",
    type=int,
    default=None,
    metavar="N",
    help="Pre-fill a joining backend with the N hottest prefixes it will own; 0 = off [default: 0].",
)
@click.option(
    "--prefill-concurrency",
    type=int,
    default=None,
    help=f"Pre-fill requests in flight at once [default: {_D_WARM.prefill_concurrency}].",
)
@click.option(
    "--prefill-timeout",
    type=float,
    default=None,
    help=f"Seconds a pre-fill may take in all [default: {_D_WARM.prefill_timeout:g}].",
)
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
            status = Supervisor(config, log_level=log_level, log_format=log_format).run()
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
    )
