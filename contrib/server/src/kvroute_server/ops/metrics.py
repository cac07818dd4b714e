"""The proxy's Prometheus metrics (prometheus-client), one registry per app.

Per-request costs are kept to a few label lookups on cached children. In one process, gauges
that mirror fleet state (in flight, healthy, draining) are read from the fleet at scrape time.

With ``kvroute serve --workers N`` (``shared=True``) every worker writes its values to
prometheus-client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, set by the supervisor
before the worker starts) and any worker's ``/metrics`` merges all of them: counters and
histograms are summed over every worker that ever ran, in-flight gauges are summed over the
live workers, ``kvroute_backend_healthy`` is the minimum and ``kvroute_backend_draining`` the
maximum over them. The fleet gauges are then kept up to date as things change (the request
path moves the in-flight gauges) instead of being read at scrape time.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from kvroute.errors import ConfigError
from kvroute.fleet import Fleet, FleetEvent
from kvroute.sessions import Sessions
from kvroute.shadow import Verdict
from kvroute.strategy import Decision

__all__ = [
    "CONTENT_TYPE",
    "MULTIPROC_ENV",
    "OPENMETRICS",
    "ProxyMetrics",
    "RequestOutcome",
    "ShadowMetrics",
    "SloMetrics",
    "render_merged",
]

#: The environment variable prometheus-client reads, once, when it is imported.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
#: The OpenMetrics exposition's type: the one that carries exemplars (the histograms' trace ids, docs/tracing.md).
OPENMETRICS = openmetrics.CONTENT_TYPE_LATEST.encode()

_DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RequestOutcome(StrEnum):
    """How a client request ended: the ``outcome`` label of ``kvroute_requests_total`` and of the access log."""

    #: The backend answered below 400 (a stream that ended normally).
    OK = "ok"
    #: The backend answered 4xx.
    CLIENT_ERROR = "client_error"
    #: Every attempt failed and the last backend's 5xx was passed on.
    UPSTREAM_ERROR = "upstream_error"
    #: Every attempt failed without an answer (connection errors): the proxy answered 502.
    FAILED = "failed"
    #: The stream failed after it started: the client got an error event.
    STREAM_ERROR = "stream_error"
    #: The backend sent nothing within the first-byte timeout: the proxy answered 504.
    TIMEOUT = "timeout"
    #: The client left before the answer was complete.
    CANCELLED = "cancelled"
    #: No backend could take the request: the proxy answered 503.
    NO_BACKEND = "no_backend"
    #: The proxy refused the request itself (bad input, unknown model, too large).
    REJECTED = "rejected"
    #: A bug in the proxy: answered 500, or the response was cut off.
    INTERNAL_ERROR = "internal_error"


class _FleetCollector(Collector):
    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily("kvroute_in_flight", "Requests in flight per backend.", labels=["backend"])
        healthy = GaugeMetricFamily(
            "kvroute_backend_healthy", "1 when the backend passes health checks.", labels=["backend"]
        )
        draining = GaugeMetricFamily("kvroute_backend_draining", "1 while the backend is draining.", labels=["backend"])
        for state in self._fleet:
            in_flight.add_metric([state.id], state.in_flight)
            healthy.add_metric([state.id], 1.0 if state.healthy else 0.0)
            draining.add_metric([state.id], 1.0 if state.draining else 0.0)
        yield in_flight
        yield healthy
        yield draining


class ProxyMetrics:
    """Every metric the proxy exports (names documented in docs/serve.md).

    ``worker`` (the worker's index, with ``shared=True``) labels the per-worker series of a
    multi-worker server.
    """

    def __init__(self, fleet: Fleet, strategy: str, *, shared: bool = False, worker: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.strategy = strategy
        self.shared = shared
        self.worker = worker
        r = self.registry
        self.requests = Counter(
            "kvroute_requests",
            "Proxied requests by backend, strategy and outcome.",
            ["backend", "strategy", "outcome"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvroute_routing_decision_seconds",
            "Time the strategy took to pick a backend.",
            ["strategy"],
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.spills = Counter(
            "kvroute_spills",
            "Requests sent away from their home backend, by reason.",
            ["strategy", "reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvroute_upstream_ttft_seconds",
            "From sending a streamed request upstream to its first body chunk.",
            ["backend"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "kvroute_request_duration_seconds",
            "Whole request duration as the proxy saw it.",
            ["backend"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "kvroute_retries",
            "Attempts retried on another backend, by the failed backend and reason.",
            ["backend", "reason"],
            registry=r,
        )
        self.ejections = Counter(
            "kvroute_ejections", "Backends ejected, by cause (probe or passive).", ["backend", "cause"], registry=r
        )
        self.restorations = Counter(
            "kvroute_restorations", "Ejected backends restored by passing probes.", ["backend"], registry=r
        )
        self.prompt_tokens = Counter(
            "kvroute_prompt_tokens", "Prompt tokens reported by backends in usage.", ["backend"], registry=r
        )
        self.cached_tokens = Counter(
            "kvroute_prompt_tokens_cached",
            "Prompt tokens the backend served from its prefix cache (usage.prompt_tokens_details.cached_tokens).",
            ["backend"],
            registry=r,
        )
        self.rank_requests = Counter(
            "kvroute_rank_requests",
            "Attempts sent with X-data-parallel-rank, by backend and data-parallel rank.",
            ["backend", "rank"],
            registry=r,
        )
        self.dropped_headers = Counter(
            "kvroute_dropped_request_headers",
            "Client request headers the proxy owns and dropped (a client-sent X-data-parallel-rank), by header.",
            ["header"],
            registry=r,
        )
        self.rejected = Counter(
            "kvroute_rejected_requests",
            "Requests answered by the proxy itself with an error, by status.",
            ["status"],
            registry=r,
        )
        # Discovery (docs/serve.md#discovery); with several workers, gauges take the max over live workers.
        self.discovery_stale = Gauge(
            "kvroute_discovery_stale",
            "1 while a discovery source has no fresh good answer (the last good set is kept).",
            ["source"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.discovery_last_success = Gauge(
            "kvroute_discovery_last_success_timestamp_seconds",
            "Unix time of a discovery source's last good answer.",
            ["source"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.discovery_changes = Counter(
            "kvroute_discovery_changes",
            "Fleet changes made by discovery, by source and change.",
            ["source", "change"],
            registry=r,
        )
        # Sessions (docs/serve.md#sessions): bindings held per worker, summed over live workers.
        self.session_routes = Counter(
            "kvroute_session_routes",
            "Requests of a session or conversation, by kind and result (new binding, stayed, moved).",
            ["kind", "result"],
            registry=r,
        )
        self.session_moves = Counter(
            "kvroute_session_moves", "Session bindings moved to another backend, by reason.", ["reason"], registry=r
        )
        self.sessions_bound = Gauge(
            "kvroute_sessions",
            "Session and conversation bindings held, by kind.",
            ["kind"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.sessions_agreeing = Gauge(
            "kvroute_sessions_agreeing",
            "1 while conversations are placed by their key's home so replicas agree without peers "
            "(--session-agree; auto: once other routers are seen and no peer sync runs), else 0.",
            multiprocess_mode="livemax",
            registry=r,
        )
        self.sessions_dropped = Counter(
            "kvroute_sessions_dropped",
            "Bindings dropped: expired after the TTL, or evicted beyond max_sessions.",
            ["cause"],
            registry=r,
        )
        self.session_ids_ignored = Counter(
            "kvroute_session_ids_ignored",
            "Session ids a request carried but that were not used, by reason.",
            ["reason"],
            registry=r,
        )
        # Objectives, admission and TTFT predictions (docs/serve.md#objectives-and-admission).
        self.slo = SloMetrics(r)
        self._sessions_seen = (0, 0)  # (expired, evicted) already counted
        self._decision = self.decision_seconds.labels(strategy)
        self._children: dict[tuple[object, ...], Any] = {}
        # `request_done`'s bound methods, made on first use (a series exists once it has a value).
        self._count_done: dict[tuple[str, RequestOutcome], Callable[[], None]] = {}
        self._observe_duration: dict[str, Callable[[float, dict[str, str] | None], None]] = {}
        self._fleet = fleet
        if not shared:
            r.register(_FleetCollector(fleet))
            return
        directory = os.environ.get(MULTIPROC_ENV)
        if not directory or not os.path.isdir(directory):
            raise ConfigError(
                f"shared metrics need {MULTIPROC_ENV} set to an existing directory before prometheus-client "
                f"is imported (got {directory!r}); kvroute serve --workers sets it for its workers."
            )
        from prometheus_client import values

        if values.ValueClass is values.MutexValue:
            raise ConfigError(
                f"prometheus-client was imported before {MULTIPROC_ENV} was set: values would not be shared."
            )
        self.in_flight = Gauge(
            "kvroute_in_flight", "Requests in flight per backend.", ["backend"], multiprocess_mode="livesum", registry=r
        )
        self.healthy = Gauge(
            "kvroute_backend_healthy",
            "1 when every worker has the backend in rotation.",
            ["backend"],
            multiprocess_mode="livemin",
            registry=r,
        )
        self.draining = Gauge(
            "kvroute_backend_draining",
            "1 while the backend is draining in any worker.",
            ["backend"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.worker_requests = Counter(
            "kvroute_worker_requests", "Requests handled, per worker (restarts keep the index).", ["worker"], registry=r
        )
        self.worker_in_flight = Gauge(
            "kvroute_worker_in_flight",
            "Requests a worker is handling now.",
            ["worker"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.worker_starts = Counter(
            "kvroute_worker_starts", "Worker processes started, per index.", ["worker"], registry=r
        )
        self.worker_up = Gauge(
            "kvroute_worker_up",
            "1 per live worker process (prometheus-client adds its pid).",
            ["worker"],
            multiprocess_mode="liveall",
            registry=r,
        )
        self.worker_starts.labels(worker).inc()
        self.worker_up.labels(worker).set(1)
        self._worker_requests = self.worker_requests.labels(worker)
        self.worker_in_flight_child = self.worker_in_flight.labels(worker)
        for state in fleet:
            self._set_state(state.id)
        fleet.subscribe(self._fleet_changed)
        from prometheus_client.multiprocess import MultiProcessCollector

        self._merged = CollectorRegistry()
        MultiProcessCollector(self._merged, path=directory)  # type: ignore[no-untyped-call]

    def _set_state(self, backend_id: str, *, removed: bool = False) -> None:
        if removed or backend_id not in self._fleet:
            # prometheus-client's files cannot drop a series: a removed backend reads 0 until restart.
            self.child(self.healthy, backend_id).set(0)
            self.child(self.draining, backend_id).set(0)
            return
        state = self._fleet.get(backend_id)
        self.child(self.healthy, backend_id).set(1 if state.healthy else 0)
        self.child(self.draining, backend_id).set(1 if state.draining else 0)
        self.child(self.in_flight, backend_id)

    def _fleet_changed(self, event: FleetEvent) -> None:
        if event.backend is not None:
            self._set_state(event.backend.id, removed=event.kind == "removed")

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: prometheus-client's lookup costs microseconds per call."""
        key = (metric, *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def session_routed(self, decision: Decision, sessions: Sessions) -> None:
        """Count a decision of a router that keeps sessions, and bring the bindings' gauges up to date."""
        detail = decision.detail
        kind = detail.get("bound")
        if kind is not None:
            self.child(self.session_routes, str(kind), "stayed").inc()
        else:
            kind = detail.get("binds")
            if kind is None:
                return  # not a request of a session or conversation
            moved_from = detail.get("moved_from")
            if moved_from is None:
                self.child(self.session_routes, str(kind), "new").inc()
            elif moved_from == decision.backend.id:
                self.child(self.session_routes, str(kind), "stayed").inc()
            else:
                self.child(self.session_routes, str(kind), "moved").inc()
                self.child(self.session_moves, str(detail.get("move_reason"))).inc()
        for name in ("session", "conversation"):
            self.child(self.sessions_bound, name).set(sessions.bound(name))
        self.sessions_agreeing.set(1 if sessions.agreeing else 0)
        expired, evicted = self._sessions_seen
        if sessions.expired != expired or sessions.evicted != evicted:
            self.child(self.sessions_dropped, "expired").inc(sessions.expired - expired)
            self.child(self.sessions_dropped, "evicted").inc(sessions.evicted - evicted)
            self._sessions_seen = (sessions.expired, sessions.evicted)

    def observe_decision(self, seconds: float) -> None:
        self._decision.observe(seconds)

    def request_done(
        self,
        backend: str,
        outcome: RequestOutcome,
        duration: float | None,
        exemplar: dict[str, str] | None = None,
    ) -> None:
        """Count a finished request, and observe its duration when it reached a backend (once per request);
        ``exemplar`` (a traced request's ``{"trace_id": ...}``) goes with the observation."""
        count = self._count_done.get((backend, outcome))
        if count is None:
            count = self._count_done[backend, outcome] = self.requests.labels(backend, self.strategy, outcome).inc
        count()
        if duration is not None:
            observe = self._observe_duration.get(backend)
            if observe is None:
                observe = self._observe_duration[backend] = self.duration.labels(backend).observe
            observe(duration, exemplar)
        if self.shared:
            self._worker_requests.inc()

    def in_flight_child(self, backend: str) -> Any:
        """The shared in-flight gauge of ``backend`` (``shared=True`` only): inc when a lease starts, dec when it
        ends."""
        return self.child(self.in_flight, backend)

    def shadow_metrics(self, live: str, shadows: Sequence[str]) -> ShadowMetrics:
        """Register the shadow comparison's metrics (only when shadows are configured), every series at 0."""
        return ShadowMetrics(self.registry, live, shadows)

    def exposition(self, accept: bytes) -> tuple[bytes, bytes]:
        """``/metrics``' body and content type: OpenMetrics (with the histograms' trace-id exemplars) for a scraper
        whose ``Accept`` asks for it, as Prometheus does, else the classic text format."""
        if b"application/openmetrics-text" in accept:
            return self.render(openmetrics=True), OPENMETRICS
        return self.render(), CONTENT_TYPE

    def render(self, *, openmetrics: bool = False) -> bytes:
        """The exposition text: this process's registry, or every worker's values merged; in the OpenMetrics format
        (with exemplars, which prometheus-client keeps only in one process) when asked."""
        generate = _openmetrics_latest if openmetrics else generate_latest
        return render_merged(self._merged, generate) if self.shared else generate(self.registry)


#: How often `render_merged` reads the workers' files again after catching one being created.
_MERGE_ATTEMPTS = 5
_MERGE_RETRY_S = 0.005


def _openmetrics_latest(registry: CollectorRegistry) -> bytes:
    return openmetrics.generate_latest(registry)  # type: ignore[no-untyped-call,no-any-return]


def render_merged(
    registry: CollectorRegistry, generate: Callable[[CollectorRegistry], bytes] = generate_latest
) -> bytes:
    """``generate_latest`` over the workers' multiprocess files, read again when one is caught being created.

    A worker that starts (or restarts after a crash) creates its file empty and sizes it a moment
    later; prometheus-client reading it in between fails with ``struct.error``. That window is
    microseconds long, so a short wait and another read get past it; a file that stays unreadable
    still raises after `_MERGE_ATTEMPTS` reads.
    """
    for attempt in range(_MERGE_ATTEMPTS):
        try:
            return generate(registry)
        except struct.error:
            if attempt + 1 == _MERGE_ATTEMPTS:
                raise
            time.sleep(_MERGE_RETRY_S)  # blocks this worker's loop a few ms, only in that rare case
    raise AssertionError("unreachable")


class ShadowMetrics:
    """Per strategy (the live one, role ``live``, and each shadow, role ``shadow``): decisions, predicted reuse,
    reuse available anywhere, agreement with the live choice (docs/monitoring.md, "Shadow strategies").

    Token counts are the fleet cache view's (`kvroute.CacheView`): approximate tokens. The engines' own
    count is ``kvroute_prompt_tokens_cached``.
    """

    def __init__(self, registry: CollectorRegistry, live: str, shadows: Sequence[str]) -> None:
        r = registry
        labels = ["strategy", "role"]
        self.decisions = Counter(
            "kvroute_strategy_decisions",
            "Requests each strategy decided (live, or shadow in dry run).",
            labels,
            registry=r,
        )
        self.predicted = Counter(
            "kvroute_predicted_reused_tokens",
            "Prompt tokens the strategy's chosen backend would find cached, as the cache view predicts.",
            labels,
            registry=r,
        )
        self.reusable = Counter(
            "kvroute_reusable_tokens",
            "Prompt tokens the best candidate held (reusable anywhere), in the strategy's cache view.",
            labels,
            registry=r,
        )
        self.agreements = Counter(
            "kvroute_shadow_agreements",
            "Requests where a shadow picked the live strategy's backend.",
            ["strategy"],
            registry=r,
        )
        self.errors = Counter("kvroute_shadow_errors", "Requests a shadow failed to decide.", ["strategy"], registry=r)
        self.prompt_tokens = Counter(
            "kvroute_cache_view_prompt_tokens",
            "Prompt length as the cache view counts it (approximate tokens).",
            registry=r,
        )
        # Children made once, in the order of `kvroute.ShadowSet.names`: the request path only indexes them.
        roles = [(live, "live"), *((name, "shadow") for name in shadows)]
        self.by_strategy = [
            (
                self.decisions.labels(name, role),
                self.predicted.labels(name, role),
                self.reusable.labels(name, role),
                self.agreements.labels(name) if role == "shadow" else None,
                self.errors.labels(name) if role == "shadow" else None,
            )
            for name, role in roles
        ]

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        """Count one request's verdicts (the live one first, then the shadows in configured order)."""
        self.prompt_tokens.inc(verdicts[0].reuse.prompt)
        for verdict, (decisions, predicted, reusable, agreements, errors) in zip(
            verdicts, self.by_strategy, strict=True
        ):
            if verdict.error is not None:
                if errors is not None:  # only shadows can fail: the live verdict is the live decision
                    errors.inc()
                continue
            decisions.inc()
            predicted.inc(verdict.reuse.chosen)
            reusable.inc(verdict.reuse.best)
            if agreements is not None and verdict.agrees:
                agreements.inc()


#: Wait in the admission queue, in seconds.
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Predicted TTFT over observed TTFT: 0.75 and 1.25 are bounds, so the share predicted within 25 % of the observed
#: TTFT is read off two buckets.
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)
#: Absolute TTFT prediction error, in seconds.
_ERROR_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SloMetrics:
    """Objectives, admission and TTFT predictions (docs/serve.md, "Objectives and admission").

    With several workers the queue length is summed over the live workers (each has its own queue).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.objectives_ignored = Counter(
            "kvroute_objectives_ignored",
            "Objective or priority headers not used, by reason (the default stood).",
            ["reason"],
            registry=r,
        )
        self.admission = Counter(
            "kvroute_admission_requests",
            "Requests with objectives judged by admission, by priority class and result "
            "(met: routed at once; queued; sent: predicted to miss, sent anyway; shed: answered 429 at once).",
            ["priority", "result"],
            registry=r,
        )
        self.shed_requests = Counter(
            "kvroute_shed_requests",
            "Requests answered 429 by admission, by priority class and reason (predicted_miss, queue_full, deadline).",
            ["priority", "reason"],
            registry=r,
        )
        self.queue_length = Gauge(
            "kvroute_admission_queue_length",
            "Requests held in the admission queue (summed over workers: each has its own queue).",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.wait = Histogram(
            "kvroute_admission_wait_seconds",
            "Time requests were held in the admission queue, by priority class and how the wait ended "
            "(admitted, sent_late, shed, cancelled).",
            ["priority", "result"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.ttft_ratio = Histogram(
            "kvroute_ttft_prediction_ratio",
            "TTFT predicted when the request was routed over the TTFT observed (first byte of a stream), by backend.",
            ["backend"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.ttft_error = Histogram(
            "kvroute_ttft_prediction_error_seconds",
            "Absolute difference between observed and predicted TTFT, by backend.",
            ["backend"],
            buckets=_ERROR_BUCKETS,
            registry=r,
        )
        self._children: dict[tuple[object, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric, *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def ignored(self, reason: str) -> None:
        self._child(self.objectives_ignored, reason).inc()

    def admitted(self, priority: str, result: str) -> None:
        self._child(self.admission, priority, result).inc()

    def shed(self, priority: str, reason: str) -> None:
        self._child(self.shed_requests, priority, reason).inc()

    def waited(self, priority: str, result: str, seconds: float) -> None:
        self._child(self.wait, priority, result).observe(seconds)

    def predicted(self, backend: str, predicted_s: float, observed_s: float) -> None:
        """Compare a request's predicted TTFT with the one observed."""
        self._child(self.ttft_error, backend).observe(abs(observed_s - predicted_s))
        if observed_s > 0:
            self._child(self.ttft_ratio, backend).observe(predicted_s / observed_s)
