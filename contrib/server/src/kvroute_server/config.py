"""The proxy's configuration: attrs types, a TOML loader and command-line overrides.

Precedence, lowest first: built-in defaults, the TOML file (``--config``), a SageMaker
endpoint-config import (``--sagemaker-config``: strategy and its options only), then
command-line flags. Every value is validated here, so the server never starts with a
configuration it would reject later; errors are `kvroute.ConfigError` naming the key.

Each setting is one attrs field made with `kvroute.settings.setting`: its default, type and
validator, and in its metadata its flag, help line and TOML table. `settings` lists them; the
TOML loader reads each table's keys from them (cattrs structures the values, strictly by the
fields' types) and ``kvroute serve`` generates its options from them (`kvroute_server.cli`).
The backends, discovery sources and strategy options are structured tables with their own
flags (``--backend``, ``--discovery``, ``--option``...), parsed here too.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import cattrs
from attrs import validators as v

from kvroute.backend import Backend
from kvroute.errors import ConfigError
from kvroute.session_ids import DEFAULT_SESSION_SOURCES, parse_sources
from kvroute.sessions import AGREE
from kvroute.settings import Setting, setting
from kvroute.slo_choice import UNMET_POLICIES
from kvroute.validators import INTEGER, NUMBER, Validator, expect, parse_key_values

__all__ = [
    "DEFAULT_STRATEGY",
    "PRIORITIES",
    "AdmissionConfig",
    "BackendConfig",
    "DiscoveryConfig",
    "DiscoveryPolicy",
    "HealthConfig",
    "OutlierConfig",
    "PeerConfig",
    "ServerConfig",
    "Setting",
    "TimeoutConfig",
    "SessionConfig",
    "SloConfig",
    "TracingConfig",
    "WarmJoinConfig",
    "apply_settings",
    "config_from_mapping",
    "load_toml",
    "parse_backend_flag",
    "parse_discovery_flag",
    "parse_option_flags",
    "parse_shadow_option_flags",
    "settings",
    "toml_table",
]

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
        _refuse_unknown(data, {f.name for f in attrs.fields(cls)}, where)
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
    return dict(parse_key_values(values, lambda item: ConfigError(f"--option must be key=value (got {item!r}).")))


_positive_number = expect("a number > 0", *NUMBER, v.gt(0))
_non_negative_number = expect("a number >= 0", *NUMBER, v.ge(0))
_positive_int = expect("an integer >= 1", *INTEGER, v.ge(1))
_non_negative_int = expect("an integer >= 0", *INTEGER, v.ge(0))
_share = expect("a number in (0, 1]", *NUMBER, v.gt(0), v.le(1))
_fraction = expect("a fraction in (0, 1] of the backend's weight", *NUMBER, v.gt(0), v.le(1))


def _as_float(value: Any) -> Any:
    """A number as a float (``connect = 5`` is 5.0 seconds); anything else as it is, for the validator to refuse."""
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _one_of(choices: tuple[str, ...]) -> Validator:
    return expect(f"one of {', '.join(choices)}", v.in_(choices))


@attrs.frozen
class TimeoutConfig:
    """Upstream timeouts in seconds.

    ``connect``: opening a TCP connection (a failure is retried on another backend).
    ``first_byte``: from sending the request until the first byte of the response body
    (covers queueing and prefill; not retried, the engine may still be working).
    ``idle``: the longest gap between two body chunks once the body has started.
    """

    connect: float = setting(
        5.0,
        _positive_number,
        converter=_as_float,
        flag="--connect-timeout",
        help="Seconds to open an upstream connection",
    )
    first_byte: float = setting(
        300.0,
        _positive_number,
        converter=_as_float,
        flag="--first-byte-timeout",
        help="Seconds until the first response byte",
    )
    idle: float = setting(
        60.0, _positive_number, converter=_as_float, flag="--idle-timeout", help="Longest gap between response chunks"
    )
    #: Per-attempt first-byte deadline (docs/serve.md, "Gray failures"): ``deadline_factor`` times the fleet's
    #: observed first-byte time for like requests, at least ``deadline_floor``, at most ``first_byte``.
    deadline_floor: float = setting(
        5.0,
        _positive_number,
        converter=_as_float,
        flag="--first-byte-deadline-floor",
        help="Smallest per-attempt first-byte deadline (and the deadline before any first byte was seen)",
    )
    deadline_factor: float = setting(
        4.0,
        _non_negative_number,
        converter=_as_float,
        flag="--first-byte-deadline-factor",
        help="Per-attempt deadline: this times the fleet's p95 first-byte time for like requests; 0 = off",
    )


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

    interval: float = setting(
        5.0, _non_negative_number, flag="--health-interval", help="Seconds between probe rounds; 0 = off"
    )
    timeout: float = setting(2.0, _positive_number, flag="--health-timeout", help="Probe timeout")
    unhealthy_threshold: int = setting(
        3, _positive_int, flag="--unhealthy-threshold", help="Failed probes in a row that eject"
    )
    healthy_threshold: int = setting(
        2, _positive_int, flag="--healthy-threshold", help="Passed probes in a row that restore"
    )
    passive_ejection: bool = setting(True, flag="--passive-ejection", help="Eject a backend on a connection error")
    discover_models: bool = setting(True, help="Ask each backend's adapter for its models")

    @property
    def enabled(self) -> bool:
        return self.interval > 0


_ratio = expect("a number in [0, 1]", *NUMBER, v.ge(0), v.le(1))


@attrs.frozen
class OutlierConfig:
    """Outlier detection on every attempt's outcome (docs/serve.md, "Gray failures").

    A backend is ejected for ``consecutive_errors`` gateway errors in a row (5xx, connection
    errors, answers that are not completions, streams cut short), ``consecutive_deadlines``
    expired first-byte deadlines in a row, a success rate under ``success_rate_ratio`` times the
    rest of the fleet's, or first-byte times over ``latency_factor`` times the rest of the fleet's
    for like requests (both judged over the last ``window`` seconds once it has ``min_requests``
    attempts). It stays out ``base_ejection`` seconds, doubled for each ejection in a row up to
    ``max_ejection``, then returns only when a probe request succeeds; at most
    ``max_ejected_share`` of the fleet is ejected this way at once. 0 turns a rule off.
    """

    enabled: bool = setting(True, flag="--outlier-detection", help="Eject backends that misbehave while healthy")
    consecutive_errors: int = setting(
        5, _non_negative_int, flag="--outlier-consecutive-errors", help="Gateway errors in a row that eject; 0 = off"
    )
    consecutive_deadlines: int = setting(
        3,
        _non_negative_int,
        flag="--outlier-consecutive-deadlines",
        help="Expired first-byte deadlines in a row that eject; 0 = off",
    )
    success_rate_ratio: float = setting(
        0.8,
        _ratio,
        converter=_as_float,
        flag="--outlier-success-rate-ratio",
        help="Eject below this share of the rest of the fleet's success rate; 0 = off",
    )
    latency_factor: float = setting(
        4.0,
        _non_negative_number,
        converter=_as_float,
        flag="--outlier-latency-factor",
        help="Eject when first bytes take this many times the fleet's for like requests; 0 = off",
    )
    min_requests: int = setting(
        20, _positive_int, flag="--outlier-min-requests", help="Attempts in the window before rates are judged"
    )
    window: float = setting(
        30.0, _positive_number, converter=_as_float, flag="--outlier-window", help="Seconds of outcomes judged"
    )
    base_ejection: float = setting(
        10.0,
        _positive_number,
        converter=_as_float,
        flag="--outlier-base-ejection",
        help="Seconds of a first ejection, doubled for each one in a row",
    )
    max_ejection: float = setting(
        300.0, _positive_number, converter=_as_float, flag="--outlier-max-ejection", help="Longest ejection"
    )
    max_ejected_share: float = setting(
        0.6, _share, flag="--outlier-max-ejected-share", help="Largest share of the fleet ejected as outliers at once"
    )

    def __attrs_post_init__(self) -> None:
        if self.max_ejection < self.base_ejection:
            raise ConfigError(
                f"'max_ejection' must be >= 'base_ejection' {self.base_ejection} (got {self.max_ejection})."
            )


_MASS_REMOVAL = ("gradual", "hold")
_HTTP_PROTOCOLS = ("kvroute", "httptools")


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


def parse_discovery_flag(value: str, flag: str = "--discovery") -> DiscoveryConfig:
    """Parse ``--discovery KIND:TARGET`` (``file:fleet.toml``, ``dns:vllm.svc:8000``); the factory gets ``target``.

    ``flag`` names the option in the error (``--peer-discovery`` takes the same form).
    """
    if not isinstance(value, str):
        raise ConfigError(f"{flag} must be KIND:TARGET such as 'dns:vllm.default.svc:8000' (got {value!r}).")
    kind, sep, target = value.strip().partition(":")
    if not sep or not kind or not target:
        raise ConfigError(
            f"{flag} must be KIND:TARGET such as 'dns:vllm.default.svc:8000' or 'file:fleet.toml' (got {value!r})."
        )
    return DiscoveryConfig(kind=kind, options={"target": target})


def _peer_discovery(value: Any) -> tuple[DiscoveryConfig, ...]:
    """Peer discovery sources from ``[peers] discovery`` (a list of ``KIND:TARGET`` strings or of tables shaped
    like ``[[discovery]]``) or repeated ``--peer-discovery`` flags; a source's found endpoints are peers."""
    if isinstance(value, str | Mapping | DiscoveryConfig):
        value = [value]
    if not isinstance(value, list | tuple):
        raise ConfigError(
            f"[peers] 'discovery' must be a list of 'KIND:TARGET' strings or tables with 'kind' (got {value!r})."
        )
    out: list[DiscoveryConfig] = []
    for i, item in enumerate(value):
        where = f"[peers] discovery #{i + 1}"
        if isinstance(item, DiscoveryConfig):
            source = item
        elif isinstance(item, str):
            source = parse_discovery_flag(item, "--peer-discovery")
        else:
            source = DiscoveryConfig.from_mapping(item, where)
        if source.api_key is not None:
            raise ConfigError(f"{where}: 'api_key' is for backends; peers use the peer token.")
        if "kind" in source.options:
            raise ConfigError(f"{where}: 'backend_kind' is for backends; peers are kvroute serve replicas.")
        out.append(source)
    return tuple(out)


@attrs.frozen
class DiscoveryPolicy:
    """How discovered changes are applied (docs/serve.md, "Discovery").

    An update that would remove more than ``max_removal_share`` of the discovered backends at
    once is applied one removal per ``removal_interval`` seconds (``on_mass_removal = "gradual"``)
    or not at all while the answer says so (``"hold"``). A source with no good answer for
    ``stale_after`` seconds is reported stale even when its provider said nothing.
    """

    max_removal_share: float = setting(
        0.5,
        _share,
        flag="--max-removal-share",
        help="Largest share of discovered backends one update removes at once",
    )
    removal_interval: float = setting(
        10.0, _positive_number, flag="--removal-interval", help="Seconds between removals of a mass removal"
    )
    on_mass_removal: str = setting(
        "gradual",
        _one_of(_MASS_REMOVAL),
        flag="--on-mass-removal",
        choices=_MASS_REMOVAL,
        help="Apply a mass removal gradually or hold it",
    )
    stale_after: float = setting(
        300.0,
        _positive_number,
        flag="--discovery-stale-after",
        help="Seconds without a good answer before a source is stale",
    )


@attrs.frozen
class WarmJoinConfig:
    """What the proxy does when a backend joins a serving fleet (docs/warm-join.md); off by default.

    ``prefill``: how many of the hottest prefixes the new backend will own are sent to it first
    (prefix only, ``max_tokens`` 1), at most ``prefill_concurrency`` at a time, all within
    ``prefill_timeout`` seconds, while it takes no traffic; 0 = no pre-fill. ``slow_start``: the
    seconds over which its weight then rises from ``slow_start_initial`` of it to all of it in
    ``slow_start_steps`` steps (as Envoy's slow start); 0 = full weight at once.
    """

    slow_start: float = setting(
        0.0,
        _non_negative_number,
        flag="--slow-start",
        metavar="SECONDS",
        help="Ramp a joining backend's weight over this many seconds; 0 = off (docs/warm-join.md)",
    )
    slow_start_initial: float = setting(
        0.1, _fraction, flag="--slow-start-initial", help="Share of its weight a joining backend starts at"
    )
    slow_start_steps: int = setting(10, _positive_int, flag="--slow-start-steps", help="Equal steps of the weight ramp")
    prefill: int = setting(
        0,
        _non_negative_int,
        flag="--prefill",
        metavar="N",
        help="Pre-fill a joining backend with the N hottest prefixes it will own; 0 = off",
    )
    prefill_concurrency: int = setting(
        2, _positive_int, flag="--prefill-concurrency", help="Pre-fill requests in flight at once"
    )
    prefill_timeout: float = setting(
        30.0, _positive_number, flag="--prefill-timeout", help="Seconds a pre-fill may take in all"
    )

    @property
    def enabled(self) -> bool:
        return self.slow_start > 0 or self.prefill > 0


def _session_sources(value: Any) -> tuple[str, ...]:
    """Session id sources from a comma-separated string (the flag) or a list (TOML), checked and de-duplicated."""
    if not isinstance(value, str | list | tuple):
        raise ConfigError(f"session id sources must be a list or a comma-separated string (got {value!r}).")
    return tuple(str(source) for source in parse_sources(value))


@attrs.frozen
class SessionConfig:
    """Session affinity (docs/serve.md, "Sessions"): requests of one session, or one conversation, stay on one backend.

    A session id is read from the first usable of ``sources`` (`kvroute.session_ids`); a session
    with no binding is placed by its id's hash, so every proxy replica agrees; bindings idle for
    ``ttl`` seconds expire, and at most ``max_sessions`` are kept. With ``conversations``, chat
    requests without a session id are bound by their conversation (strategies that tell
    conversations apart: the consistent-hash family). ``agree`` (``auto``, ``on``, ``off``) places
    conversations by their key's home, as session ids are, so replicas without peers agree
    (`kvroute.sessions.Sessions.agree`).
    """

    enabled: bool = setting(True, flag="--sessions", help="Keep sessions and conversations on one backend")
    sources: tuple[str, ...] = setting(
        tuple(str(s) for s in DEFAULT_SESSION_SOURCES),
        converter=_session_sources,
        flag="--session-sources",
        metavar="SOURCES",
        show_default=False,
        help="Where session ids are read, in order: comma-separated 'header:NAME' or 'body:PATH' "
        "[default: the eight in docs/serve.md]",
    )
    ttl: float = setting(
        300.0,
        _positive_number,
        converter=_as_float,
        flag="--session-ttl",
        metavar="SECONDS",
        help="Seconds a session's binding outlives its last request",
    )
    max_sessions: int = setting(
        100_000, _positive_int, flag="--max-sessions", help="Bindings kept at most (least recently used go first)"
    )
    conversations: bool = setting(
        True, flag="--session-conversations", help="Bind conversations that carry no session id"
    )
    agree: str = setting(
        "auto",
        _one_of(AGREE),
        flag="--session-agree",
        choices=AGREE,
        help="Place conversations by their key's home so replicas agree without peers; auto: once other "
        "routers are seen",
    )


def _peer_urls(value: Any) -> tuple[str, ...]:
    """Peer base URLs from a list (TOML) or repeated flags: http(s) URLs with a host, de-duplicated in order."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple):
        raise ConfigError(f"'peers' must be a list of URLs (got {value!r}).")
    out: list[str] = []
    for url in value:
        checked = _check_url(url, "peer")
        if checked not in out:
            out.append(checked)
    return tuple(out)


#: Most holds one sync request may carry (docs/serve.md, "Several replicas").
MAX_PEER_BATCH = 4096
_peer_batch = expect(f"an integer from 1 to {MAX_PEER_BATCH}", *INTEGER, v.ge(1), v.le(MAX_PEER_BATCH))


@attrs.frozen
class PeerConfig:
    """Router-replica sync (docs/serve.md, "Several replicas"): off unless peers are given.

    Every ``interval`` seconds the proxy sends the holds it made (a conversation's, a session's or a
    prefix key's backend) to each of ``urls`` (other ``kvroute serve`` replicas' base URLs), at most
    ``batch`` per request, with ``Authorization: Bearer <token>``; at most ``queue`` holds wait per
    peer (the oldest are dropped and counted when a peer is down or slow).
    """

    urls: tuple[str, ...] = setting((), converter=_peer_urls, help="Other router replicas' base URLs")
    #: Where the other replicas are found (``--peer-discovery``, ``[peers] discovery``): the backend discovery
    #: kinds (``dns:NAME:PORT``, ``dns:_svc._tcp.NAME``, ``kubernetes:NS/SVC:PORT``, ``file:PATH``); every
    #: endpoint a source finds is a peer, this replica's own address skipped.
    discovery: tuple[DiscoveryConfig, ...] = attrs.field(default=(), converter=_peer_discovery)
    token: str | None = setting(
        None,
        flag="--peer-token",
        envvar="KVROUTE_PEER_TOKEN",
        show_default=False,
        repr=False,
        help="Shared secret of the replicas' sync endpoint (env KVROUTE_PEER_TOKEN); needed with --peer",
    )
    interval: float = setting(
        0.05,
        _positive_number,
        converter=_as_float,
        flag="--peer-interval",
        metavar="SECONDS",
        help="Seconds between two batches of holds sent to each peer",
    )
    batch: int = setting(1024, _peer_batch, flag="--peer-batch", help="Holds one sync request carries at most")
    queue: int = setting(
        16384, _positive_int, flag="--peer-queue", help="Holds waiting per peer at most (the oldest are dropped)"
    )
    timeout: float = setting(
        1.0,
        _positive_number,
        converter=_as_float,
        flag="--peer-timeout",
        metavar="SECONDS",
        help="Seconds a sync request to a peer may take",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.urls or self.discovery)

    def check(self) -> None:
        """Refuse peers without a token: checked on the final configuration (flags and environment applied), so
        that a file can name the peers while the token comes from ``KVROUTE_PEER_TOKEN`` (a Kubernetes Secret)."""
        if self.enabled and self.token is None:
            raise ConfigError("peers are configured but no peer token is set (--peer-token or KVROUTE_PEER_TOKEN).")

    def __attrs_post_init__(self) -> None:
        if self.token is not None and len(self.token) < 16:
            raise ConfigError(f"'peer_token' must be at least 16 characters (got {len(self.token)}).")


#: The priority classes (`kvroute.Priority`), most important first.
PRIORITIES = ("critical", "standard", "sheddable")
#: The largest latency objective taken, in milliseconds (one hour): anything larger is a mistake, not an objective.
MAX_OBJECTIVE_MS = 3_600_000.0
_OBJECTIVE_KEYS = {"ttft_ms", "tpot_ms", "priority"}


def _optional_objective(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= MAX_OBJECTIVE_MS
    if not ok:
        raise ConfigError(
            f"'{attribute.name}' must be a number of milliseconds in (0, {MAX_OBJECTIVE_MS:.0f}], or unset "
            f"(got {value!r})."
        )


def _check_model_objectives(models: Mapping[str, Mapping[str, Any]]) -> None:
    """Each ``[slo.models."NAME"]`` table: only ``ttft_ms``, ``tpot_ms`` and ``priority``, each valid."""
    for model, table in models.items():
        where = f"[slo.models.{model!r}]"
        _refuse_unknown(table, _OBJECTIVE_KEYS, where)
        for key in ("ttft_ms", "tpot_ms"):
            value = table.get(key)
            if value is not None and not (
                isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= MAX_OBJECTIVE_MS
            ):
                raise ConfigError(
                    f"{where} '{key}' must be a number of milliseconds in (0, {MAX_OBJECTIVE_MS:.0f}] (got {value!r})."
                )
        priority = table.get("priority")
        if priority is not None and priority not in PRIORITIES:
            raise ConfigError(f"{where} 'priority' must be one of {', '.join(PRIORITIES)} (got {priority!r}).")


@attrs.frozen
class SloConfig:
    """Latency objectives a request gets when its headers name none (docs/serve.md, "Objectives and admission").

    A request's ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` (or llm-d's ``x-llm-d-slo-ttft-ms`` /
    ``x-llm-d-slo-tpot-ms``) and ``x-priority`` headers win; then its model's table in ``models``
    (``{ttft_ms, tpot_ms, priority}``, any of them); then ``ttft_ms``, ``tpot_ms`` and ``priority``
    here. Unset objectives are none: the request is routed as before.
    """

    ttft_ms: float | None = setting(
        None,
        _optional_objective,
        converter=_as_float,
        flag="--slo-ttft-ms",
        click_type=float,
        metavar="MS",
        show_default=False,
        help="Time-to-first-token objective of requests that name none, in ms [default: none]",
    )
    tpot_ms: float | None = setting(
        None,
        _optional_objective,
        converter=_as_float,
        flag="--slo-tpot-ms",
        click_type=float,
        metavar="MS",
        show_default=False,
        help="Time-per-output-token objective of requests that name none, in ms [default: none]",
    )
    priority: str = setting(
        "standard",
        _one_of(PRIORITIES),
        flag="--slo-priority",
        choices=PRIORITIES,
        help="Priority class of requests without x-priority",
    )
    #: SLO-aware choice (`kvroute.SloChoice`): move a request off its cache home when the home is predicted to miss
    #: its objectives and another backend within the load bound is predicted to meet them.
    aware: bool = setting(
        False, flag="--slo-aware", help="Choose among backends by predicted TTFT/TPOT against each request's objectives"
    )
    #: Where the SLO-aware choice sends a request that no backend within the load bound is predicted to serve in
    #: time (`kvroute.slo_choice.UNMET_POLICIES`): its cache home, the cheapest backend, or the backend of the
    #: longest predicted TTFT (``sink``: late work piles up on one backend so that the others stay on time).
    unmet: str = setting(
        "home",
        _one_of(UNMET_POLICIES),
        flag="--slo-unmet",
        choices=UNMET_POLICIES,
        help="Where the SLO-aware choice sends a request no backend is predicted to serve in time",
    )
    #: Without objectives, the SLO-aware choice minimises predicted TTFT + this times predicted TPOT.
    tpot_weight: float = setting(
        50.0, _non_negative_number, converter=_as_float, help="Weight of predicted TPOT against TTFT (no objectives)"
    )
    #: The predictor's priors (`kvroute.Priors`), used until a backend's own rates are learned and while its
    #: engine telemetry is stale.
    prefill_rate: float = setting(
        10_000.0,
        _positive_number,
        converter=_as_float,
        flag="--slo-prefill-rate",
        metavar="TOKENS_PER_S",
        help="Prior prefill rate of a backend, in prompt tokens per second",
    )
    decode_step: float = setting(
        0.02,
        _positive_number,
        converter=_as_float,
        flag="--slo-decode-step",
        metavar="SECONDS",
        help="Prior seconds per output token of a request decoding alone",
    )
    ttft_overhead: float = setting(
        0.02,
        _non_negative_number,
        converter=_as_float,
        help="Prior seconds before a first token with nothing to prefill",
    )
    decode_load_weight: float = setting(
        0.02, _non_negative_number, converter=_as_float, help="Share of a decode step each concurrent request adds"
    )
    #: Batch seats per engine (per data-parallel rank; vLLM's ``max_num_seqs``): requests beyond them wait for one.
    #: Unset, they are learned from the engines' reported running requests and from this proxy's own requests.
    seats: int | None = setting(
        None,
        v.optional(_positive_int),
        flag="--slo-seats",
        click_type=int,
        metavar="N",
        show_default=False,
        help="Prior batch seats per engine (vLLM's max_num_seqs) [default: learned]",
    )
    #: Per model (its name, as requests give it): ``{"ttft_ms": 500, "tpot_ms": 50, "priority": "critical"}``.
    models: Mapping[str, Mapping[str, Any]] = setting(
        factory=dict, help="Per-model objectives: {model: {ttft_ms, tpot_ms, priority}}"
    )

    def __attrs_post_init__(self) -> None:
        _check_model_objectives(self.models)

    def predicts(self, admission: AdmissionConfig) -> bool:
        """Whether the router needs a predictor: for the SLO-aware choice, or for admission to judge by."""
        return self.aware or admission.enabled


_ADMISSION_MODES = ("off", "queue", "shed")
_ADMISSION_ORDERS = ("deadline", "service_time")
_CLASS_ACTIONS = ("auto", "queue", "shed", "send")
#: The largest admission queue (entries, per worker).
MAX_ADMISSION_QUEUE = 100_000
_queue_size = expect(f"an integer from 1 to {MAX_ADMISSION_QUEUE}", *INTEGER, v.ge(1), v.le(MAX_ADMISSION_QUEUE))


@attrs.frozen
class AdmissionConfig:
    """What the proxy does with a request no backend is predicted to serve within its objectives (off by default).

    ``mode = "queue"``: such requests wait in a bounded queue (per worker, ``queue_size`` entries,
    ordered by ``order``) until a backend is predicted to meet them, their deadline passes, or at most
    ``max_wait`` seconds; sheddable ones are shed at once. ``mode = "shed"``: they are answered 429
    with ``Retry-After`` at once; critical ones wait instead. ``critical``, ``standard`` and
    ``sheddable`` override a class's action (``queue``, ``shed``, ``send``: forward anyway); critical
    requests are never shed. See docs/serve.md, "Objectives and admission".
    """

    mode: str = setting(
        "off",
        _one_of(_ADMISSION_MODES),
        flag="--admission",
        choices=_ADMISSION_MODES,
        help="Requests predicted to miss their objectives on every backend: off, queue them, or shed them (429)",
    )
    queue_size: int = setting(
        256, _queue_size, flag="--admission-queue-size", metavar="N", help="Most requests held at once, per worker"
    )
    order: str = setting(
        "deadline",
        _one_of(_ADMISSION_ORDERS),
        flag="--admission-order",
        choices=_ADMISSION_ORDERS,
        help="Which held request goes first: earliest deadline, or shortest predicted service time",
    )
    max_wait: float = setting(
        30.0,
        _positive_number,
        converter=_as_float,
        flag="--admission-max-wait",
        metavar="SECONDS",
        help="Longest a request is held (also the deadline of one without a TTFT objective)",
    )
    critical: str = setting(
        "auto",
        expect("one of auto, queue, send (critical requests are never shed)", v.in_(("auto", "queue", "send"))),
        flag="--admission-critical",
        choices=("auto", "queue", "send"),
        help="Action for critical requests predicted to miss (never shed); auto: queue",
    )
    standard: str = setting(
        "auto",
        _one_of(_CLASS_ACTIONS),
        flag="--admission-standard",
        choices=_CLASS_ACTIONS,
        help="Action for standard requests predicted to miss; auto: the mode's",
    )
    sheddable: str = setting(
        "auto",
        _one_of(_CLASS_ACTIONS),
        flag="--admission-sheddable",
        choices=_CLASS_ACTIONS,
        help="Action for sheddable requests predicted to miss; auto: shed",
    )

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def action(self, priority: str) -> str:
        """What happens to a request of class ``priority`` that no backend is predicted to serve in time."""
        chosen = getattr(self, priority)
        if chosen != "auto":
            return str(chosen)
        if priority == "critical":
            return "queue"
        if priority == "sheddable":
            return "shed"
        return "queue" if self.mode == "queue" else "shed"


_OTLP_PROTOCOLS = ("http/protobuf", "grpc")
_ratio = expect("a number from 0 to 1", *NUMBER, v.ge(0), v.le(1))


def _otlp_endpoint(value: Any) -> Any:
    """``--otlp-endpoint``: an http(s) URL with a host, trailing slash dropped; anything else for the validator."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        return value
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"'otlp_endpoint' must be an http:// or https:// URL with a host (got {value!r}).")
    return value.rstrip("/")


@attrs.frozen
class TracingConfig:
    """OpenTelemetry tracing (docs/tracing.md): on when an OTLP endpoint is set here or in ``OTEL_EXPORTER_OTLP_*``.

    Unset values fall back to the standard ``OTEL_*`` environment variables (protocol, sampler, service
    name), then to OpenTelemetry's defaults. Needs ``kvroute[tracing]``.
    """

    endpoint: str | None = setting(
        None,
        converter=_otlp_endpoint,
        flag="--otlp-endpoint",
        metavar="URL",
        show_default=False,
        help="Export traces over OTLP to this collector URL (env OTEL_EXPORTER_OTLP_ENDPOINT); unset: tracing off",
    )
    protocol: str | None = setting(
        None,
        v.optional(_one_of(_OTLP_PROTOCOLS)),
        flag="--otlp-protocol",
        choices=_OTLP_PROTOCOLS,
        show_default=False,
        help="OTLP protocol [default: env OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf]",
    )
    sample_ratio: float | None = setting(
        None,
        v.optional(_ratio),
        converter=_as_float,
        flag="--trace-sample-ratio",
        metavar="RATIO",
        click_type=float,
        show_default=False,
        help="Share of new traces sampled, parent-based [default: env OTEL_TRACES_SAMPLER, else all]",
    )
    service_name: str | None = setting(
        None, show_default=False, help="service.name of the spans [default: env OTEL_SERVICE_NAME, else kvroute]"
    )
    max_queue: int = setting(2048, _positive_int, help="Finished spans waiting for export at most; more are dropped")


_STATUS_MODES = ("on", "admin", "off")
#: Most decisions the status page may keep (each is a few hundred bytes of JSON when shown).
MAX_STATUS_DECISIONS = 10_000


_status_decisions = expect(
    f"an integer from 0 to {MAX_STATUS_DECISIONS}", *INTEGER, v.ge(0), v.le(MAX_STATUS_DECISIONS)
)


@attrs.frozen
class ServerConfig:
    """Everything ``kvroute serve`` needs; see docs/serve.md for each key."""

    backends: tuple[BackendConfig, ...] = ()
    strategy: str = setting(DEFAULT_STRATEGY, flag="--strategy", section="routing", help="Routing strategy plugin name")
    options: Mapping[str, Any] = setting(factory=dict, section="routing", help="Strategy options")
    host: str = setting("127.0.0.1", flag="--host", section="server", help="Address to listen on")
    port: int = setting(8000, flag="--port", section="server", help="Port to listen on")
    max_body_bytes: int = setting(
        32 * 1024 * 1024, _positive_int, flag="--max-body-bytes", section="server", help="Largest request body accepted"
    )
    max_attempts: int = setting(
        3, _positive_int, flag="--max-attempts", section="server", help="Backends tried per request before giving up"
    )
    retry_after_s: int = setting(
        1, _positive_int, flag="--retry-after", section="server", help="Retry-After seconds on 503"
    )
    forward_authorization: bool = setting(
        True, flag="--forward-authorization", section="server", help="Forward the client's Authorization header"
    )
    backend_header: str | None = setting(
        "x-kvroute-backend",
        flag="--backend-header",
        section="server",
        help="Response header naming the chosen backend; '' = off",
    )
    admin_token: str | None = setting(
        None,
        flag="--admin-token",
        section="server",
        envvar="KVROUTE_ADMIN_TOKEN",
        show_default=False,
        repr=False,
        help="Bearer token of the admin API (env KVROUTE_ADMIN_TOKEN); unset: admin API off",
    )
    access_log: bool = setting(True, flag="--access-log", section="server", help="One structured log line per request")
    passthrough_paths: tuple[str, ...] = setting(
        ("/tokenize", "/detokenize", "/v1/embeddings", "/v1/score", "/v1/rerank", "/pooling"),
        section="server",
        help="Routes passed through to one backend",
    )
    timeouts: TimeoutConfig = attrs.field(factory=TimeoutConfig)
    health: HealthConfig = attrs.field(factory=HealthConfig)
    outliers: OutlierConfig = attrs.field(factory=OutlierConfig)
    #: Proxy processes sharing the listening socket (``kvroute serve --workers``); 1 = this process.
    workers: int = setting(
        1,
        _positive_int,
        flag="--workers",
        section="server",
        help="Proxy processes sharing the port, with one metrics view",
    )
    #: Seconds a stop waits for requests in flight before closing their connections.
    shutdown_timeout: float = setting(
        30.0,
        _positive_number,
        converter=_as_float,
        flag="--shutdown-timeout",
        section="server",
        help="Seconds a stop waits for requests in flight",
    )
    #: Discovery sources (``--discovery``, ``[[discovery]]``), in order: the first wins an id conflict.
    discovery: tuple[DiscoveryConfig, ...] = ()
    discovery_policy: DiscoveryPolicy = attrs.field(factory=DiscoveryPolicy)
    #: ``GET /status`` and ``/status.json``: ``on`` (anyone), ``admin`` (the admin token) or ``off`` (404).
    status: str = setting(
        "on",
        _one_of(_STATUS_MODES),
        flag="--status",
        section="server",
        choices=_STATUS_MODES,
        help="GET /status and /status.json: on, behind the admin token, or off",
    )
    #: How many recent routing decisions the status page keeps (0: none).
    status_decisions: int = setting(
        100,
        _status_decisions,
        flag="--status-decisions",
        section="server",
        metavar="N",
        help="Recent routing decisions the status page keeps",
    )
    #: The TOML file read (`load_toml`), and the ids of the ``[[backends]]`` it gave (the status page's origins).
    config_file: str | None = None
    backends_from_file: tuple[str, ...] = ()
    #: Shadow strategies (``--shadow``, ``[routing] shadow``): decided in dry run beside the live one.
    shadow: tuple[str, ...] = setting((), section="routing", help="Shadow strategies")
    #: Each shadow's strategy options by name (``--shadow-option NAME.KEY=VALUE``, ``[routing.shadow_options.NAME]``).
    shadow_options: Mapping[str, Mapping[str, Any]] = setting(
        factory=dict, section="routing", help="Each shadow's strategy options"
    )
    #: Settings of the fleet cache view that scores strategies (``[routing.cache_view]``; `kvroute.CacheView`).
    cache_view: Mapping[str, Any] = setting(factory=dict, section="routing", help="The fleet cache view's settings")
    #: Warm join of backends added while serving (``[warm_join]``, ``--slow-start``, ``--prefill``).
    warm_join: WarmJoinConfig = attrs.field(factory=WarmJoinConfig)
    #: Session affinity (``[sessions]``, ``--sessions``, ``--session-*``).
    sessions: SessionConfig = attrs.field(factory=SessionConfig)
    #: OpenTelemetry tracing (``[tracing]``, ``--otlp-endpoint``...): off unless an endpoint is configured.
    tracing: TracingConfig = attrs.field(factory=TracingConfig)
    #: Router-replica sync (``[peers]``, ``--peer``, ``--peer-*``): off unless peers are given.
    peers: PeerConfig = attrs.field(factory=PeerConfig)
    #: The server protocol of each client connection: kvroute's own (`kvroute_server.http.protocol`) or uvicorn's.
    http: str = setting(
        "kvroute",
        _one_of(_HTTP_PROTOCOLS),
        flag="--http",
        section="server",
        choices=_HTTP_PROTOCOLS,
        help="HTTP/1.1 server protocol: kvroute's own (faster) or uvicorn's httptools",
    )
    #: Default latency objectives and priority (``[slo]``, ``--slo-*``); headers win.
    slo: SloConfig = attrs.field(factory=SloConfig)
    #: Holding or shedding requests predicted to miss their objectives (``[admission]``, ``--admission*``).
    admission: AdmissionConfig = attrs.field(factory=AdmissionConfig)

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

    def bad(item: str) -> ConfigError:
        return ConfigError(
            f"--shadow-option must be NAME.KEY=VALUE such as 'bounded-load.load_factor=1.5' (got {item!r})."
        )

    out: dict[str, dict[str, str]] = {}
    for (target, value), item in zip(parse_key_values(values, bad), values, strict=True):
        name, dot, key = target.rpartition(".")
        if not dot or not name or not key:
            raise bad(item)
        out.setdefault(name, {})[key] = value
    return out


def _is_token(name: str) -> bool:
    allowed = set("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return bool(name) and all(c in allowed for c in name)


def settings(cls: type = ServerConfig, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any, Setting]]:
    """Every setting of ``cls`` and of the setting classes it nests, in field order: ``(path, field, Setting)``.

    ``path`` leads from `ServerConfig` to the field (``("timeouts", "connect")``); `toml_table` names its table.
    """
    for field in attrs.fields(cls):
        meta = field.metadata.get("setting")
        if meta is not None:
            yield (*path, field.name), field, meta
        elif isinstance(field.type, type) and attrs.has(field.type):
            yield from settings(field.type, (*path, field.name))


def toml_table(path: tuple[str, ...], meta: Setting) -> str:
    """The TOML table a setting is read from: its `Setting.section`, else the nested class's field name."""
    return meta.section or path[0]


class _WrongType(Exception):
    """A TOML value of the wrong type; the caller words the message, knowing the table and key."""


def _strict(kind: Any, name: str) -> Any:
    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise _WrongType(name)
        return value

    return structure


class _NotATable(Exception):
    """A TOML value that should be a table; ``args[0]`` names the table when it is not the key's own."""


def _table(value: Any, _: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _NotATable(None, value)
    return dict(value)


def _tables(value: Any, _: Any) -> Mapping[str, Mapping[str, Any]]:
    out = {}
    for name, table in _table(value, _).items():
        if not isinstance(table, Mapping):
            raise _NotATable(name, table)
        out[name] = dict(table)
    return out


#: Structures TOML values into the types of the settings' fields, strictly: a TOML int is no bool
#: and no string, only a float field takes an int (as a float), a list field takes only a list.
_converter = cattrs.Converter()
_converter.register_structure_hook(int, _strict(int, "int"))
_converter.register_structure_hook(float, _strict(int | float, "float"))
_converter.register_structure_hook(bool, _strict(bool, "bool"))
_converter.register_structure_hook(str, _strict(str, "str"))
_converter.register_structure_hook_func(
    lambda t: t == tuple[str, ...], lambda value, _: tuple(_strict(list, "list")(value, _))
)
_converter.register_structure_hook_func(lambda t: t == Mapping[str, Any], _table)
_converter.register_structure_hook_func(lambda t: t == Mapping[str, Mapping[str, Any]], _tables)


def _section(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"[{name}] must be a table (got {type(table).__name__}).")
    return table


def _refuse_unknown(table: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (expected some of: {', '.join(sorted(known))})."
        )


def _check_keys(table: Mapping[str, Any], known: set[str], where: str) -> None:
    _refuse_unknown(table, known, f"[{where}]")


def _typed(table: Mapping[str, Any], key: str, expected: type, where: str) -> Any:
    try:
        return _converter.structure(table[key], expected)
    except _NotATable as exc:
        name, got = exc.args
        raise ConfigError(f"[{name or key}] must be a table (got {type(got).__name__}).") from None
    except _WrongType as exc:
        value = table[key]
        raise ConfigError(f"[{where}] '{key}' must be {exc} (got {type(value).__name__} {value!r}).") from None


#: The TOML tables, each with the settings it holds: ``{table: {key: (path, field)}}``.
_TABLES: dict[str, dict[str, tuple[tuple[str, ...], Any]]] = {}


def _read_table(data: Mapping[str, Any], name: str) -> dict[tuple[str, ...], Any]:
    """The settings of TOML table ``name`` that ``data`` gives, structured, by path; unknown keys are errors."""
    table = _section(data, name)
    fields = _TABLES[name]
    _check_keys(table, set(fields) | ({"discovery"} if name == "peers" else set()), name)
    return {fields[key][0]: _typed(table, key, fields[key][1].type, name) for key in fields if key in table}


def apply_settings(config: ServerConfig, values: Mapping[tuple[str, ...], Any]) -> ServerConfig:
    """``config`` with the settings at the given paths replaced; validators run, errors are `ConfigError`."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        if len(path) == 1:
            top[path[0]] = value
        else:
            nested.setdefault(path[0], {})[path[1]] = value
    try:
        for name, changes in nested.items():
            top[name] = attrs.evolve(getattr(config, name), **changes)
        return attrs.evolve(config, **top)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def config_from_mapping(data: Mapping[str, Any], base: ServerConfig | None = None) -> ServerConfig:
    """Build a `ServerConfig` from the parsed TOML document (see docs/serve.md)."""
    _check_keys(data, {*_TABLES, "backends", "discovery"}, "top level")
    config = base or ServerConfig()
    values = _read_table(data, "server")
    if values.get(("backend_header",)) == "":
        values[("backend_header",)] = None
    values.update(_read_table(data, "routing"))
    shadow = values.get(("shadow",))
    if shadow is not None and not all(isinstance(name, str) and name for name in shadow):
        raise ConfigError(f"[routing] 'shadow' must be a list of strategy names (got {list(shadow)!r}).")
    for name in ("timeouts", "health", "outliers"):
        values.update(_read_table(data, name))

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
    peer_sources = None
    peers_table = _section(data, "peers")
    if "discovery" in peers_table:  # a list of sources, not a setting with a flag of its own
        peer_sources = _peer_discovery(peers_table["discovery"])
        data = {**data, "peers": {k: v for k, v in peers_table.items() if k != "discovery"}}
    for name in ("discovery_policy", "warm_join", "sessions", "slo", "admission", "tracing", "peers"):
        values.update(_read_table(data, name))
    if peer_sources is not None:
        values[("peers", "discovery")] = peer_sources
    values[("backends",)] = config.backends + backends
    values[("backends_from_file",)] = config.backends_from_file + tuple(b.id for b in backends)
    values[("discovery",)] = config.discovery + discovery
    return apply_settings(config, values)


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


for _cls in (
    TimeoutConfig,
    HealthConfig,
    OutlierConfig,
    DiscoveryPolicy,
    WarmJoinConfig,
    SessionConfig,
    SloConfig,
    AdmissionConfig,
    TracingConfig,
    PeerConfig,
    BackendConfig,
    DiscoveryConfig,
    ServerConfig,
):
    attrs.resolve_types(_cls)
for _path, _field, _meta in settings():
    _TABLES.setdefault(toml_table(_path, _meta), {})[_path[-1]] = (_path, _field)
