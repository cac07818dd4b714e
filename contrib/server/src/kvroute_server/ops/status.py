"""The status view: what ``GET /status.json`` returns and ``GET /status`` shows (docs/serve.md, "Status page").

`StatusView.collect` gathers, at the time of the call, the strategy and its options, every backend
(identity, health, draining, in flight, the engine's own load when fresh, its share of requests,
prefix reuse, spills and ejections), where the fleet comes from, and the last decisions that
`DecisionLog` recorded as requests finished. Prompt text is never recorded: a decision keeps its
prefix key as a hash, the backend, the explanation and the timings.

Counters (requests, tokens, spills, ejections, in flight) are read from the proxy's own
``/metrics`` exposition (`ProxyMetrics.render`), so the page and ``/metrics`` agree by
construction, and under ``kvroute serve --workers N`` they are the values merged over every
worker. The decision log, the per-backend spill counts and the engine loads are the answering
worker's own (see docs/serve.md). With shadow strategies, the ``shadow`` section compares them with
the live strategy (from the shadow metrics, so merged too; docs/monitoring.md, "Shadow strategies").
"""

from __future__ import annotations

import collections
import hmac
import time
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any

import attrs
from prometheus_client.parser import text_string_to_metric_families

from kvroute.fleet import Fleet
from kvroute.router import Router
from kvroute.strategy import Decision
from kvroute_server.config import PRIORITIES, PeerConfig, ServerConfig
from kvroute_server.fleet.backends import BackendSet
from kvroute_server.fleet.discovery import Discovery, NoDiscovery
from kvroute_server.http.asgi import App, Receive, RouteTable, Scope, Send, send_bytes, send_json
from kvroute_server.ops.journal import ONE_PROCESS, WorkerContext
from kvroute_server.ops.metrics import ProxyMetrics, RequestOutcome
from kvroute_server.proxy.forwarding import Exchange, reject

__all__ = ["DecisionLog", "NoStatusRoutes", "StatusRoutes", "StatusView", "bearer_matches", "page"]
#: Version of the ``/status.json`` document's shape; raised when a field changes meaning or goes.
SCHEMA_VERSION = 1


@attrs.frozen
class DecisionRecord:
    """One finished request as the status page shows it (never the prompt)."""

    at: float
    request_id: str
    model: str | None
    decision: Decision
    outcome: RequestOutcome
    status: int
    attempts: int
    ttft_s: float | None
    duration_s: float

    def to_json(self) -> dict[str, Any]:
        d = self.decision
        return {
            "at": round(self.at, 3),
            "request_id": self.request_id,
            "model": self.model,
            "backend": d.backend.id,
            "key": f"{d.key:016x}" if d.key is not None else None,
            "reason": d.reason,
            "spilled": d.spilled,
            "spill_reason": str(d.spill_reason) if d.spill_reason is not None else None,
            "data_parallel_rank": d.data_parallel_rank,
            "explain": d.explain(),
            "decision_us": round(d.duration_s * 1e6, 1),
            "outcome": self.outcome,
            "status": self.status,
            "attempts": self.attempts,
            "ttft_ms": round(self.ttft_s * 1000, 2) if self.ttft_s is not None else None,
            "duration_ms": round(self.duration_s * 1000, 2),
        }


class DecisionLog:
    """The last ``size`` routed requests, and per backend how many were spilled to it, by reason.

    `record` runs on the request path once per finished request: it appends the raw pieces, a
    plain tuple, to a bounded deque and bumps a counter; the `DecisionRecord` (a frozen attrs
    instance, ~3x the cost of the tuple) is built, and `Decision.explain` called, only when the
    status is read.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._records: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=size)
        self._spills: dict[str, collections.Counter[str]] = {}

    def record(
        self,
        request_id: str,
        model: str | None,
        decision: Decision,
        *,
        outcome: RequestOutcome,
        status: int,
        attempts: int,
        ttft_s: float | None,
        duration_s: float,
    ) -> None:
        if decision.spilled:
            cause = str(decision.spill_reason or decision.reason)
            self._spills.setdefault(decision.backend.id, collections.Counter())[cause] += 1
        if self.size:
            self._records.append(
                (time.time(), request_id, model, decision, outcome, status, attempts, ttft_s, duration_s)
            )

    def recent(self) -> list[dict[str, Any]]:
        """The recorded decisions, newest first."""
        return [DecisionRecord(*r).to_json() for r in reversed(self._records)]

    def spills_to(self, backend_id: str) -> dict[str, int]:
        """Requests spilled to ``backend_id`` away from their first choice, by reason."""
        return dict(sorted(self._spills.get(backend_id, {}).items()))


class _Samples:
    """The proxy's exposition text, parsed once: sums of samples by a subset of their labels."""

    def __init__(self, text: str) -> None:
        self._by_name: dict[str, list[tuple[Mapping[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self._by_name.setdefault(sample.name, []).append((sample.labels, sample.value))

    def sum_by(self, name: str, *labels: str, where: Mapping[str, str] | None = None) -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = collections.defaultdict(float)
        for sample_labels, value in self._by_name.get(name, ()):
            if where and any(sample_labels.get(k) != v for k, v in where.items()):
                continue
            out[tuple(sample_labels.get(label, "") for label in labels)] += value
        return dict(out)

    def per_backend(self, name: str, where: Mapping[str, str] | None = None) -> dict[str, float]:
        return {k[0]: v for k, v in self.sum_by(name, "backend", where=where).items()}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else round(value, 6)


def _engine(state: Any, now: float) -> dict[str, Any] | None:
    load = state.fresh_load(now)
    if load is None:
        return None
    hit_rate = None
    if load.prefix_cache_queries:
        hit_rate = round((load.prefix_cache_hits or 0) / load.prefix_cache_queries, 4)
    return {
        "running": load.running,
        "waiting": load.waiting,
        "kv_usage": load.kv_usage,
        "prefix_cache_queries": load.prefix_cache_queries,
        "prefix_cache_hits": load.prefix_cache_hits,
        "prefix_hit_rate": hit_rate,
        "age_s": round(load.age(now), 3),
    }


def _ranks(state: Any, now: float, sent: Mapping[str, float]) -> list[dict[str, Any]]:
    """Per data-parallel rank (none for a one-rank backend): attempts the proxy sent to it, and the engine's load."""
    size = state.data_parallel_size
    if size <= 1:
        return []
    load = state.fresh_load(now)
    reported = {r.rank: r for r in load.ranks} if load is not None else {}
    rows = []
    for rank in range(size):
        engine = reported.get(rank)
        rows.append(
            {
                "rank": rank,
                "requests": _number(sent.get(str(rank), 0.0)),
                "running": engine.running if engine is not None else None,
                "waiting": engine.waiting if engine is not None else None,
                "kv_usage": engine.kv_usage if engine is not None else None,
            }
        )
    return rows


def _tiers(strategy: object) -> dict[str, Any] | None:
    """Prefix hits by KV cache tier (tokens of the chosen backends' matches) and blocks held per slower tier, when
    the strategy counts them (tokenizer-prefix does); else ``None``."""
    stats = getattr(strategy, "stats", None)
    if not callable(stats):
        return None
    try:
        found = stats()
    except Exception:
        return None
    if not isinstance(found, Mapping) or "tier_hit_tokens" not in found:
        return None
    return {
        "hit_tokens": _jsonable(found.get("tier_hit_tokens", {})),
        "blocks": _jsonable(found.get("tier_blocks", {})),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


@attrs.define
class StatusView:
    """Collects the status document from the proxy's parts (it changes nothing)."""

    config: ServerConfig
    fleet: Fleet
    backends: BackendSet
    router: Router
    metrics: ProxyMetrics
    discovery: Discovery | NoDiscovery
    decisions: DecisionLog
    worker: WorkerContext = ONE_PROCESS
    #: Where a backend came from when discovery does not own it: flags or the configuration file.
    _static: set[str] = attrs.field(init=False)
    _from_file: set[str] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._static = {b.id for b in self.config.backends}
        self._from_file = set(self.config.backends_from_file)

    def _origin(self, backend_id: str, owned: Mapping[str, str]) -> str:
        if backend_id in owned:
            return f"discovery:{owned[backend_id]}"
        if backend_id in self._from_file:
            return "file"
        if backend_id in self._static:
            return "flag"
        return "admin"

    def collect(self) -> dict[str, Any]:
        """The status document (docs/serve.md lists its fields)."""
        now = time.monotonic()
        samples = _Samples(self.metrics.render().decode())
        strategy = self.router.strategy_name
        requests = samples.sum_by("kvroute_requests_total", "backend", "outcome")
        by_backend: dict[str, dict[str, int | float]] = {}
        for (backend_id, outcome), value in requests.items():
            by_backend.setdefault(backend_id, {})[outcome] = _number(value)
        routed_total = sum(sum(v.values()) for k, v in by_backend.items() if k != "none")
        prompt = samples.per_backend("kvroute_prompt_tokens_total")
        cached = samples.per_backend("kvroute_prompt_tokens_cached_total")
        in_flight = samples.per_backend("kvroute_in_flight")
        ejections = samples.sum_by("kvroute_ejections_total", "backend", "cause")
        rank_requests = samples.sum_by("kvroute_rank_requests_total", "backend", "rank")
        owned: dict[str, str] = {}
        for source in self.discovery.status:
            owned.update(dict.fromkeys(self.discovery.owned(source), source))

        rows: list[dict[str, Any]] = []
        for state in self.fleet:
            backend = state.backend
            bid = backend.id
            counts = by_backend.get(bid, {})
            total = sum(counts.values())
            p, c = prompt.get(bid, 0.0), cached.get(bid, 0.0)
            rows.append(
                {
                    "id": bid,
                    "kind": backend.kind,
                    "url": backend.url,
                    "weight": backend.weight,
                    "models": sorted(state.models),
                    "origin": self._origin(bid, owned),
                    "healthy": state.healthy,
                    "draining": state.draining,
                    "routable": state.routable,
                    "in_flight": _number(in_flight.get(bid, state.in_flight)),
                    "engine": _engine(state, now),
                    "load_stale": state.load_is_stale(now),
                    "requests": {"total": _number(total), "by_outcome": dict(sorted(counts.items()))},
                    "share": round(total / routed_total, 4) if routed_total else 0.0,
                    "reuse": {
                        "prompt_tokens": _number(p),
                        "cached_tokens": _number(c),
                        "cached_ratio": round(c / p, 4) if p else None,
                    },
                    "spills_to": self.decisions.spills_to(bid),
                    "ejections": {cause: _number(v) for (b, cause), v in sorted(ejections.items()) if b == bid and v},
                    # Ejected as an outlier: cause, back-off level, seconds until its probe request (else None).
                    "outlier": self.backends.health.outliers.describe(bid),
                    "data_parallel_size": state.data_parallel_size,
                    "ranks": _ranks(state, now, {r: v for (b, r), v in rank_requests.items() if b == bid}),
                }
            )
        spills = samples.sum_by("kvroute_spills_total", "reason", where={"strategy": strategy})
        rejected = samples.sum_by("kvroute_rejected_requests_total", "status")
        return {
            "schema": SCHEMA_VERSION,
            "generated_at": round(time.time(), 3),
            "worker": self._worker(),
            "strategy": {"name": strategy, "options": _jsonable(self.config.options)},
            "totals": {
                "requests": _number(sum(sum(v.values()) for v in by_backend.values())),
                "routed": _number(routed_total),
                "in_flight": _number(sum(r["in_flight"] for r in rows)),
                "prompt_tokens": _number(sum(prompt.values())),
                "cached_tokens": _number(sum(cached.values())),
                "spills": {k[0]: _number(v) for k, v in sorted(spills.items())},
                "rejected": {k[0]: _number(v) for k, v in sorted(rejected.items())},
            },
            "backends": rows,
            "fleet": self._fleet(rows),
            "decisions": {"size": self.decisions.size, "recent": self.decisions.recent()},
            "tiers": _tiers(self.router.strategy),
            "dropped_headers": {
                k[0]: _number(v)
                for k, v in sorted(samples.sum_by("kvroute_dropped_request_headers_total", "header").items())
            },
            "shadow": self._shadow(samples, strategy, prompt, cached) if self.config.shadow else None,
            "sessions": self._sessions(samples) if self.config.sessions.enabled else None,
            "peers": _peers(samples, self.config.peers) if self.config.peers.enabled else None,
            "slo": self._slo(samples),
        }

    def _slo(self, samples: _Samples) -> dict[str, Any]:
        """Objectives, admission (settings, the queue summed over workers, results, shed requests) and how well
        TTFT was predicted (docs/serve.md, "Objectives and admission")."""

        def nested(name: str, outer: str, inner: str) -> dict[str, dict[str, int | float]]:
            out: dict[str, dict[str, int | float]] = {}
            for (a, b), value in sorted(samples.sum_by(name, outer, inner).items()):
                if value:
                    out.setdefault(a, {})[b] = _number(value)
            return out

        c, a = self.config.slo, self.config.admission
        admission = None
        if a.enabled:
            admission = {
                "mode": a.mode,
                "queue_size": a.queue_size,
                "order": a.order,
                "max_wait_s": a.max_wait,
                "actions": {p: a.action(p) for p in PRIORITIES},
                "queued": _number(sum(samples.sum_by("kvroute_admission_queue_length").values())),
            }
        wait_count = samples.sum_by("kvroute_admission_wait_seconds_count", "result")
        wait_sum = samples.sum_by("kvroute_admission_wait_seconds_sum", "result")
        ratio = samples.sum_by("kvroute_ttft_prediction_ratio_bucket", "le")
        observed = sum(samples.sum_by("kvroute_ttft_prediction_ratio_count").values())
        within = ratio.get(("1.25",), 0.0) - ratio.get(("0.75",), 0.0)
        error_sum = sum(samples.sum_by("kvroute_ttft_prediction_error_seconds_sum").values())
        predictor = self.router.predictor
        return {
            "aware": c.aware,
            "defaults": {
                "ttft_ms": c.ttft_ms,
                "tpot_ms": c.tpot_ms,
                "priority": c.priority,
                "models": sorted(c.models),
            },
            "admission": admission,
            "requests": nested("kvroute_admission_requests_total", "priority", "result"),
            "shed": nested("kvroute_shed_requests_total", "priority", "reason"),
            "waits": {
                k[0]: {"count": _number(n), "mean_ms": round(1000 * wait_sum.get(k, 0.0) / n, 2)}
                for k, n in sorted(wait_count.items())
                if n
            },
            "objectives_ignored": {
                k[0]: _number(v)
                for k, v in sorted(samples.sum_by("kvroute_objectives_ignored_total", "reason").items())
            },
            "predictions": {
                "observed": _number(observed),
                "within_25pct": round(within / observed, 4) if observed else None,
                "mean_abs_error_ms": round(1000 * error_sum / observed, 2) if observed else None,
                # This worker's predictor: learned rates per backend, and its own recent errors.
                "rates": _jsonable(predictor.summary()) if predictor is not None else None,
                "median_abs_error_ms": _ms(predictor.errors.median_abs_error_s()) if predictor is not None else None,
            },
        }

    def _sessions(self, samples: _Samples) -> dict[str, Any]:
        """Bindings held (summed over live workers), requests by kind and result, moves, drops, ignored ids."""

        def by(name: str, label: str) -> dict[str, int | float]:
            return {k[0]: _number(v) for k, v in sorted(samples.sum_by(name, label).items()) if k[0]}

        routes = samples.sum_by("kvroute_session_routes_total", "kind", "result")
        sessions = self.router.sessions
        return {
            "ttl_s": self.config.sessions.ttl,
            "agree": self.config.sessions.agree,
            # Placing conversations by their key's home now (kvroute_sessions_agreeing; any worker counts), and the
            # answering worker's evidence: new conversations in its window and those that arrived with a history.
            "agreeing": any(v > 0 for v in samples.sum_by("kvroute_sessions_agreeing").values()),
            "new_conversations": None if sessions is None else sessions.strangers.seen,
            "with_history": None if sessions is None else sessions.strangers.foreign,
            "max_sessions": self.config.sessions.max_sessions,
            "bound": by("kvroute_sessions", "kind"),
            "requests": {f"{kind}/{result}": _number(v) for (kind, result), v in sorted(routes.items())},
            "moved": by("kvroute_session_moves_total", "reason"),
            "dropped": by("kvroute_sessions_dropped_total", "cause"),
            "ignored_ids": by("kvroute_session_ids_ignored_total", "reason"),
        }

    def _shadow(
        self, samples: _Samples, live: str, engine_prompt: Mapping[str, float], engine_cached: Mapping[str, float]
    ) -> dict[str, Any]:
        """Per strategy (live first): decisions, predicted reuse, reusable anywhere, agreement; and the funnel.

        The view counts approximate tokens and the engines real ones, so the funnel compares ratios: the
        view's stages over the view's prompt tokens, the engines' stage over the engines' prompt tokens.
        """
        decisions = samples.sum_by("kvroute_strategy_decisions_total", "strategy")
        predicted = samples.sum_by("kvroute_predicted_reused_tokens_total", "strategy")
        reusable = samples.sum_by("kvroute_reusable_tokens_total", "strategy")
        agreements = samples.sum_by("kvroute_shadow_agreements_total", "strategy")
        errors = samples.sum_by("kvroute_shadow_errors_total", "strategy")
        prompt = sum(samples.sum_by("kvroute_cache_view_prompt_tokens_total").values())
        rows = []
        for name in (live, *self.config.shadow):
            key = (name,)
            n, p, r = decisions.get(key, 0.0), predicted.get(key, 0.0), reusable.get(key, 0.0)
            agreed = n if name == live else agreements.get(key, 0.0)
            rows.append(
                {
                    "name": name,
                    "role": "live" if name == live else "shadow",
                    "decisions": _number(n),
                    "predicted_reused_tokens": _number(p),
                    "reusable_tokens": _number(r),
                    "predicted_ratio": round(p / prompt, 4) if prompt else None,
                    "captured": round(p / r, 4) if r else None,
                    "agreements": _number(agreed),
                    "agreement": round(agreed / n, 4) if n else None,
                    "errors": _number(errors.get(key, 0.0)),
                }
            )
        engine_p, engine_c = sum(engine_prompt.values()), sum(engine_cached.values())
        live_reusable, live_predicted = reusable.get((live,), 0.0), predicted.get((live,), 0.0)
        return {
            "strategies": rows,
            # Live strategy: what its candidates held / what its choices held / what the engines said they reused.
            "funnel": {
                "prompt_tokens": _number(prompt),
                "reusable_anywhere": _number(live_reusable),
                "predicted_at_chosen": _number(live_predicted),
                "engine_prompt_tokens": _number(engine_p),
                "engine_reported": _number(engine_c),
                "ratios": {
                    "reusable_anywhere": round(live_reusable / prompt, 4) if prompt else None,
                    "predicted_at_chosen": round(live_predicted / prompt, 4) if prompt else None,
                    "engine_reported": round(engine_c / engine_p, 4) if engine_p else None,
                },
            },
            "cache_view": _jsonable(self.config.cache_view),
        }

    def _worker(self) -> dict[str, Any]:
        count = self.worker.count
        return {
            "index": self.worker.index,
            "count": count,
            # What is merged over every worker, and what is this worker's own.
            "merged": ["requests", "share", "in_flight", "reuse", "spills", "ejections", "rejected", "shadow", "slo"],
            "own": [
                "decisions",
                "spills_to",
                "engine",
                "healthy",
                "draining",
                "slo.predictions.rates",
                "sessions.new_conversations",
                "sessions.with_history",
            ]
            if count > 1
            else [],
        }

    def _fleet(self, rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
        origins = collections.Counter(str(r["origin"]).partition(":")[0] for r in rows)
        sources = self.discovery.describe()
        for source in sources:
            source["kind"] = "discovery"
        stale_after = self.config.discovery_policy.stale_after if self.config.discovery else None
        return {
            "flags": sorted(self._static - self._from_file),
            "file": self.config.config_file,
            "from_file": sorted(self._from_file),
            "counts": {key: origins[key] for key in ("flag", "file", "discovery", "admin")},
            "discovery": sources,
            "stale_after_s": stale_after,
        }


def bearer_matches(scope: Mapping[str, Any], token: str | None) -> bool:
    """Whether the request carries ``Authorization: Bearer <token>`` (never true without a token)."""
    if token is None:
        return False
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, given = value.partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token.encode())
    return False


def page() -> bytes:
    """The status page: one self-contained HTML file (inline CSS and script, no external resources)."""
    return resources.files("kvroute_server.ops").joinpath("static/status.html").read_bytes()


class StatusRoutes:
    """``GET /status`` and ``GET /status.json``, and the decision log the app feeds as requests finish."""

    def __init__(self, view: StatusView, mode: str, token: str | None) -> None:
        self.view = view
        self.decisions = view.decisions
        self.mode = mode
        self._token = token

    @classmethod
    def create(
        cls,
        config: ServerConfig,
        fleet: Fleet,
        backends: BackendSet,
        router: Router,
        metrics: ProxyMetrics,
        discovery: Discovery | NoDiscovery,
        worker: WorkerContext,
    ) -> StatusRoutes | NoStatusRoutes:
        """The routes for ``config.status``; `NoStatusRoutes` when it is ``off``."""
        if config.status == "off":
            return NoStatusRoutes()
        decisions = DecisionLog(config.status_decisions)
        view = StatusView(config, fleet, backends, router, metrics, discovery, decisions, worker)
        return cls(view, config.status, config.admin_token)

    def add_routes(self, routes: RouteTable[App]) -> None:
        """Add ``GET /status`` and ``GET /status.json`` to ``routes``."""
        routes.add("GET", "/status", self.page)
        routes.add("GET", "/status.json", self.json)

    def finished(self, ex: Exchange, duration: float) -> None:
        """Record a finished request's last decision (requests refused before routing have none)."""
        if ex.decision is None:
            return
        decision = ex.decision
        if ex.rank is not None and decision.data_parallel_rank is None:  # the rank the proxy chose for it
            decision = attrs.evolve(decision, data_parallel_rank=ex.rank)
        self.decisions.record(
            ex.request_id,
            ex.model,
            decision,
            outcome=ex.outcome,
            status=ex.status,
            attempts=ex.attempts,
            ttft_s=ex.ttft,
            duration_s=duration,
        )

    async def page(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The page holds no data (its script reads /status.json, sending the token it is given), so it
        # is served without the token; /status.json is what the token guards.
        headers = [(b"cache-control", b"no-store"), (b"x-content-type-options", b"nosniff")]
        await send_bytes(send, 200, page(), headers, content_type=b"text/html; charset=utf-8")

    async def json(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.mode == "admin" and not bearer_matches(scope, self._token):
            await reject(
                self.view.metrics,
                send,
                401,
                "The status is behind the admin token: send 'Authorization: Bearer <admin token>'.",
                code="invalid_admin_token",
                headers=[(b"www-authenticate", b"Bearer")],
            )
            return
        await send_json(send, 200, self.view.collect(), [(b"cache-control", b"no-store")])


class NoStatusRoutes:
    """The status page turned off: no routes, no decision log."""

    def add_routes(self, routes: RouteTable[App]) -> None:
        """Add nothing: ``/status`` and ``/status.json`` are unknown routes."""

    def finished(self, ex: Exchange, duration: float) -> None:
        """Record nothing."""


def _peers(samples: _Samples, config: PeerConfig) -> dict[str, Any]:
    """Router-replica sync (docs/serve.md, "Several replicas"): each peer (static or discovered) with its state
    and holds sent, holds received and what became of them, holds dropped by reason (summed over workers), and
    peer discovery's sources and changes."""
    up = samples.sum_by("kvroute_peer_up", "peer")
    sent = samples.sum_by("kvroute_peer_holds_sent_total", "peer")
    dropped = samples.sum_by("kvroute_peer_holds_dropped_total", "reason")
    adopted = samples.sum_by("kvroute_peer_holds_adopted_total", "result")
    found = samples.sum_by("kvroute_peer_discovered", "peer")
    states = {1: "up", 0: "down", -1: "self"}
    origins = dict.fromkeys(config.urls, "static")
    for (url,), value in sorted(found.items()):
        origins.setdefault(url, "discovery" if value > 0 else "discovery_self")
    peers = []
    for url, origin in origins.items():
        if origin == "discovery_self":
            state = "self"
        else:
            state = states.get(int(up[(url,)]), "down") if (url,) in up else "unknown"
        origin = origin.removesuffix("_self")
        peers.append({"url": url, "origin": origin, "state": state, "sent": _number(sent.get((url,), 0.0))})
    discovery = None
    if config.discovery:
        stale = samples.sum_by("kvroute_peer_discovery_stale", "source")
        failures = samples.sum_by("kvroute_peer_discovery_failures_total", "source")
        changes = samples.sum_by("kvroute_peer_discovery_changes_total", "change")
        discovery = {
            "sources": [
                {"source": s, "stale": bool(stale.get((s,), 0)), "failures": _number(failures.get((s,), 0.0))}
                for s in sorted({k[0] for k in (*stale, *failures)})
            ],
            "changes": {k[0]: _number(v) for k, v in sorted(changes.items()) if v},
        }
    return {
        "peers": peers,
        "received": _number(sum(samples.sum_by("kvroute_peer_holds_received_total").values())),
        "adopted": {k[0]: _number(v) for k, v in sorted(adopted.items()) if v},
        "dropped": {k[0]: _number(v) for k, v in sorted(dropped.items()) if v},
        "discovery": discovery,
    }
