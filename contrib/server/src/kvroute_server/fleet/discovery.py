"""Discovery on the proxy's side: run the configured providers and turn their snapshots into fleet changes.

`Discovery` is the proxy's `kvroute.discovery.DiscoverySink`. It keeps, per source, the last
good snapshot, takes their union (the first configured source wins an id two sources name,
logged once), and diffs it against what discovery added before:

* a new id is added (`BackendSet.add`), drained at once when the provider says ``draining``;
* an id gone from every source is drained and removed once idle (requests in flight finish);
* a changed weight, models or labels is applied in place (`BackendSet.set_weight`,
  `set_models`, `set_labels`); a changed URL, kind or adapter options replaces the member
  (remove, then add: requests in flight on it keep counting, `Fleet.add` revives their state);
* ``draining`` turning on drains the member without removing it, turning off undrains it.

Changes are made through the same `BackendSet` methods as the admin API, so strategies see
ordinary fleet events. Only differences between two answers are applied, so an admin drain or
re-weight of a discovered backend stands until the provider's answer for it changes. Static
backends (``--backend``, ``[[backends]]``) are never touched: a discovered id that names one is
ignored (logged once).

Safety: a failure or an empty answer never empties the fleet. The source keeps its last good
snapshot and is marked stale (``kvroute_discovery_stale``, ``/health``'s ``discovery`` list, the
``discovery_failed`` / ``discovery_stale`` log events). An update that would remove more than
``max_removal_share`` of the discovered backends at once is applied one removal per
``removal_interval`` (``on_mass_removal = "gradual"``) or held while the answer says so
(``"hold"``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import attrs
import structlog
from anyio.abc import TaskStatus

from kvroute.discovery import DiscoveredBackend, DiscoveryProvider, DiscoverySink, Snapshot
from kvroute.errors import ConfigError
from kvroute.loops import Backoff, KeepAlive
from kvroute.plugins import PluginManager
from kvroute_server.config import BackendConfig, DiscoveryConfig, DiscoveryPolicy
from kvroute_server.fleet.backends import BackendSet
from kvroute_server.ops.metrics import ProxyMetrics

__all__ = ["Discovery", "NoDiscovery", "SourceStatus", "build_providers", "run_provider"]

log = structlog.get_logger(__name__)

#: How long the proxy's start waits for each source's first answer (seconds); a source still silent
#: then is reported failed and the proxy serves without it until it answers.
FIRST_ANSWER_TIMEOUT = 30.0
#: A provider that crashes or returns (a bug: providers must not) is run again after 1 s, doubling on
#: each stop in a row up to 30 s; one that ran 30 s before it stopped was not crash-looping: 1 s again.
_RESTART = Backoff(initial=1.0, maximum=30.0, jitter=0.2, healthy_after=30.0)
#: How long past a due time (a source going stale, the next gradual removal) `Discovery.run` looks (seconds).
_MARGIN = 0.001


class ProviderStopped(Exception):
    """A provider's ``run`` returned: it must run until cancelled."""


def build_providers(configs: Sequence[DiscoveryConfig], plugins: PluginManager) -> list[DiscoveryProvider]:
    """One provider per configured source, built by its kind's factory; raises `ConfigError`."""
    providers: list[DiscoveryProvider] = []
    kinds = plugins.discovery_kinds if configs else {}
    for config in configs:
        registration = kinds.get(config.kind)
        if registration is None:
            installed = ", ".join(sorted(kinds)) or "none"
            raise ConfigError(f"discovery kind {config.kind!r} is not installed (installed kinds: {installed}).")
        try:
            provider = registration.factory(**dict(config.options))
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"discovery {config.kind!r} rejected its options {dict(config.options)!r}: {exc}"
            ) from None
        if not isinstance(provider, DiscoveryProvider):
            raise ConfigError(
                f"discovery kind {config.kind!r} ({registration.plugin.describe()}) returned "
                f"{type(provider).__name__}, not a DiscoveryProvider (a 'source' and an async 'run')."
            )
        if any(p.source == provider.source for p in providers):
            raise ConfigError(f"discovery source {provider.source!r} is configured twice.")
        providers.append(provider)
    return providers


@attrs.define
class SourceStatus:
    """What the proxy knows about one source's answers (``/health``'s ``discovery`` list)."""

    source: str
    #: The last lookup failed or was empty (the last good set is kept).
    failing: bool = False
    #: Monotonic and wall-clock time of the last good answer.
    last_success: float | None = None
    last_success_unix: float | None = None
    last_error: str | None = None
    #: Backends in the last good answer.
    backends: int = 0
    #: Reported stale because no good answer came for ``stale_after`` seconds.
    aged: bool = False

    def stale(self, now: float, stale_after: float) -> bool:
        return self.failing or (self.last_success is not None and now - self.last_success > stale_after)

    def succeeded(self, backends: int) -> None:
        """A good answer naming ``backends`` backends came now."""
        self.failing = self.aged = False
        self.last_error = None
        self.last_success = time.monotonic()
        self.last_success_unix = time.time()
        self.backends = backends

    def fail(self, reason: str) -> bool:
        """The source failed for ``reason``; False when it was already failing for the same reason."""
        repeated = self.failing and self.last_error == reason
        self.failing = True
        self.last_error = reason
        return not repeated


@attrs.define
class _Owned:
    """A member discovery added: which source gave it and what it said last."""

    source: str
    seen: DiscoveredBackend


class _Started:
    """A provider's task status: sets ``event`` on its first ``started()`` and ignores later ones."""

    def __init__(self) -> None:
        self.event = anyio.Event()

    def started(self, value: object = None) -> None:
        self.event.set()


async def run_provider(provider: DiscoveryProvider, sink: DiscoverySink, started: _Started | None = None) -> None:
    """Run one provider until cancelled, reporting to ``sink``; one that raises or returns (a bug) is reported
    failed and restarted after a delay. ``started`` is set at its first answer (or its first failure)."""
    keeper = KeepAlive("discovery_provider", _RESTART, expected=(ProviderStopped,), source=provider.source)
    await keeper.run(_provider_once, provider, sink, started or _Started())


async def _provider_once(provider: DiscoveryProvider, sink: DiscoverySink, started: _Started) -> None:
    try:
        await provider.run(sink, task_status=started)
    except Exception as exc:
        sink.failed(provider.source, f"the provider crashed: {type(exc).__name__}: {exc}")
        started.started()
        raise
    sink.failed(provider.source, "the provider stopped")
    started.started()
    raise ProviderStopped("the provider stopped")


def _config_of(found: DiscoveredBackend, api_key: str | None) -> BackendConfig:
    return BackendConfig(
        id=found.id,
        url=found.url,
        kind=found.kind,
        weight=found.weight,
        models=tuple(sorted(found.models)),
        labels=dict(found.labels),
        api_key=api_key,
        adapter_options=dict(found.options),
    )


def _desired(
    order: Sequence[str], snapshots: Mapping[str, Sequence[DiscoveredBackend]]
) -> tuple[dict[str, tuple[str, DiscoveredBackend]], list[tuple[str, str, str]]]:
    """Each id's first source in ``order`` and what it said, and every later claim as (id, source, kept source)."""
    desired: dict[str, tuple[str, DiscoveredBackend]] = {}
    conflicts: list[tuple[str, str, str]] = []
    for source in order:
        for found in snapshots.get(source, ()):
            first = desired.get(found.id)
            if first is None:
                desired[found.id] = (source, found)
            else:
                conflicts.append((found.id, source, first[0]))
    return desired, conflicts


def _identity(found: DiscoveredBackend) -> tuple[object, ...]:
    """What cannot change in place (the adapter is built from it): a difference here replaces the member."""
    return (found.url, found.kind, dict(found.options))


class Discovery:
    """The proxy's discovery sink and reconciler (see the module docstring); run `run` in the proxy's task group."""

    def __init__(
        self,
        backends: BackendSet,
        metrics: ProxyMetrics,
        policy: DiscoveryPolicy,
        providers: Sequence[DiscoveryProvider],
        *,
        api_keys: Mapping[str, str | None] | None = None,
    ) -> None:
        self.backends = backends
        self.metrics = metrics
        self.policy = policy
        self.providers = list(providers)
        self._api_keys = dict(api_keys or {})
        self._order = [p.source for p in self.providers]
        self.status = {source: SourceStatus(source) for source in self._order}
        self._snapshots: dict[str, tuple[DiscoveredBackend, ...]] = {}
        self._owned: dict[str, _Owned] = {}
        #: Owned ids draining towards their removal.
        self._leaving: set[str] = set()
        #: Ids of a mass removal waiting their turn (gradual), and when the next may go.
        self._queue: list[str] = []
        self._next_removal = 0.0
        #: Conflicts, rejections and held removals already logged (logged once each).
        self._noted: set[tuple[object, ...]] = set()
        #: Set by whatever changes what `_tick` looks at (an answer, a failure, a removal queued), so that
        #: `run` looks again at once instead of polling; made in `run` (an event needs the event loop).
        self._changed: anyio.Event | None = None

    @classmethod
    def create(
        cls,
        configs: Sequence[DiscoveryConfig],
        policy: DiscoveryPolicy,
        backends: BackendSet,
        metrics: ProxyMetrics,
        plugins: PluginManager,
    ) -> Discovery | NoDiscovery:
        """The reconciler for the configured sources, `NoDiscovery` without any; raises `ConfigError`."""
        providers = build_providers(configs, plugins)
        if not providers:
            return NoDiscovery()
        keys = {p.source: c.api_key for p, c in zip(providers, configs, strict=True)}
        return cls(backends, metrics, policy, providers, api_keys=keys)

    # -- reading ----------------------------------------------------------------------

    def owned(self, source: str | None = None) -> list[str]:
        """Ids of the members discovery added (from ``source`` only, when given), sorted."""
        return sorted(i for i, o in self._owned.items() if source is None or o.source == source)

    def describe(self) -> list[dict[str, Any]]:
        """Each source's state, as ``/health`` shows it."""
        now = time.monotonic()
        return [
            {
                "source": st.source,
                "stale": st.stale(now, self.policy.stale_after),
                "last_success_age_s": None if st.last_success is None else round(now - st.last_success, 3),
                "backends": st.backends,
                "last_error": st.last_error,
            }
            for st in self.status.values()
        ]

    # -- running ----------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every provider, and keep staleness and gradual removals up to date, until cancelled.

        Reports started once each provider gave its first answer (or failed), or after
        `FIRST_ANSWER_TIMEOUT`. The providers start together rather than one ``tg.start`` after
        another, so that the start waits for the slowest source, not their sum, and a provider
        that never reports started (a bug) cannot keep the proxy from serving.
        """
        async with anyio.create_task_group() as tg:
            starts = {provider.source: _Started() for provider in self.providers}
            for provider in self.providers:
                tg.start_soon(
                    run_provider, provider, self, starts[provider.source], name=f"discovery {provider.source}"
                )
            with anyio.move_on_after(FIRST_ANSWER_TIMEOUT):
                for started in starts.values():
                    await started.event.wait()
            for source, started in starts.items():
                if not started.event.is_set():
                    self.failed(source, f"no first answer within {FIRST_ANSWER_TIMEOUT:g} s of the start")
            task_status.started()
            while True:
                self._changed = anyio.Event()  # before the look: a change made during it is not missed
                due = self._tick()
                # Just past the moment: a source is stale only once its answer is strictly older than stale_after.
                with anyio.move_on_after(due + _MARGIN):
                    await self._changed.wait()

    def _changes(self) -> None:
        """Something `_tick` looks at changed: `run` looks again now."""
        if self._changed is not None:
            self._changed.set()

    def _tick(self) -> float:
        """Mark sources stale whose answer aged, make a gradual removal that is due; returns seconds until the
        next such moment (``inf``: none is coming without a change)."""
        now = time.monotonic()
        due = math.inf
        for st in self.status.values():
            stale = st.stale(now, self.policy.stale_after)
            self.metrics.child(self.metrics.discovery_stale, st.source).set(1 if stale else 0)
            if stale and not st.failing and not st.aged:
                st.aged = True
                age = now - (st.last_success or now)
                log.warning("discovery_stale", source=st.source, reason=f"no good answer for {age:.1f} s")
            elif not stale and st.last_success is not None:
                due = min(due, st.last_success + self.policy.stale_after - now)
        if self._queue and now >= self._next_removal:
            self._retire(self._queue.pop(0))
            self._next_removal = now + self.policy.removal_interval
        if self._queue:
            due = min(due, self._next_removal - now)
        return max(due, 0.0)

    # -- the sink ---------------------------------------------------------------------

    def _status(self, source: str) -> SourceStatus:
        status = self.status.get(source)
        if status is None:  # a provider publishing under another name than its ``source``
            status = self.status[source] = SourceStatus(source)
            self._order.append(source)
        return status

    def publish(self, snapshot: Snapshot) -> None:
        """A provider's whole answer; empty answers keep the last good set (stale)."""
        source = snapshot.source
        status = self._status(source)
        if not snapshot.backends:
            self._mark_failing(status, "the answer names no backends; the last good set is kept", "discovery_stale")
            return
        if status.failing or status.aged:
            log.info("discovery_recovered", source=source, backends=len(snapshot.backends))
        status.succeeded(len(snapshot.backends))
        self.metrics.child(self.metrics.discovery_stale, source).set(0)
        self.metrics.child(self.metrics.discovery_last_success, source).set(status.last_success_unix or 0.0)
        self._snapshots[source] = snapshot.backends
        self.reconcile()
        self._changes()

    def failed(self, source: str, reason: str) -> None:
        """A provider could not look: keep its last good set, mark it stale."""
        self._mark_failing(self._status(source), reason, "discovery_failed")

    def _mark_failing(self, status: SourceStatus, reason: str, event: str) -> None:
        new = status.fail(reason)
        self.metrics.child(self.metrics.discovery_stale, status.source).set(1)
        if new:  # the same failure every interval is logged once
            kept = len(self._snapshots.get(status.source, ()))
            log.warning(event, source=status.source, reason=reason, kept_backends=kept)
        self._changes()

    # -- reconciling ------------------------------------------------------------------

    def reconcile(self) -> None:
        """Bring the backend set in line with the union of the sources' last good answers."""
        for backend_id in [i for i in self._owned if i not in self.backends]:
            # Removed once idle, or by the admin API: forget it (a later answer may add it again).
            del self._owned[backend_id]
            self._leaving.discard(backend_id)
            if backend_id in self._queue:
                self._queue.remove(backend_id)
        # The discovered fleet before this answer, against which a mass removal is measured.
        before = sum(1 for i in self._owned if i not in self._leaving and i not in self._queue)
        desired, conflicts = _desired(self._order, self._snapshots)
        for backend_id, source, kept in conflicts:
            self._note("discovery_conflict", backend=backend_id, source=source, kept_source=kept)
        for backend_id, (source, found) in desired.items():
            owned = self._owned.get(backend_id)
            if owned is not None:
                self._update(owned, source, found)
            elif backend_id in self.backends:
                self._note("discovery_conflict", backend=backend_id, source=source, kept_source="static")
            else:
                self._add(source, found)
        gone = sorted(i for i in self._owned if i not in desired and i not in self._leaving and i not in self._queue)
        if gone:
            self._remove(gone, before)
        else:  # nothing held any more: a later mass removal is logged again
            self._noted = {k for k in self._noted if k[0] != "discovery_mass_removal_held"}

    def _note(self, event: str, **context: Any) -> None:
        key = (event, *sorted(context.items()))
        if key not in self._noted:
            self._noted.add(key)
            log.warning(event, **context)

    def _count(self, source: str, change: str) -> None:
        self.metrics.child(self.metrics.discovery_changes, source, change).inc()

    def _record(self, source: str, change: str, event: str, **context: Any) -> None:
        """A change discovery made to the fleet: counted by source and kind, and logged."""
        self._count(source, change)
        log.info(event, source=source, **context)

    def _add(self, source: str, found: DiscoveredBackend) -> None:
        try:
            self.backends.add(_config_of(found, self._api_keys.get(source)))
        except ConfigError as exc:
            self._note("discovery_backend_rejected", backend=found.id, source=source, error=str(exc))
            return
        self._owned[found.id] = _Owned(source, found)
        self._count(source, "added")
        log.info(
            "backend_discovered",
            source=source,
            backend=found.id,
            url=found.url,
            kind=found.kind,
            weight=found.weight,
            models=sorted(found.models),
        )
        if found.draining:
            self.backends.drain(found.id)
            self._record(source, "draining", "backend_draining", backend=found.id)

    def _update(self, owned: _Owned, source: str, found: DiscoveredBackend) -> None:
        before, backend_id = owned.seen, found.id
        returning = backend_id in self._leaving or backend_id in self._queue
        if backend_id in self._queue:
            self._queue.remove(backend_id)
        self._leaving.discard(backend_id)
        owned.source = source
        if returning:
            self._record(source, "returned", "backend_returned", backend=backend_id)
        if _identity(before) != _identity(found):
            self.backends.remove(backend_id)  # requests in flight finish; their count carries over to the new member
            del self._owned[backend_id]
            self._record(source, "replaced", "backend_replaced", backend=backend_id, url=found.url, kind=found.kind)
            self._add(source, found)
            return
        owned.seen = found
        if before.weight != found.weight:
            self.backends.set_weight(backend_id, found.weight)
            self._record(source, "weight", "backend_reweighted", backend=backend_id, weight=found.weight)
        if before.models != found.models:
            self.backends.set_models(backend_id, found.models)
            self._record(source, "models", "backend_models_changed", backend=backend_id, models=sorted(found.models))
        if dict(before.labels) != dict(found.labels):
            self.backends.set_labels(backend_id, found.labels)
            self._record(source, "labels", "backend_labels_changed", backend=backend_id)
        if returning or before.draining != found.draining:
            self.backends.drain(backend_id, draining=found.draining)
            change, event = ("draining", "backend_draining") if found.draining else ("undrained", "backend_undrained")
            self._record(source, change, event, backend=backend_id)

    def _remove(self, gone: list[str], before: int) -> None:
        share = len(gone) / max(before, 1)
        if share <= self.policy.max_removal_share:
            for backend_id in gone:
                self._retire(backend_id)
            return
        sources = sorted({self._owned[i].source for i in gone})
        facts = {
            "sources": sources,
            "backends": gone,
            "share": round(share, 3),
            "max_removal_share": self.policy.max_removal_share,
        }
        if self.policy.on_mass_removal == "hold":
            key = ("discovery_mass_removal_held", tuple(gone))
            if key not in self._noted:
                self._noted.add(key)
                for source in sources:
                    self._count(source, "held")
                log.warning("discovery_mass_removal_held", **facts)
            return
        log.warning("discovery_mass_removal_gradual", **facts, removal_interval_s=self.policy.removal_interval)
        self._queue.extend(gone)
        self._tick()  # the first one goes now, unless a removal just went
        self._changes()  # the next when its turn comes

    def _retire(self, backend_id: str) -> None:
        """Drain a member gone from every source and remove it once idle."""
        owned = self._owned.get(backend_id)
        if owned is None or backend_id not in self.backends:
            return
        self._leaving.add(backend_id)
        self.backends.drain(backend_id, remove_when_idle=True)
        self._record(owned.source, "removed", "backend_gone", backend=backend_id)


class NoDiscovery:
    """No discovery source configured: the fleet is what flags, the file and the admin API make it."""

    status: Mapping[str, SourceStatus] = {}

    def owned(self, source: str | None = None) -> list[str]:
        """No member was added by discovery."""
        return []

    def describe(self) -> list[dict[str, Any]]:
        """No source to describe."""
        return []

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Report started at once: there is no source to wait for."""
        task_status.started()
