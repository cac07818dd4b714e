"""The proxy's configuration: attrs types, a TOML loader and command-line overrides.

Precedence, lowest first: built-in defaults, the TOML file (``--config``), a SageMaker
endpoint-config import (``--sagemaker-config``: strategy and its options only), then
command-line flags. Every value is validated here, so the server never starts with a
configuration it would reject later; errors are `kvroute.ConfigError` naming the key.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs

from kvroute.backend import Backend
from kvroute.errors import ConfigError

__all__ = [
    "DEFAULT_STRATEGY",
    "BackendConfig",
    "DiscoveryConfig",
    "DiscoveryPolicy",
    "HealthConfig",
    "ServerConfig",
    "TimeoutConfig",
    "WarmJoinConfig",
    "load_toml",
    "parse_backend_flag",
    "parse_discovery_flag",
    "parse_option_flags",
    "parse_shadow_option_flags",
]

_DEFAULT_HOP_BY_HOP = ()

#: The strategy `kvroute serve` routes with when none is configured: prefix-aware, with a load
#: cap (docs/serve.md, "Why bounded-load by default"). Its plugin comes with ``kvroute[bounded-load]``.
DEFAULT_STRATEGY = "bounded-load"


def _check_url(url: object, where: str) -> str:
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{where}: 'url' must be a non-empty string such as 'http://127.0.0.1:8001' (got {url!r}).")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: 'url' must be an http:// or https:// URL with a host (got {url!r}).")
    if parts.query or parts.fragment:
        raise ConfigError(f"{where}: 'url' must not have a query or fragment (got {url!r}).")
    return url.rstrip("/")


@attrs.frozen
class BackendConfig:
    """One upstream server: where it is, what kind of engine, and how to talk to it.

    ``api_key`` (when set) replaces the client's ``Authorization`` header on requests to
    this backend; ``adapter_options`` go to the backend kind's adapter factory.
    """

    id: str
    url: str
    kind: str = "openai"
    weight: float = 1.0
    models: tuple[str, ...] = ()
    labels: Mapping[str, str] = attrs.field(factory=dict)
    api_key: str | None = attrs.field(default=None, repr=False)
    adapter_options: Mapping[str, Any] = attrs.field(factory=dict)

    def to_backend(self) -> Backend:
        """The core's identity object for this backend."""
        try:
            return Backend(
                id=self.id, url=self.url, kind=self.kind, weight=self.weight, models=self.models, labels=self.labels
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"backend {self.id!r}: {exc}") from None

    @classmethod
    def from_mapping(cls, data: object, where: str = "backend") -> BackendConfig:
        """Build from a TOML table or an admin API JSON body, checking every key."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where} must be a table/object with at least 'url' (got {type(data).__name__}).")
        known = {"id", "url", "kind", "weight", "models", "labels", "api_key", "adapter_options"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {', '.join(map(repr, unknown))} "
                f"(expected some of: {', '.join(sorted(known))})."
            )
        url = _check_url(data.get("url"), where)
        backend_id = data.get("id") or default_backend_id(url)
        if not isinstance(backend_id, str):
            raise ConfigError(f"{where}: 'id' must be a string (got {backend_id!r}).")
        kind = data.get("kind", "openai")
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"{where}: 'kind' must be a non-empty string (got {kind!r}).")
        weight = data.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise ConfigError(f"{where}: 'weight' must be a number > 0 (got {weight!r}).")
        models = data.get("models", ())
        if isinstance(models, str):
            models = (models,)
        if not isinstance(models, list | tuple) or not all(isinstance(m, str) and m for m in models):
            raise ConfigError(f"{where}: 'models' must be a list of model names (got {models!r}).")
        labels = data.get("labels", {})
        if not isinstance(labels, Mapping) or not all(isinstance(v, str) for v in labels.values()):
            raise ConfigError(f"{where}: 'labels' must be a table of strings (got {labels!r}).")
        api_key = data.get("api_key")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ConfigError(f"{where}: 'api_key' must be a non-empty string when set.")
        options = data.get("adapter_options", {})
        if not isinstance(options, Mapping):
            raise ConfigError(f"{where}: 'adapter_options' must be a table (got {options!r}).")
        return cls(
            id=backend_id,
            url=url,
            kind=kind,
            weight=float(weight),
            models=tuple(models),
            labels=dict(labels),
            api_key=api_key,
            adapter_options=dict(options),
        )


def default_backend_id(url: str) -> str:
    """A backend's id when none is given: the URL's ``host:port``."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def parse_backend_flag(value: str) -> BackendConfig:
    """Parse ``--backend``: ``URL``, ``ID=URL`` or ``id=..,url=..,kind=..,weight=..,models=a;b``."""
    value = value.strip()
    where = f"--backend {value!r}"
    if "," in value or value.startswith(("url=", "id=")):
        data: dict[str, Any] = {}
        for item in value.split(","):
            key, sep, raw = item.partition("=")
            if not sep:
                raise ConfigError(f"{where}: expected key=value pairs separated by commas (got {item!r}).")
            key = key.strip()
            if key == "models":
                data[key] = [m for m in raw.split(";") if m]
            elif key == "weight":
                try:
                    data[key] = float(raw)
                except ValueError:
                    raise ConfigError(f"{where}: 'weight' must be a number (got {raw!r}).") from None
            else:
                data[key] = raw
        return BackendConfig.from_mapping(data, where)
    if "=" in value and not value.startswith("http"):
        backend_id, _, url = value.partition("=")
        return BackendConfig.from_mapping({"id": backend_id, "url": url}, where)
    return BackendConfig.from_mapping({"url": value}, where)


def parse_option_flags(values: Sequence[str]) -> dict[str, str]:
    """Parse repeated ``--option key=value`` flags."""
    out: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--option must be key=value (got {item!r}).")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def _positive_number(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"'{attribute.name}' must be a number > 0 (got {value!r}).")


def _non_negative_number(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(f"'{attribute.name}' must be a number >= 0 (got {value!r}).")


def _positive_int(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"'{attribute.name}' must be an integer >= 1 (got {value!r}).")


@attrs.frozen
class TimeoutConfig:
    """Upstream timeouts in seconds.

    ``connect``: opening a TCP connection (a failure is retried on another backend).
    ``first_byte``: from sending the request until the first byte of the response body
    (covers queueing and prefill; not retried, the engine may still be working).
    ``idle``: the longest gap between two body chunks once the body has started.
    """

    connect: float = attrs.field(default=5.0, validator=_positive_number)
    first_byte: float = attrs.field(default=300.0, validator=_positive_number)
    idle: float = attrs.field(default=60.0, validator=_positive_number)


@attrs.frozen
class HealthConfig:
    """Active probes and passive ejection.

    Every ``interval`` seconds each backend is probed through its adapter (``/health`` for
    kind ``openai``) with ``timeout``. ``unhealthy_threshold`` consecutive failures eject
    it; ``healthy_threshold`` consecutive successes bring an ejected backend back. With
    ``passive_ejection``, a connection error while proxying ejects the backend at once.
    ``interval = 0`` turns probing off, and passive ejection with it (nothing would bring
    an ejected backend back).
    """

    interval: float = attrs.field(default=5.0, validator=_non_negative_number)
    timeout: float = attrs.field(default=2.0, validator=_positive_number)
    unhealthy_threshold: int = attrs.field(default=3, validator=_positive_int)
    healthy_threshold: int = attrs.field(default=2, validator=_positive_int)
    passive_ejection: bool = True
    discover_models: bool = True

    @property
    def enabled(self) -> bool:
        return self.interval > 0


_MASS_REMOVAL = ("gradual", "hold")


@attrs.frozen
class DiscoveryConfig:
    """One discovery source: a registered ``kind`` and the options its factory gets (``target`` among them).

    ``api_key`` (when set) is the key sent to every backend this source finds, like a
    ``[[backends]]`` table's; it is the host's, never passed to the provider.
    """

    kind: str
    options: Mapping[str, Any] = attrs.field(factory=dict)
    api_key: str | None = attrs.field(default=None, repr=False)

    @classmethod
    def from_mapping(cls, data: object, where: str = "[[discovery]]") -> DiscoveryConfig:
        """Build from a TOML ``[[discovery]]`` table: ``kind``, then the provider's options.

        ``backend_kind`` sets the backend kind (adapter) of the backends the source finds; it
        reaches the provider as its ``kind`` option.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where} must be a table with at least 'kind' (got {type(data).__name__}).")
        options = dict(data)
        kind = options.pop("kind", None)
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"{where}: 'kind' must be a non-empty string such as 'dns' or 'file' (got {kind!r}).")
        api_key = options.pop("api_key", None)
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ConfigError(f"{where}: 'api_key' must be a non-empty string when set.")
        # `kind` names the discovery kind here, so the backend kind of what it finds is `backend_kind`.
        if "backend_kind" in options:
            backend_kind = options.pop("backend_kind")
            if not isinstance(backend_kind, str) or not backend_kind:
                raise ConfigError(
                    f"{where}: 'backend_kind' must be a non-empty string such as 'vllm' (got {backend_kind!r})."
                )
            options["kind"] = backend_kind
        return cls(kind=kind, options=options, api_key=api_key)


def parse_discovery_flag(value: str) -> DiscoveryConfig:
    """Parse ``--discovery KIND:TARGET`` (``file:fleet.toml``, ``dns:vllm.svc:8000``); the factory gets ``target``."""
    kind, sep, target = value.strip().partition(":")
    if not sep or not kind or not target:
        raise ConfigError(
            f"--discovery must be KIND:TARGET such as 'dns:vllm.default.svc:8000' or 'file:fleet.toml' (got {value!r})."
        )
    return DiscoveryConfig(kind=kind, options={"target": target})


def _share(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(f"'{attribute.name}' must be a number in (0, 1] (got {value!r}).")


def _mass_removal(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in _MASS_REMOVAL:
        raise ConfigError(f"'{attribute.name}' must be one of {', '.join(_MASS_REMOVAL)} (got {value!r}).")


@attrs.frozen
class DiscoveryPolicy:
    """How discovered changes are applied (docs/serve.md, "Discovery").

    An update that would remove more than ``max_removal_share`` of the discovered backends at
    once is applied one removal per ``removal_interval`` seconds (``on_mass_removal = "gradual"``)
    or not at all while the answer says so (``"hold"``). A source with no good answer for
    ``stale_after`` seconds is reported stale even when its provider said nothing.
    """

    max_removal_share: float = attrs.field(default=0.5, validator=_share)
    removal_interval: float = attrs.field(default=10.0, validator=_positive_number)
    on_mass_removal: str = attrs.field(default="gradual", validator=_mass_removal)
    stale_after: float = attrs.field(default=300.0, validator=_positive_number)


def _fraction(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(f"'{attribute.name}' must be a fraction in (0, 1] of the backend's weight (got {value!r}).")


def _non_negative_int(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"'{attribute.name}' must be an integer >= 0 (got {value!r}).")


@attrs.frozen
class WarmJoinConfig:
    """What the proxy does when a backend joins a serving fleet (docs/warm-join.md); off by default.

    ``prefill``: how many of the hottest prefixes the new backend will own are sent to it first
    (prefix only, ``max_tokens`` 1), at most ``prefill_concurrency`` at a time, all within
    ``prefill_timeout`` seconds, while it takes no traffic; 0 = no pre-fill. ``slow_start``: the
    seconds over which its weight then rises from ``slow_start_initial`` of it to all of it in
    ``slow_start_steps`` steps (as Envoy's slow start); 0 = full weight at once.
    """

    slow_start: float = attrs.field(default=0.0, validator=_non_negative_number)
    slow_start_initial: float = attrs.field(default=0.1, validator=_fraction)
    slow_start_steps: int = attrs.field(default=10, validator=_positive_int)
    prefill: int = attrs.field(default=0, validator=_non_negative_int)
    prefill_concurrency: int = attrs.field(default=2, validator=_positive_int)
    prefill_timeout: float = attrs.field(default=30.0, validator=_positive_number)

    @property
    def enabled(self) -> bool:
        return self.slow_start > 0 or self.prefill > 0


_WARM_JOIN_KEYS: dict[str, type] = {
    "slow_start": float,
    "slow_start_initial": float,
    "slow_start_steps": int,
    "prefill": int,
    "prefill_concurrency": int,
    "prefill_timeout": float,
}

_STATUS_MODES = ("on", "admin", "off")
#: Most decisions the status page may keep (each is a few hundred bytes of JSON when shown).
MAX_STATUS_DECISIONS = 10_000


def _status_mode(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in _STATUS_MODES:
        raise ConfigError(f"'{attribute.name}' must be one of {', '.join(_STATUS_MODES)} (got {value!r}).")


def _status_decisions(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STATUS_DECISIONS:
        raise ConfigError(f"'{attribute.name}' must be an integer from 0 to {MAX_STATUS_DECISIONS} (got {value!r}).")


@attrs.frozen
class ServerConfig:
    """Everything ``kvroute serve`` needs; see docs/serve.md for each key."""

    backends: tuple[BackendConfig, ...] = ()
    strategy: str = DEFAULT_STRATEGY
    options: Mapping[str, Any] = attrs.field(factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = attrs.field(default=32 * 1024 * 1024, validator=_positive_int)
    max_attempts: int = attrs.field(default=3, validator=_positive_int)
    retry_after_s: int = attrs.field(default=1, validator=_positive_int)
    forward_authorization: bool = True
    backend_header: str | None = "x-kvroute-backend"
    admin_token: str | None = attrs.field(default=None, repr=False)
    access_log: bool = True
    passthrough_paths: tuple[str, ...] = (
        "/tokenize",
        "/detokenize",
        "/v1/embeddings",
        "/v1/score",
        "/v1/rerank",
        "/pooling",
    )
    timeouts: TimeoutConfig = attrs.field(factory=TimeoutConfig)
    health: HealthConfig = attrs.field(factory=HealthConfig)
    #: Proxy processes sharing the listening socket (``kvroute serve --workers``); 1 = this process.
    workers: int = attrs.field(default=1, validator=_positive_int)
    #: Seconds a stop waits for requests in flight before closing their connections.
    shutdown_timeout: float = attrs.field(default=30.0, validator=_positive_number)
    #: Discovery sources (``--discovery``, ``[[discovery]]``), in order: the first wins an id conflict.
    discovery: tuple[DiscoveryConfig, ...] = ()
    discovery_policy: DiscoveryPolicy = attrs.field(factory=DiscoveryPolicy)
    #: ``GET /status`` and ``/status.json``: ``on`` (anyone), ``admin`` (the admin token) or ``off`` (404).
    status: str = attrs.field(default="on", validator=_status_mode)
    #: How many recent routing decisions the status page keeps (0: none).
    status_decisions: int = attrs.field(default=100, validator=_status_decisions)
    #: The TOML file read (`load_toml`), and the ids of the ``[[backends]]`` it gave (the status page's origins).
    config_file: str | None = None
    backends_from_file: tuple[str, ...] = ()
    #: Shadow strategies (``--shadow``, ``[routing] shadow``): decided in dry run beside the live one.
    shadow: tuple[str, ...] = ()
    #: Each shadow's strategy options by name (``--shadow-option NAME.KEY=VALUE``, ``[routing.shadow_options.NAME]``).
    shadow_options: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    #: Settings of the fleet cache view that scores strategies (``[routing.cache_view]``; `kvroute.CacheView`).
    cache_view: Mapping[str, Any] = attrs.field(factory=dict)
    #: Warm join of backends added while serving (``[warm_join]``, ``--slow-start``, ``--prefill``).
    warm_join: WarmJoinConfig = attrs.field(factory=WarmJoinConfig)

    def __attrs_post_init__(self) -> None:
        seen: set[str] = set()
        for backend in self.backends:
            if backend.id in seen:
                raise ConfigError(f"backend id {backend.id!r} is given twice; ids must be unique.")
            seen.add(backend.id)
        if self.backend_header is not None and not _is_token(self.backend_header):
            raise ConfigError(f"'backend_header' must be a valid header name or empty (got {self.backend_header!r}).")
        if self.status == "admin" and self.admin_token is None:
            raise ConfigError(
                "'status' = 'admin' puts the status page behind the admin token, but no admin token is set."
            )
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ConfigError(f"'admin_token' must be at least 16 characters (got {len(self.admin_token)}).")
        for path in self.passthrough_paths:
            if not path.startswith("/"):
                raise ConfigError(f"'passthrough_paths' entries must start with '/' (got {path!r}).")
        _check_shadows(self)

    def merge(self, **changes: Any) -> ServerConfig:
        """A copy with the given fields replaced (``None`` values are ignored)."""
        return attrs.evolve(self, **{k: v for k, v in changes.items() if v is not None})


_CACHE_VIEW_KEYS = {"block_size": int, "capacity_tokens": int, "units": str, "chars_per_token": int}


def _check_shadows(config: ServerConfig) -> None:
    """Shadow names: distinct, not the live strategy; options only for configured shadows; cache view keys known."""
    if len(set(config.shadow)) != len(config.shadow):
        raise ConfigError(f"'shadow' names each strategy once (got {list(config.shadow)}).")
    if config.strategy in config.shadow:
        raise ConfigError(f"'shadow' must not name the live strategy {config.strategy!r} (got {list(config.shadow)}).")
    stray = sorted(set(config.shadow_options) - set(config.shadow))
    if stray:
        raise ConfigError(
            f"shadow options for {', '.join(map(repr, stray))}, which is not a shadow (shadows: {list(config.shadow)})."
        )
    _check_keys(config.cache_view, set(_CACHE_VIEW_KEYS), "routing.cache_view")
    for key in config.cache_view:
        _typed(config.cache_view, key, _CACHE_VIEW_KEYS[key], "routing.cache_view")


def parse_shadow_option_flags(values: Sequence[str]) -> dict[str, dict[str, str]]:
    """Parse repeated ``--shadow-option NAME.KEY=VALUE`` flags into options by shadow name."""
    out: dict[str, dict[str, str]] = {}
    for item in values:
        target, sep, value = item.partition("=")
        name, dot, key = target.strip().rpartition(".")
        if not sep or not dot or not name or not key:
            raise ConfigError(
                f"--shadow-option must be NAME.KEY=VALUE such as 'bounded-load.load_factor=1.5' (got {item!r})."
            )
        out.setdefault(name, {})[key.replace("-", "_")] = value.strip()
    return out


def _is_token(name: str) -> bool:
    allowed = set("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return bool(name) and all(c in allowed for c in name)


_SERVER_KEYS = {
    "host": str,
    "port": int,
    "max_body_bytes": int,
    "max_attempts": int,
    "retry_after_s": int,
    "forward_authorization": bool,
    "backend_header": str,
    "admin_token": str,
    "access_log": bool,
    "passthrough_paths": list,
    "workers": int,
    "shutdown_timeout": float,
    "status": str,
    "status_decisions": int,
}


def _typed(table: Mapping[str, Any], key: str, expected: type, where: str) -> Any:
    value = table[key]
    ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    if expected is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise ConfigError(f"[{where}] '{key}' must be {expected.__name__} (got {type(value).__name__} {value!r}).")
    return value


def _section(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"[{name}] must be a table (got {type(table).__name__}).")
    return table


def _check_keys(table: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(
            f"[{where}]: unknown key(s) {', '.join(map(repr, unknown))} (expected some of: {', '.join(sorted(known))})."
        )


def config_from_mapping(data: Mapping[str, Any], base: ServerConfig | None = None) -> ServerConfig:
    """Build a `ServerConfig` from the parsed TOML document (see docs/serve.md)."""
    _check_keys(
        data,
        {"server", "routing", "timeouts", "health", "backends", "discovery", "discovery_policy", "warm_join"},
        "top level",
    )
    config = base or ServerConfig()
    changes: dict[str, Any] = {}

    server = _section(data, "server")
    _check_keys(server, set(_SERVER_KEYS), "server")
    for key, expected in _SERVER_KEYS.items():
        if key in server:
            changes[key] = _typed(server, key, expected, "server")
    if "shutdown_timeout" in changes:
        changes["shutdown_timeout"] = float(changes["shutdown_timeout"])
    if "backend_header" in changes and changes["backend_header"] == "":
        changes["backend_header"] = None
    if "passthrough_paths" in changes:
        changes["passthrough_paths"] = tuple(changes["passthrough_paths"])

    routing = _section(data, "routing")
    _check_keys(routing, {"strategy", "options", "shadow", "shadow_options", "cache_view"}, "routing")
    if "strategy" in routing:
        changes["strategy"] = _typed(routing, "strategy", str, "routing")
    if "options" in routing:
        changes["options"] = dict(_section(routing, "options"))
    if "shadow" in routing:
        shadow = _typed(routing, "shadow", list, "routing")
        if not all(isinstance(name, str) and name for name in shadow):
            raise ConfigError(f"[routing] 'shadow' must be a list of strategy names (got {shadow!r}).")
        changes["shadow"] = tuple(shadow)
    if "shadow_options" in routing:
        tables = _section(routing, "shadow_options")
        changes["shadow_options"] = {name: dict(_section(tables, name)) for name in tables}
    if "cache_view" in routing:
        changes["cache_view"] = dict(_section(routing, "cache_view"))

    timeouts = _section(data, "timeouts")
    _check_keys(timeouts, {"connect", "first_byte", "idle"}, "timeouts")
    t_values = {k: float(_typed(timeouts, k, float, "timeouts")) for k in timeouts}
    health = _section(data, "health")
    h_types: dict[str, type] = {
        "interval": float,
        "timeout": float,
        "unhealthy_threshold": int,
        "healthy_threshold": int,
        "passive_ejection": bool,
        "discover_models": bool,
    }
    _check_keys(health, set(h_types), "health")
    h_values = {k: _typed(health, k, h_types[k], "health") for k in health}

    backends_raw = data.get("backends", [])
    if not isinstance(backends_raw, list):
        raise ConfigError(f"'backends' must be an array of tables ([[backends]]) (got {type(backends_raw).__name__}).")
    backends = tuple(BackendConfig.from_mapping(b, f"[[backends]] #{i + 1}") for i, b in enumerate(backends_raw))
    discovery_raw = data.get("discovery", [])
    if not isinstance(discovery_raw, list):
        raise ConfigError(
            f"'discovery' must be an array of tables ([[discovery]]) (got {type(discovery_raw).__name__})."
        )
    discovery = tuple(DiscoveryConfig.from_mapping(d, f"[[discovery]] #{i + 1}") for i, d in enumerate(discovery_raw))
    policy = _section(data, "discovery_policy")
    p_types: dict[str, type] = {
        "max_removal_share": float,
        "removal_interval": float,
        "on_mass_removal": str,
        "stale_after": float,
    }
    _check_keys(policy, set(p_types), "discovery_policy")
    p_values = {k: _typed(policy, k, p_types[k], "discovery_policy") for k in policy}
    warm_join = _section(data, "warm_join")
    _check_keys(warm_join, set(_WARM_JOIN_KEYS), "warm_join")
    w_values = {k: _typed(warm_join, k, _WARM_JOIN_KEYS[k], "warm_join") for k in warm_join}
    try:
        return attrs.evolve(
            config,
            **changes,
            backends=config.backends + backends,
            backends_from_file=config.backends_from_file + tuple(b.id for b in backends),
            timeouts=attrs.evolve(config.timeouts, **t_values),
            health=attrs.evolve(config.health, **h_values),
            discovery=config.discovery + discovery,
            discovery_policy=attrs.evolve(config.discovery_policy, **p_values),
            warm_join=attrs.evolve(config.warm_join, **w_values),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def load_toml(path: str | Path, base: ServerConfig | None = None) -> ServerConfig:
    """Read a TOML configuration file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"configuration file {str(path)!r} does not exist.") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"configuration file {str(path)!r} is not valid TOML: {exc}.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"configuration file {str(path)!r} is not UTF-8 text.") from None
    return attrs.evolve(config_from_mapping(data, base), config_file=str(path))
