"""The ``kubernetes`` discovery provider: list a Service's EndpointSlices, then watch them.

The loop is the informer pattern of client-go, kept small:

1. **list** the slices (label ``kubernetes.io/service-name=SERVICE``), replace the state, publish;
2. **watch** from the list's ``resourceVersion`` with ``allowWatchBookmarks``: ADDED/MODIFIED/DELETED
   change one slice's entry (publish when the backend set changed), BOOKMARK only moves the
   resourceVersion; a watch the server ends (its ``timeoutSeconds``) is reopened from the last
   resourceVersion seen;
3. **410 Gone** (an ERROR event with code 410, or an HTTP 410 answer to the watch) means that
   resourceVersion has been compacted away: relist (1);
4. anything else (connection refused or dropped, a 5xx, a bad kubeconfig) is reported with
   ``sink.failed`` and retried after a capped exponential backoff (`kvroute.loops.KeepAlive`: a list,
   or a watch that delivered events, starts it over), resuming the watch from the last
   resourceVersion when there is one, so nothing is relisted needlessly.

Cancellation is the only way out of `KubernetesDiscovery.run`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import anyio
import attrs
import structlog
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiClient, Configuration, DiscoveryV1Api
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import ConfigException
from kubernetes_asyncio.watch import Watch

from kvroute.discovery import DiscoverySink, Snapshot
from kvroute.loops import Backoff, KeepAlive
from kvroute_kubernetes.slices import Defaults, SliceState
from kvroute_kubernetes.target import KubernetesTarget

__all__ = ["KubernetesDiscovery"]

log = structlog.get_logger(__name__)

_OPTIONS = (
    "target",
    "kubeconfig",
    "context",
    "kind",
    "models",
    "scheme",
    "watch_timeout",
    "request_timeout",
    "backoff_initial",
    "backoff_max",
    "jitter",
    "seed",
    "interval",  # the option every kind takes; a watch has no polling interval, so it is accepted and unused
)


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"kubernetes discovery: '{name}' must be a positive number of seconds (got {value!r}).")
    return float(value)


class DiscoveryFailed(Exception):
    """The list or the watch failed; the message is the reason ``sink.failed`` was given."""


def _default_backoff() -> Backoff:
    return Backoff(initial=0.5, maximum=30.0, jitter=0.2)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        text = f"HTTP {exc.status} {exc.reason or ''}".strip()
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


@attrs.frozen
class KubernetesDiscovery:
    """Follows ``target``'s EndpointSlices; see the module docstring and docs/kubernetes.md for the options.

    ``kubeconfig`` (a path) wins when set; otherwise the in-cluster service account is used when
    the process runs in a pod, else the default kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``).
    """

    target: KubernetesTarget
    kubeconfig: str | None = None
    context: str | None = None
    defaults: Defaults = attrs.field(factory=Defaults)
    watch_timeout: float = 300.0
    request_timeout: float = 30.0
    backoff: Backoff = attrs.field(factory=_default_backoff)

    @classmethod
    def create(cls, **options: Any) -> KubernetesDiscovery:
        """The factory registered as kind ``kubernetes``: validate ``options``, raise ValueError naming the bad one."""
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ValueError(
                f"kubernetes discovery takes the options {', '.join(_OPTIONS)} (got unknown {', '.join(unknown)})."
            )
        interval = options.get("interval")
        if interval is not None:
            _number("interval", interval)
        target = options.get("target")
        if not isinstance(target, str):
            raise ValueError(f"kubernetes discovery needs 'target' = 'NAMESPACE/SERVICE:PORT' (got {target!r}).")
        for name in ("kubeconfig", "context", "kind", "scheme"):
            value = options.get(name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"kubernetes discovery: '{name}' must be a non-empty string (got {value!r}).")
        scheme = options.get("scheme", "http")
        if scheme not in ("http", "https"):
            raise ValueError(f"kubernetes discovery: 'scheme' must be 'http' or 'https' (got {scheme!r}).")
        models = options.get("models", [])
        if not isinstance(models, list | tuple) or not all(isinstance(m, str) and m for m in models):
            raise ValueError(f"kubernetes discovery: 'models' must be a list of model names (got {models!r}).")
        seed = options.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"kubernetes discovery: 'seed' must be an integer (got {seed!r}).")
        jitter = options.get("jitter", 0.2)
        if isinstance(jitter, bool) or not isinstance(jitter, int | float):
            raise ValueError(f"kubernetes discovery: 'jitter' must be a number in [0, 1) (got {jitter!r}).")
        if not 0 <= jitter < 1:
            raise ValueError(f"'jitter' must be in [0, 1) (got {float(jitter)!r}).")
        initial = _number("backoff_initial", options.get("backoff_initial", 0.5))
        maximum = _number("backoff_max", options.get("backoff_max", 30))
        if maximum < initial:
            raise ValueError(f"'backoff_max' must be at least 'backoff_initial' (got {maximum} < {initial}).")
        return cls(
            target=KubernetesTarget.parse(target),
            kubeconfig=options.get("kubeconfig"),
            context=options.get("context"),
            defaults=Defaults(kind=options.get("kind", "openai"), models=frozenset(models), scheme=scheme),
            watch_timeout=_number("watch_timeout", options.get("watch_timeout", 300)),
            request_timeout=_number("request_timeout", options.get("request_timeout", 30)),
            backoff=Backoff(initial=initial, maximum=maximum, jitter=jitter, seed=seed),
        )

    @property
    def source(self) -> str:
        """``kubernetes:NAMESPACE/SERVICE:PORT``."""
        return f"kubernetes:{self.target}"

    async def api_client(self) -> ApiClient:
        """A client configured from ``kubeconfig``, else in-cluster, else the default kubeconfig."""
        configuration = Configuration()
        if self.kubeconfig is not None:
            path = await anyio.Path(self.kubeconfig).expanduser()
            if not await path.is_file():
                raise ConfigException(f"kubeconfig {self.kubeconfig!r} does not exist or is not a file")
            await kube_config.load_kube_config(
                config_file=self.kubeconfig,
                context=self.context,
                client_configuration=configuration,
                persist_config=False,
            )
        else:
            try:
                kube_config.load_incluster_config(client_configuration=configuration)
            except ConfigException as in_cluster:
                try:
                    await kube_config.load_kube_config(
                        context=self.context, client_configuration=configuration, persist_config=False
                    )
                except (ConfigException, OSError) as exc:
                    raise ConfigException(
                        f"no in-cluster service account ({in_cluster}) and no usable default kubeconfig ({exc})"
                    ) from exc
        # Decode what the server sends as it is: the generated models refuse None in fields their
        # OpenAPI spec marks required, and those markings have changed across releases (an empty
        # EndpointSlice's `endpoints` is null on the wire). The server is the authority here.
        configuration.client_side_validation = False
        return ApiClient(configuration)

    async def run(self, sink: DiscoverySink, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """List, watch, relist on 410, back off on failures; until cancelled."""
        await _Follower(self, sink, task_status).run()


@attrs.define
class _Follower:
    """One run's state: the slices seen, the resourceVersion to resume from, what was last published."""

    provider: KubernetesDiscovery
    sink: DiscoverySink
    task_status: Any
    state: SliceState = attrs.field(init=False)
    resource_version: str | None = None
    published: Snapshot | None = None
    stale: bool = False
    started: bool = False
    client: ApiClient | None = None

    def __attrs_post_init__(self) -> None:
        self.state = SliceState(self.provider.target, self.provider.defaults)

    @property
    def source(self) -> str:
        return self.provider.source

    async def run(self) -> None:
        keeper = KeepAlive(
            "kubernetes_discovery", self.provider.backoff, expected=(DiscoveryFailed,), source=self.source
        )
        try:
            await keeper.run(self._follow, keeper)
        finally:
            with anyio.CancelScope(shield=True):
                await self._drop_client()

    async def _follow(self, keeper: KeepAlive) -> None:
        """List (when there is no resourceVersion to resume from) and watch, over and over; raises `DiscoveryFailed`."""
        gone = 0  # consecutive 410s without an event in between
        phase = "configuring the Kubernetes client"
        try:
            while True:
                phase = "configuring the Kubernetes client"
                try:
                    if self.client is None:
                        self.client = await self.provider.api_client()
                    api = DiscoveryV1Api(self.client)
                    if self.resource_version is None:
                        phase = "list of EndpointSlices"
                        await self._list(api)
                        keeper.healthy()
                    phase = "watch of EndpointSlices"
                    events = await self._watch(api)
                except ApiException as exc:
                    if exc.status != 410:
                        raise
                    gone += 1
                    log.info("kubernetes_watch_gone", source=self.source, resource_version=self.resource_version)
                    self.resource_version = None
                    if gone > 1:
                        await keeper.back_off(gone - 1)
                    continue
                if events:
                    keeper.healthy()
                    gone = 0
                else:  # closed at once with nothing to say: do not spin
                    await keeper.back_off(max(keeper.failures, 1))
        except Exception as exc:
            if isinstance(exc, ApiException) and exc.status == 401:  # expired or rotated credentials: reload them
                await self._drop_client()
            reason = f"{phase} for {self.provider.target} failed: {_describe(exc)}"
            self.stale = True
            self.sink.failed(self.source, reason)
            self._started()
            raise DiscoveryFailed(reason) from exc

    async def _drop_client(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.close()

    def _started(self) -> None:
        if not self.started:
            self.started = True
            self.task_status.started()

    def _publish(self) -> None:
        snapshot = Snapshot(self.source, self.state.backends())
        if snapshot != self.published or self.stale:
            self.sink.publish(snapshot)
            log.info(
                "kubernetes_snapshot",
                source=self.source,
                backends=len(snapshot.backends),
                draining=sum(b.draining for b in snapshot.backends),
                resource_version=self.resource_version,
            )
            self.published = snapshot
            self.stale = False

    async def _list(self, api: DiscoveryV1Api) -> None:
        target = self.provider.target
        result = await api.list_namespaced_endpoint_slice(
            target.namespace, label_selector=target.label_selector, _request_timeout=self.provider.request_timeout
        )
        self.state.replace(result.items or ())
        self.resource_version = result.metadata.resource_version
        log.info(
            "kubernetes_listed",
            source=self.source,
            slices=len(self.state.slice_names),
            resource_version=self.resource_version,
        )
        self._publish()
        self._started()

    async def _watch(self, api: DiscoveryV1Api) -> int:
        """One watch connection, until the server ends it; returns how many events it delivered."""
        target = self.provider.target

        async def connect(**kwargs: Any) -> Any:
            # No docstring on purpose: Watch reads the return type from one; without it, events
            # carry plain dicts, decoded below with this provider's (lenient) client.
            response: Any = await api.list_namespaced_endpoint_slice(**kwargs)  # aiohttp's response, not decoded
            if not 200 <= response.status < 300:
                body = await response.text()
                response.release()
                raise ApiException(status=response.status, reason=_status_message(body))
            if self.stale:  # reachable again: the set we hold is current up to resource_version
                self._publish()
            return response

        count = 0
        watch = Watch()
        async with watch:
            stream = watch.stream(
                connect,
                namespace=target.namespace,
                label_selector=target.label_selector,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                # A server-side timeout also turns off Watch's own hidden reconnects and 410
                # retries: this loop decides those.
                timeout_seconds=max(1, round(self.provider.watch_timeout)),
                _request_timeout=(
                    self.provider.request_timeout,
                    self.provider.watch_timeout + self.provider.request_timeout,
                ),
            )
            async for event in stream:
                count += 1
                self._apply(event)
        return count

    def _apply(self, event: Any) -> None:
        if not isinstance(event, Mapping) or not isinstance(event.get("raw_object"), Mapping):
            raise ValueError(f"watch sent a line that is not a JSON event (got {str(event)[:200]!r}).")
        kind = event.get("type")
        raw = event["raw_object"]
        version = (raw.get("metadata") or {}).get("resourceVersion")
        if kind == "BOOKMARK":
            if version:
                self.resource_version = str(version)
            return
        assert self.client is not None
        wire: Any = SimpleNamespace(data=json.dumps(raw))  # what deserialize reads of a response: its body
        slice_ = self.client.deserialize(wire, "V1EndpointSlice")
        self.state.apply(str(kind), slice_)
        if version:
            self.resource_version = str(version)
        self._publish()


def _status_message(body: str) -> str:
    """A `Status` object's reason and message, else the start of the body."""
    try:
        status = json.loads(body)
    except ValueError:
        return body[:200]
    if isinstance(status, Mapping):
        return ": ".join(str(status[k]) for k in ("reason", "message") if status.get(k)) or body[:200]
    return body[:200]
