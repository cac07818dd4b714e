"""The simulation driver: a workload through the real `Router` and strategy plugins onto simulated engines.

One run (:func:`simulate`) builds a `Fleet` of ``instances`` backends, a `Router` with the
strategy registered under the given name (a plugin, never a re-implementation), and one
:class:`~kvroute_simulator.engine.Engine` per backend. It then processes events in virtual
time, earliest first (at equal times: scale events, then arrivals, then engine steps):

* an arrival is parsed with ``RouteRequest.from_openai`` from its request body, routed with
  ``router.acquire`` (the wall-clock cost of the strategy's ``pick`` is recorded), and
  submitted to the chosen backend's engine; a request the engine refuses (longer than
  ``max_model_len``, or than the whole cache) is answered at once, as vLLM's HTTP 400: its
  lease is released as an error and it counts as rejected, with its reason;
* an engine step completes; finished requests are released to the router (so the strategy's
  ``on_request_finish`` and the in-flight counts see them), and a conversation's next turn is
  scheduled ``think_time`` after the turn it follows finished (closed loop);
* a scale event adds cold instances or removes the newest ones (their requests in flight finish).
  With a warm join configured, an added instance is first pre-filled with the hottest
  prefixes it will own (prefix-only requests of one output token, a few at a time, while it
  is drained) and/or its weight ramps up over ``slow_start.period``
  (:mod:`~kvroute_simulator.warm_join`); each join's figures are a :class:`JoinResult`.

Before each routing decision every backend's `EngineLoad` is refreshed from its engine
(running, waiting, KV usage, prefix-cache counters, block size), as an adapter would.

With ``EngineConfig.data_parallel_size`` > 1 each instance is a
:class:`~kvroute_simulator.engine.DataParallelEngine`: a decision that names a rank
(``Decision.data_parallel_rank``, when the core has it) is submitted to that rank, any other
to the rank the instance's own balancer picks.
:func:`compare` runs several strategies over the same arrivals.

A run's settings (:class:`SimulationConfig`, scale events) live in
:mod:`~kvroute_simulator.simulation_config` and its figures (:class:`StrategyResult`,
:class:`Comparison`) in :mod:`~kvroute_simulator.results`; both are re-exported here.
"""

from __future__ import annotations

import heapq
import importlib
import inspect
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import structlog

from kvroute.backend import Backend, EngineLoad
from kvroute.cache_view import CacheView
from kvroute.errors import ConfigError, NoBackendAvailable
from kvroute.fleet import Fleet
from kvroute.plugins import PluginManager
from kvroute.predictor import Predictor, Priors
from kvroute.request import RouteRequest
from kvroute.router import Lease, Router
from kvroute.sessions import Sessions
from kvroute.slo import Priority
from kvroute.slo_choice import SloChoice
from kvroute.strategy import Status
from kvroute_simulator.arrivals import Arrival
from kvroute_simulator.bound import ideal_hit_tokens, pooled_lru_hit_tokens
from kvroute_simulator.engine import DataParallelEngine, Engine, engine_ranks, make_engine
from kvroute_simulator.engine_config import EngineConfig
from kvroute_simulator.results import Comparison, InstanceResult, JoinResult, StrategyResult, quantile
from kvroute_simulator.sequences import EngineRequest, EngineSequence
from kvroute_simulator.simulation_config import ScaleEvent, SimulationConfig, parse_scale
from kvroute_simulator.warm_join import Join, WarmJoins

__all__ = [
    "NO_BACKEND",
    "SHED",
    "SLO_SUFFIX",
    "base_strategy",
    "Comparison",
    "InstanceResult",
    "JoinResult",
    "ScaleEvent",
    "SimulationConfig",
    "StrategyResult",
    "compare",
    "parse_scale",
    "simulate",
]

log = structlog.get_logger(__name__)

#: What the core in use knows of data-parallel ranks (fields added with rank routing; absent before).
_BACKEND_FIELDS = frozenset(attrs.fields_dict(Backend))
_RankLoad: Any = getattr(importlib.import_module("kvroute.backend"), "RankLoad", None)
if _RankLoad is not None and "ranks" not in attrs.fields_dict(EngineLoad):
    _RankLoad = None

#: The rejection reason of a request that arrived while the fleet had no member.
NO_BACKEND = "no instance in the fleet"

#: The rejection reason of a request shed because no backend was predicted to meet its objectives.
SHED = "shed: no instance predicted to meet the objectives"


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    raise ConfigError(f"'{name}' must be true or false (got {value!r}).")


#: A strategy named ``NAME+slo`` is ``NAME`` with the router's SLO-aware choice (`kvroute.slo_choice`);
#: ``NAME+slo+shed`` also sheds what no instance is predicted to serve in time (as admission would).
SLO_SUFFIX = "+slo"
SHED_SUFFIX = "+shed"


def base_strategy(name: str) -> str:
    """The strategy plugin ``name`` runs: itself, or ``NAME`` of ``NAME+slo`` and ``NAME+slo+shed``."""
    if name.endswith(SLO_SUFFIX + SHED_SUFFIX):
        return name[: -len(SLO_SUFFIX + SHED_SUFFIX)]
    return name[: -len(SLO_SUFFIX)] if name.endswith(SLO_SUFFIX) else name


def slo_choice(
    config: SimulationConfig, chars_per_token: int = 4, clock: Callable[[], float] | None = None, **options: Any
) -> SloChoice:
    """The SLO-aware choice of a ``NAME+slo`` run: priors from the engines' cost model.

    Its cache view counts ``chars_per_token`` characters of the routing text as a token (the
    simulated prompts' ratio), so predicted and engine-reported cached tokens compare.
    """
    cost = config.cost
    per_token_ms = cost.prefill_per_token_ms + cost.attention_ms * 2000
    priors = Priors(
        prefill_tokens_per_s=1000.0 / per_token_ms if per_token_ms > 0 else 1e6,
        ttft_overhead_s=(cost.decode_base_ms + cost.prefill_base_ms) / 1000.0,
        decode_step_s=max(cost.decode_base_ms, 1e-3) / 1000.0,
        decode_load_weight=(cost.decode_per_seq_ms + cost.kv_read_ms_per_token * 2000) / max(cost.decode_base_ms, 1e-3),
    )
    kinds: dict[str, Callable[[Any], Any]] = {
        "tpot_weight": float,
        "load_factor": float,
        "min_capacity": int,
        "unmet": str,
        "scan": int,
    }
    values: dict[str, Any] = {}
    for key, value in options.items():
        kind = kinds.get(key)
        if kind is None:
            raise ConfigError(
                f"the SLO-aware choice has no option 'slo_{key}' (expected one of: "
                f"{', '.join('slo_' + k for k in kinds)})."
            )
        try:
            values[key] = kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"'slo_{key}' must be a {kind.__name__} (got {value!r}).") from None
    view = CacheView(block_size=512, chars_per_token=chars_per_token)
    try:
        predictor = Predictor(priors) if clock is None else Predictor(priors, clock=clock)
        return SloChoice(predictor, view=view, **values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _chars_per_token(arrivals: Sequence[Arrival]) -> int:
    """Characters of routing text per prompt token in the first arrivals (at least 1)."""
    chars = tokens = 0
    for arrival in arrivals[:20]:
        request = RouteRequest.from_openai(arrival.body, endpoint=arrival.endpoint, request_id=arrival.request_id)
        chars += len(request.text)
        tokens += arrival.prompt_len
    return max(1, round(chars / tokens)) if tokens else 4


def _takes_seed(factory: Callable[..., Any]) -> bool:
    if isinstance(factory, type) and attrs.has(factory):
        return any((a.alias or a.name) == "seed" and a.init for a in attrs.fields(factory))
    try:
        return "seed" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


@attrs.define
class _Instance:
    backend: Backend
    engine: Engine | DataParallelEngine
    added_at: float
    removed_at: float | None = None
    requests: int = 0


@attrs.define
class _Flight:
    arrival: Arrival
    lease: Lease
    instance: _Instance
    seq: EngineSequence
    #: The join whose window the request arrived in, and whether its home is the new instance.
    join: Join | None = None
    moved: bool = False


class _Run:
    """The mutable state of one simulation run."""

    def __init__(
        self,
        arrivals: Sequence[Arrival],
        strategy: str,
        options: Mapping[str, Any],
        config: SimulationConfig,
        plugins: PluginManager,
        progress: Callable[[int], None] | None,
    ) -> None:
        self.arrivals = arrivals
        self.config = config
        self.progress = progress
        self.fleet = Fleet()
        self.instances: dict[str, _Instance] = {}
        self.order: list[str] = []  # ids in the order they were added
        self.next_index = 0
        for _ in range(config.instances):
            self._add(0.0)
        opts = dict(options)
        base = base_strategy(strategy)
        registration = plugins.strategies.get(base)
        if registration is not None and "seed" not in opts and _takes_seed(registration.factory):
            opts["seed"] = config.seed
        self.options = opts
        #: Virtual time of the event being handled: the clock of the router's sessions.
        self.now = 0.0
        sessions = Sessions(clock=lambda: self.now) if config.sessions else None
        slo_options = {k[len("slo_") :]: opts.pop(k) for k in [k for k in opts if k.startswith("slo_")]}
        #: Admission as a host would do it, simply: shed (answer at once, as 429) a request no backend is
        #: predicted to serve within its objectives, unless it is critical.
        self.shed = _flag(slo_options.pop("shed", strategy.endswith(SHED_SUFFIX)), "slo_shed")
        slo = (
            slo_choice(config, _chars_per_token(arrivals), lambda: self.now, **slo_options)
            if base != strategy
            else None
        )
        self.router = Router.create(self.fleet, base, opts, plugins=plugins, sessions=sessions, slo=slo)
        self.strategy = strategy
        self.objectives = config.slo
        self.tpots: list[float] = []
        self.slo_met = 0
        self.flights: dict[int, _Flight] = {}  # id(EngineSequence) -> flight
        self.finished_at: dict[str, float] = {}
        self.waiting_for: dict[str, list[Arrival]] = {}
        self.deferred: list[tuple[float, int, Arrival]] = []
        self.counter = 0
        self.ttfts: list[float] = []
        self.route_costs: list[float] = []
        self.spills = 0
        self.rejected: dict[str, int] = {}
        self.completed = 0
        self.decisions: dict[str, int] = {}
        self.first_arrival: float | None = None
        self.last_arrival = 0.0
        self.last_finish = 0.0
        self.timeline: list[tuple[float, float, Mapping[str, int]]] = []
        self.window_start = 0.0
        self.window_tokens = (0, 0)
        self.timers: list[tuple[float, int, Callable[[float], None]]] = []
        self.warm = WarmJoins(
            config,
            self.fleet,
            self.router,
            lambda fleet: Router.create(fleet, base, opts, plugins=plugins),
            self._timer,
        )

    # -- fleet -----------------------------------------------------------------------------

    def _add(self, now: float) -> _Instance:
        backend_id = self.config.backend_names.format(index=self.next_index)
        self.next_index += 1
        size = self.config.engine.data_parallel_size
        ranks: dict[str, Any] = (
            {"data_parallel_size": size} if size > 1 and "data_parallel_size" in _BACKEND_FIELDS else {}
        )
        backend = Backend(id=backend_id, url=f"sim://i{self.next_index - 1}", kind="simulated", **ranks)
        engine = make_engine(self.config.engine, self.config.cost, name=backend_id)
        instance = self.instances[backend_id] = _Instance(backend, engine, now)
        self.order.append(backend_id)
        self.fleet.add(backend)
        return instance

    def _live(self, instance: _Instance) -> tuple[int, int, int]:
        """The instance's prompt, hit and output tokens of live requests (pre-fill requests left out)."""
        stats = instance.engine.stats
        prompt, hits, output = self.warm.warm_tokens.get(instance.backend.id, (0, 0, 0))
        return stats.prompt_tokens - prompt, stats.hit_tokens - hits, stats.output_tokens - output

    def _timer(self, at: float, callback: Callable[[float], None]) -> None:
        self.counter += 1
        heapq.heappush(self.timers, (at, self.counter, callback))

    def _scale(self, event: ScaleEvent, now: float) -> None:
        if event.delta > 0:
            added = [self._add(now) for _ in range(event.delta)]
            for instance in added:
                self.warm.join(instance.backend.id, instance.engine, now)
        else:
            members = [i for i in reversed(self.order) if i in self.fleet]
            for backend_id in members[: -event.delta]:
                self.fleet.remove(backend_id)
                self.instances[backend_id].removed_at = now
        log.debug("fleet_scaled", at=now, delta=event.delta, members=len(self.fleet))

    def _refresh_loads(self) -> None:
        block_size = self.config.engine.block_size
        for state in self.fleet:
            engine = self.instances[state.id].engine
            stats = engine.stats
            per_rank: dict[str, Any] = {}
            if isinstance(engine, DataParallelEngine) and _RankLoad is not None:
                # What vLLM's metrics report per ``engine`` label (a core with per-rank load reads it).
                per_rank = {
                    "data_parallel_size": engine.size,
                    "ranks": tuple(
                        _RankLoad(rank=e.rank, running=e.num_running, waiting=e.num_waiting, kv_usage=e.kv_usage)
                        for e in engine.ranks
                    ),
                }
            state.load = EngineLoad(
                running=engine.num_running,
                waiting=engine.num_waiting,
                kv_usage=engine.kv_usage,
                prefix_cache_queries=float(stats.prompt_tokens),
                prefix_cache_hits=float(stats.hit_tokens),
                block_size=block_size,
                kv_blocks=engine.config.capacity_blocks * len(engine_ranks(engine)),
                **per_rank,
            )

    # -- events ----------------------------------------------------------------------------

    def _route(self, arrival: Arrival, now: float) -> None:
        if self.first_arrival is None:
            self.first_arrival = now
        self.last_arrival = now
        request = RouteRequest.from_openai(arrival.body, endpoint=arrival.endpoint, request_id=arrival.request_id)
        if self.objectives is not None:
            request = attrs.evolve(request, objectives=self.objectives)
        self._refresh_loads()
        objectives = request.objectives
        if self.shed and objectives is not None and objectives.priority is not Priority.CRITICAL:
            # Admission decides before the request is counted anywhere: a dry run of the same decision.
            try:
                dry, _ = self.router.decide(request)
            except NoBackendAvailable:
                dry = None
            if dry is not None and dry.prediction is not None and dry.prediction.meets(objectives) is False:
                self._reject(SHED, arrival, now)
                return
        try:
            lease = self.router.acquire(request)
        except NoBackendAvailable:
            self._reject(NO_BACKEND, arrival, now)
            return
        decision = lease.decision
        self.warm.observe(request)
        self.route_costs.append(decision.duration_s)
        self.decisions[decision.reason] = self.decisions.get(decision.reason, 0) + 1
        if decision.spilled:
            self.spills += 1
        instance = self.instances[decision.backend.id]
        engine_request = arrival.engine_request()
        refused = instance.engine.config.rejection(engine_request)
        if refused is not None:
            # The engine answers at once with an error (vLLM: HTTP 400) and serves the others.
            self.router.release(lease, Status.ERROR, refused.message)
            self._reject(refused.reason, arrival, now)
            return
        instance.requests += 1
        rank = getattr(decision, "data_parallel_rank", None)
        if rank is not None and isinstance(instance.engine, DataParallelEngine) and 0 <= rank < instance.engine.size:
            seq = instance.engine.submit(engine_request, now, rank)
        else:
            seq = instance.engine.submit(engine_request, now)
        join, moved = self.warm.window(request, now)
        self.flights[id(seq)] = _Flight(arrival, lease, instance, seq, join, moved)

    def _reject(self, reason: str, arrival: Arrival, now: float) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        log.debug("request_rejected", request_id=arrival.request_id, reason=reason, at=now)
        self._done(arrival.request_id, now)

    def _finish(self, seq: EngineSequence, now: float) -> None:
        flight = self.flights.pop(id(seq))
        tpot = None
        if seq.first_token_time is not None and seq.generated > 1:
            tpot = (now - seq.first_token_time) / (seq.generated - 1)
            self.tpots.append(tpot)
            predictor = self.router.predictor
            if predictor is not None:
                predictor.observe(flight.arrival.request_id, tpot_s=tpot)
        slo = self.objectives
        if slo is not None:
            ttft = seq.ttft
            if (
                ttft is not None
                and (slo.ttft_s is None or ttft <= slo.ttft_s)
                and (slo.tpot_s is None or tpot is None or tpot <= slo.tpot_s)
            ):
                self.slo_met += 1
        self.router.release(flight.lease)
        self.completed += 1
        self.last_finish = max(self.last_finish, now)
        self._done(flight.arrival.request_id, now)

    def _done(self, request_id: str, now: float) -> None:
        self.finished_at[request_id] = now
        for follower in self.waiting_for.pop(request_id, ()):
            self.counter += 1
            heapq.heappush(self.deferred, (now + follower.think_time, self.counter, follower))
        if self.progress is not None:
            self.progress(1)

    def _sample(self, upto: float) -> None:
        """Close every sampling window that ends at or before ``upto``."""
        width = self.config.sample_interval
        while self.window_start + width <= upto:
            prompt = sum(self._live(i)[0] for i in self.instances.values())
            hits = sum(self._live(i)[1] for i in self.instances.values())
            d_prompt, d_hits = prompt - self.window_tokens[0], hits - self.window_tokens[1]
            in_flight = {i: self.instances[i].engine.in_flight for i in self.order if i in self.fleet}
            self.timeline.append((self.window_start, d_hits / d_prompt if d_prompt else math.nan, in_flight))
            self.window_tokens = (prompt, hits)
            self.window_start += width

    def run(self) -> None:
        arrivals = self.arrivals
        scale = list(self.config.scale)
        ai = si = 0
        closed = self.config.closed_loop
        time_scale = self.config.time_scale
        instances = self.instances
        inf = math.inf
        while True:
            # Next engine event (a linear scan: fleets are small).
            t_engine, engine_id = inf, ""
            for backend_id, instance in instances.items():
                t = instance.engine.next_event_time()
                if t is not None and t < t_engine:
                    t_engine, engine_id = t, backend_id
            t_arrival = arrivals[ai].time * time_scale if ai < len(arrivals) else inf
            t_deferred = self.deferred[0][0] if self.deferred else inf
            t_scale = scale[si].time if si < len(scale) else inf
            t_timer = self.timers[0][0] if self.timers else inf
            now = min(t_engine, t_arrival, t_deferred, t_scale, t_timer)
            if now == inf:
                break
            self.now = now
            self._sample(now)
            if t_scale == now:
                self._scale(scale[si], now)
                si += 1
            elif t_timer == now:
                heapq.heappop(self.timers)[2](now)
            elif t_arrival == now or t_deferred == now:
                if t_deferred <= t_arrival:
                    arrival = heapq.heappop(self.deferred)[2]
                else:
                    arrival = arrivals[ai]
                    ai += 1
                    if closed and arrival.follows is not None:
                        done = self.finished_at.get(arrival.follows)
                        if done is None:
                            self.waiting_for.setdefault(arrival.follows, []).append(arrival)
                            continue
                        if done + arrival.think_time > now:
                            self.counter += 1
                            heapq.heappush(self.deferred, (done + arrival.think_time, self.counter, arrival))
                            continue
                self._route(arrival, now)
            else:
                result = instances[engine_id].engine.step(now)
                for seq in result.first_tokens:
                    flight = self.flights.get(id(seq))
                    if flight is None:  # a pre-fill request
                        continue
                    ttft = seq.ttft
                    assert ttft is not None
                    self.ttfts.append(ttft)
                    predictor = self.router.predictor
                    if predictor is not None:
                        predictor.observe(flight.arrival.request_id, ttft_s=ttft, cached_tokens=seq.cached_tokens)
                    if flight.join is not None:
                        flight.join.record(ttft, flight.moved)
                for seq in result.finished:
                    if self.warm.is_prefill(seq):
                        self.warm.prefill_done(seq, now)
                    else:
                        self._finish(seq, now)
        self._sample(self.last_finish + self.config.sample_interval)
        self.router.close()
        self.warm.close()

    # -- results ---------------------------------------------------------------------------

    def result(self, wall: float) -> StrategyResult:
        ttfts = sorted(self.ttfts)
        costs = sorted(self.route_costs)
        total_requests = sum(i.requests for i in self.instances.values()) or 1
        instances = []
        for backend_id in self.order:
            inst = self.instances[backend_id]
            stats = inst.engine.stats
            prompt_tokens, hit_tokens, output_tokens = self._live(inst)
            instances.append(
                InstanceResult(
                    id=backend_id,
                    requests=inst.requests,
                    share=inst.requests / total_requests,
                    prompt_tokens=prompt_tokens,
                    hit_tokens=hit_tokens,
                    output_tokens=output_tokens,
                    busy_time=stats.busy_time,
                    preemptions=stats.preemptions,
                    added_at=inst.added_at,
                    removed_at=inst.removed_at,
                )
            )
        # Balance over the instances present from the start to the end (scaled ones see part of the run).
        steady = [i for i in instances if i.added_at == 0.0 and i.removed_at is None] or instances
        steady_total = sum(i.requests for i in steady) or 1
        shares = [i.requests / steady_total for i in steady]
        prompt = sum(i.prompt_tokens for i in instances)
        hits = sum(i.hit_tokens for i in instances)
        output = sum(i.output_tokens for i in instances)
        start = self.first_arrival or 0.0
        makespan = max(self.last_finish - start, 0.0)
        return StrategyResult(
            strategy=self.strategy,
            options=self.options,
            requests=len(self.arrivals),
            completed=self.completed,
            rejected=sum(self.rejected.values()),
            rejected_reasons=dict(sorted(self.rejected.items())),
            ttft_p50=quantile(ttfts, 0.50),
            ttft_p90=quantile(ttfts, 0.90),
            ttft_p99=quantile(ttfts, 0.99),
            ttft_mean=sum(ttfts) / len(ttfts) if ttfts else math.nan,
            hit_rate=hits / prompt if prompt else 0.0,
            output_tokens=output,
            makespan=makespan,
            output_throughput=output / makespan if makespan > 0 else 0.0,
            share_min=min(shares) if shares else 0.0,
            share_max=max(shares) if shares else 0.0,
            spills=self.spills,
            route_cost_p50=quantile(costs, 0.50),
            route_cost_p99=quantile(costs, 0.99),
            preemptions=sum(i.preemptions for i in instances),
            wall_time=wall,
            instances=tuple(instances),
            decisions=dict(sorted(self.decisions.items())),
            timeline=tuple(self.timeline),
            ttfts=tuple(self.ttfts),
            joins=self.warm.results(),
            **self._slo_figures(makespan),
        )

    def _slo_figures(self, makespan: float) -> dict[str, Any]:
        """TPOT quantiles, goodput and attainment against the objectives, and the predictor's error."""
        tpots = sorted(self.tpots)
        figures: dict[str, Any] = {"tpot_p50": quantile(tpots, 0.50), "tpot_p99": quantile(tpots, 0.99)}
        if self.objectives is not None:
            # Attainment times the offered rate: met requests per second of the arrivals' window (with one
            # arrival, or all at once, of the makespan), so a backlog left at the end does not count against it.
            window = self.last_arrival - (self.first_arrival or 0.0)
            window = window * len(self.arrivals) / max(len(self.arrivals) - 1, 1) if window > 0 else makespan
            figures["slo_met"] = self.slo_met
            figures["goodput"] = self.slo_met / window if window > 0 else 0.0
            figures["attainment"] = self.slo_met / len(self.arrivals) if self.arrivals else math.nan
        slo = self.router.slo
        if slo is not None:
            errors = slo.predictor.errors
            figures["slo_moved"] = slo.moved
            figures["prediction_error_p50"] = errors.median_abs_error_s() if errors.count else math.nan
            figures["predicted_within_25"] = errors.within(0.25) if errors.count else math.nan
        return figures


def simulate(
    arrivals: Sequence[Arrival],
    strategy: str,
    options: Mapping[str, Any] | None = None,
    config: SimulationConfig | None = None,
    *,
    plugins: PluginManager | None = None,
    progress: Callable[[int], None] | None = None,
) -> StrategyResult:
    """Run ``arrivals`` (sorted by time) through the strategy registered as ``strategy``.

    ``progress`` is called with 1 each time a request is done (finished or rejected).
    Raises `ConfigError` for an unknown strategy or invalid options.
    """
    config = config or SimulationConfig()
    plugins = plugins or PluginManager()
    wall = time.perf_counter()
    run = _Run(arrivals, strategy, options or {}, config, plugins, progress)
    run.run()
    result = run.result(time.perf_counter() - wall)
    log.info(
        "strategy_simulated",
        strategy=strategy,
        requests=result.requests,
        hit_rate=round(result.hit_rate, 4),
        ttft_p50=round(result.ttft_p50, 4),
        wall_s=round(result.wall_time, 2),
    )
    return result


def compare(
    arrivals: Sequence[Arrival],
    strategies: Iterable[str],
    config: SimulationConfig | None = None,
    *,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    workload: str = "custom",
    plugins: PluginManager | None = None,
    progress: Callable[[int], None] | None = None,
) -> Comparison:
    """Run every strategy over the same arrivals; ``options`` maps a strategy name to its options.

    The comparison also holds the hit-rate upper bound and the pooled-LRU reference.
    """
    config = config or SimulationConfig()
    plugins = plugins or PluginManager()
    options = options or {}
    requests = [a.engine_request() for a in arrivals]
    hits, total = ideal_hit_tokens(requests, config.engine)
    pooled, _ = pooled_lru_hit_tokens(requests, config.fleet_blocks, config.engine)
    refused = _refusals(requests, config.engine)
    results = tuple(
        simulate(arrivals, name, options.get(name), config, plugins=plugins, progress=progress) for name in strategies
    )
    return Comparison(
        workload=workload,
        requests=len(arrivals),
        prompt_tokens=total,
        upper_bound_hit_rate=hits / total if total else 0.0,
        pooled_hit_rate=pooled / total if total else 0.0,
        config=config,
        results=results,
        scale=config.scale,
        rejected=sum(refused.values()),
        rejected_reasons=refused,
    )


def _refusals(requests: Iterable[EngineRequest], engine: EngineConfig) -> dict[str, int]:
    """Count the requests engines with these settings refuse, per reason."""
    counts: dict[str, int] = {}
    for request in requests:
        refused = engine.rejection(request)
        if refused is not None:
            counts[refused.reason] = counts.get(refused.reason, 0) + 1
    return dict(sorted(counts.items()))
