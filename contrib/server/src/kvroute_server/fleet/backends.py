"""The backend set: which backends the proxy has, how to reach them, and their adapters' lifetimes.

`BackendSet` is the one place that changes membership: at start from the configuration, then through
the admin API and discovery (`kvroute_server.fleet.discovery`), which call the same methods. Each backend
has a `BackendConfig` (URL, credentials), an adapter built by its kind's factory, and a state in the
`Fleet` (health, draining, in flight, load, and the models its engine reports serving, which
`HealthChecker` discovers and `Fleet.set_served_models` stores).

While the proxy runs, the set owns the upstream HTTP session and a task group holding the health
checker, drains that end in a removal, and one task per backend whose adapter has work of its own:
the KV event feed (`kvroute.adapters.StreamsEvents`, when the strategy offers a sink) and, when the
backend leaves or the proxy stops, ``await adapter.aclose()`` (`kvroute.adapters.Closes`).
Capabilities are declared protocols, checked with ``isinstance``.

A backend is drained in the fleet while either the operator (admin API, discovery) drained it or
the proxy holds it for its own work (`hold`: a warm join's pre-fill, `kvroute_server.fleet.warm_join`);
the two are kept apart, so that ending a hold (`end_hold`) never undoes an operator's drain. Whoever
needs to know when members join or leave subscribes with `watch`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping

import aiohttp
import anyio
import attrs
import structlog
from anyio.abc import TaskGroup

from kvroute.adapters import BackendAdapter, Closes, KvEventSink, StreamsEvents
from kvroute.backend import Backend
from kvroute.errors import ConfigError, UnknownBackend
from kvroute.fleet import Fleet
from kvroute.plugins import PluginManager
from kvroute.strategy import HasPromptTokenizer
from kvroute_server.config import BackendConfig, HealthConfig
from kvroute_server.fleet.adapter_http import BackendHttp, create_session
from kvroute_server.fleet.health import HealthChecker
from kvroute_server.ops.metrics import ProxyMetrics

__all__ = ["BackendSet"]

log = structlog.get_logger(__name__)

#: Timeout of one HTTP call made by an adapter's event feed or the parity check (seconds).
EVENTS_HTTP_TIMEOUT = 10.0
#: The adapter option (any kind) declaring a backend's data-parallel ranks; the set reads it, the adapter never sees it.
RANKS_OPTION = "data_parallel_size"
#: How long an adapter's ``aclose`` may take before the proxy stops waiting for it (seconds).
CLOSE_TIMEOUT = 5.0


@attrs.define(eq=False)
class _Member:
    """One backend's configuration and adapter, and whether it left (which ends its adapter task)."""

    config: BackendConfig
    adapter: BackendAdapter
    left: bool = False
    #: Drained by the operator (`BackendSet.drain`), and held by the proxy (`BackendSet.hold`).
    drained: bool = False
    held: bool = False
    #: The adapter task's scope while it runs (created on the event loop, not at registration).
    scope: anyio.CancelScope | None = None
    #: Set when the member is undrained, leaves or goes idle, for a drain waiting to remove it (made by that wait).
    changed: anyio.Event | None = None

    def leave(self) -> None:
        """Mark the member gone and end its adapter task, whether it runs yet or not."""
        self.left = True
        if self.scope is not None:
            self.scope.cancel()
        self.wake()

    def wake(self) -> None:
        """Wake a drain waiting to remove this member: look again."""
        if self.changed is not None:
            self.changed.set()

    @property
    def has_work(self) -> bool:
        """Whether the adapter needs a task of its own (an event feed, or resources to close)."""
        return isinstance(self.adapter, StreamsEvents | Closes)


class BackendSet:
    """The proxy's backends: membership, configuration, adapters, health and the adapters' tasks.

    Change it (`add`, `remove`, `drain`) from a task on the proxy's event loop, as the admin API does.
    """

    def __init__(
        self,
        fleet: Fleet,
        plugins: PluginManager,
        health: HealthConfig,
        metrics: ProxyMetrics,
        *,
        connect_timeout: float,
        backends: Iterable[BackendConfig] = (),
    ) -> None:
        self.fleet = fleet
        self.plugins = plugins
        self.health_config = health
        self.connect_timeout = connect_timeout
        self._members: dict[str, _Member] = {}
        self.health = HealthChecker(fleet, self.adapter, self.http_for, health, metrics)
        self._session: aiohttp.ClientSession | None = None
        self._sink: KvEventSink | None = None
        self._task_group: TaskGroup | None = None
        self._watchers: list[Callable[[str, bool], None]] = []
        for config in backends:
            self._register(config)

    # -- reading ----------------------------------------------------------------------

    def __contains__(self, backend_id: object) -> bool:
        return backend_id in self._members

    def config(self, backend_id: str) -> BackendConfig | None:
        """The configuration of a member, ``None`` for an unknown id."""
        member = self._members.get(backend_id)
        return member.config if member is not None else None

    def adapter(self, backend_id: str) -> BackendAdapter | None:
        """The adapter of a member, ``None`` for an unknown id."""
        member = self._members.get(backend_id)
        return member.adapter if member is not None else None

    def all_models(self) -> list[str]:
        """Every model some member serves (reported, else declared), sorted."""
        return sorted(self.fleet.models())

    def serves_anywhere(self, model: str) -> bool:
        """Whether the set is empty or some member may be asked for ``model`` (else the model is unknown)."""
        members = list(self.fleet)
        return not members or any(state.serves(model) for state in members)

    @property
    def session(self) -> aiohttp.ClientSession:
        """The upstream session (keep-alive pools to every backend) while the proxy runs."""
        assert self._session is not None, "the proxy is not running (no upstream session)"
        return self._session

    def http_for(self, backend_id: str, timeout: float | None = None) -> BackendHttp:
        """The adapters' HTTP client for one member: its URL and credentials, ``timeout`` per call."""
        config = self._members[backend_id].config
        headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        return BackendHttp(self.session, config.url, timeout or self.health_config.timeout, headers)

    # -- changing ---------------------------------------------------------------------

    def _register(self, config: BackendConfig) -> tuple[Backend, _Member]:
        options = dict(config.adapter_options)
        backend = _with_ranks(config.to_backend(), options.pop(RANKS_OPTION, None))
        registration = self.plugins.backend_kinds.get(config.kind)
        if registration is None:
            known = ", ".join(sorted(self.plugins.backend_kinds)) or "none"
            raise ConfigError(f"backend {config.id!r}: unknown kind {config.kind!r} (installed kinds: {known}).")
        try:
            adapter = registration.factory(backend, **options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"backend {config.id!r}: adapter for kind {config.kind!r} rejected its options: {exc}"
            ) from None
        self.fleet.add(backend)
        member = self._members[config.id] = _Member(config, adapter)
        return backend, member

    def watch(self, callback: Callable[[str, bool], None]) -> Callable[[], None]:
        """Call ``callback(backend_id, joined)`` after each `add` (True) and `remove` (False); returns an unwatch.

        Members given at construction are not reported. The callback runs synchronously inside the
        change, so it sees the new member before any request can be routed to it.
        """
        self._watchers.append(callback)
        return lambda: self._watchers.remove(callback) if callback in self._watchers else None

    def _tell(self, backend_id: str, joined: bool) -> None:
        for callback in list(self._watchers):
            callback(backend_id, joined)

    def add(self, config: BackendConfig) -> Backend:
        """Add a backend; probed at once when health checks are on, its adapter's task started."""
        backend, member = self._register(config)
        self.health.wake()
        self._start(config.id, member)
        self._tell(config.id, True)
        return backend

    def remove(self, backend_id: str) -> None:
        """Remove a backend now; requests already on it finish, its adapter task ends and closes it."""
        self.fleet.remove(backend_id)
        member = self._members.pop(backend_id, None)
        if member is not None:
            member.leave()
        self.health.forget(backend_id)
        self._tell(backend_id, False)

    def set_weight(self, backend_id: str, weight: float) -> None:
        """Change a member's weight in the fleet (strategies see a ``weight`` event) and in its configuration."""
        self.fleet.set_weight(backend_id, weight)
        member = self._members[backend_id]
        member.config = attrs.evolve(member.config, weight=float(weight))

    def set_models(self, backend_id: str, models: Iterable[str]) -> None:
        """Change a member's declared models in the fleet (a ``models`` event) and in its configuration."""
        declared = tuple(sorted(models))
        self.fleet.set_models(backend_id, declared)
        member = self._members[backend_id]
        member.config = attrs.evolve(member.config, models=declared)

    def set_labels(self, backend_id: str, labels: Mapping[str, str]) -> None:
        """Change a member's labels in the fleet (a ``labels`` event) and in its configuration."""
        self.fleet.set_labels(backend_id, dict(labels))
        member = self._members[backend_id]
        member.config = attrs.evolve(member.config, labels=dict(labels))

    def drain(self, backend_id: str, *, draining: bool = True, remove_when_idle: bool = False) -> None:
        """Stop (or resume) new requests to a backend; with ``remove_when_idle``, remove it once idle.

        Resuming a backend the proxy holds (`hold`) takes effect when the hold ends (`end_hold`).
        """
        member = self._members.get(backend_id)
        self.fleet.drain(backend_id, draining or (member is not None and member.held))
        if member is not None:
            member.drained = draining
            member.wake()
        if remove_when_idle and draining and self._task_group is not None:
            self._task_group.start_soon(self._remove_when_idle, backend_id)

    def hold(self, backend_id: str) -> None:
        """Keep new requests off a member for the proxy's own work, whatever the operator's drain says."""
        self._members[backend_id].held = True
        self.fleet.drain(backend_id, True)

    def end_hold(self, backend_id: str) -> None:
        """End a `hold`: the member takes requests again unless the operator drained it meanwhile."""
        member = self._members.get(backend_id)
        if member is None or not member.held:
            return
        member.held = False
        self.fleet.drain(backend_id, member.drained)

    async def _remove_when_idle(self, backend_id: str) -> None:
        while True:
            try:
                state = self.fleet.get(backend_id)
            except UnknownBackend:
                return
            member = self._members.get(backend_id)
            if member is None or not member.drained:  # undrained by the operator, or already replaced
                return
            if state.in_flight == 0:
                self.remove(backend_id)
                log.info("backend_drained_and_removed", backend=backend_id)
                return
            # Woken by whoever changes what was just read: the fleet when the last request finishes (the proxy
            # finishes requests on this event loop's thread), `drain` and `remove` for the member.
            if member.changed is None or member.changed.is_set():
                member.changed = anyio.Event()
            stop_waiting = self.fleet.when_idle(backend_id, member.changed.set)
            try:
                await member.changed.wait()
            finally:
                stop_waiting()

    # -- running ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self, sink: KvEventSink | None) -> AsyncIterator[BackendSet]:
        """Open the upstream session, start health checks and the adapters' tasks; stop and close them on exit.

        ``sink`` is the strategy's KV event sink (`kvroute.adapters.kv_event_sink`): adapters'
        event feeds run only when there is one.
        """
        self._session = create_session(self.connect_timeout)
        self._sink = sink
        try:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                if self.health_config.enabled:
                    await tg.start(self.health.run)
                for backend_id, member in list(self._members.items()):
                    self._start(backend_id, member)
                try:
                    yield self
                finally:
                    tg.cancel_scope.cancel()  # the adapters' tasks close their adapters (shielded)
        finally:
            self._task_group = None
            self._sink = None
            session, self._session = self._session, None
            await session.close()

    def _start(self, backend_id: str, member: _Member) -> None:
        if self._task_group is not None and member.has_work:
            self._task_group.start_soon(self._tend, backend_id, member, name=f"adapter {backend_id}")

    async def _tend(self, backend_id: str, member: _Member) -> None:
        """A member's adapter work: its KV event feed until it leaves, then ``aclose``."""
        adapter = member.adapter
        try:
            with anyio.CancelScope() as member.scope:
                if member.left:
                    return  # removed before this task started
                if self._sink is not None and isinstance(adapter, StreamsEvents):
                    http = self.http_for(backend_id, max(self.health_config.timeout, EVENTS_HTTP_TIMEOUT))
                    try:
                        await adapter.run_events(http, self._sink)
                    except Exception as exc:  # an adapter bug must not take the proxy down
                        log.error("kv_events_failed", backend=backend_id, error=f"{type(exc).__name__}: {exc}")
                await anyio.sleep_forever()
        finally:
            if isinstance(adapter, Closes):
                await _close(backend_id, adapter)

    async def check_parity(self, strategy: HasPromptTokenizer) -> None:
        """After the first health round, compare the strategy's tokenizer with each routable backend's."""
        from kvroute_server.parity import startup_check

        if self.health_config.enabled:
            await self.health.first_round.wait()
        targets = [
            (state.id, member.config.url, self.http_for(state.id, EVENTS_HTTP_TIMEOUT))
            for state in self.fleet
            if state.routable and (member := self._members.get(state.id)) is not None
        ]
        try:
            await startup_check(strategy, targets)
        except Exception as exc:
            log.error("tokenizer_parity_failed", error=f"{type(exc).__name__}: {exc}")


def _with_ranks(backend: Backend, size: object) -> Backend:
    """``backend`` with the data-parallel size its ``adapter_options`` declare (any kind; `RANKS_OPTION`)."""
    if size is None:
        return backend
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 1 << 16:
        raise ConfigError(
            f"backend {backend.id!r}: adapter option {RANKS_OPTION!r} must be an integer from 1 to 65536 "
            f"(got {size!r})."
        )
    return attrs.evolve(backend, data_parallel_size=size)


async def _close(backend_id: str, adapter: Closes) -> None:
    """``await adapter.aclose()``, shielded from cancellation and bounded by `CLOSE_TIMEOUT`."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT) as bounded:
        try:
            await adapter.aclose()
        except Exception as exc:
            log.warning("adapter_close_failed", backend=backend_id, error=f"{type(exc).__name__}: {exc}")
    if bounded.cancelled_caught:
        log.warning("adapter_close_timed_out", backend=backend_id, timeout_s=CLOSE_TIMEOUT)
