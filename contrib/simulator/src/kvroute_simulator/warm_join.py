"""Warm join in the simulator: each instance a scale event adds is measured, and pre-filled and/or ramped.

The mechanisms are the library's (:mod:`kvroute.warmup`); this module applies them to a run:

* with ``prefill`` set, every routed request's prefix is counted (`HotPrefixes`); when an
  instance joins, the router says in a dry run which of the hottest prefixes it now owns
  (`warm_plan`), the instance is drained, and their prefix-only requests (one output token)
  go to its engine, ``prefill_concurrency`` at a time; the last one to finish undrains it;
* with ``slow_start`` set, its weight ramps up once it serves (`SlowStart`), one step per timer;
* every join is measured over ``join_window`` seconds: a request arriving then *moved* when
  its home is the new instance, by a dry run of the same strategy on the fleet after the join,
  every member at full weight and idle (an "oracle" router), so the same requests count in
  every run over the same arrivals.

Pre-fill requests are not live traffic: their TTFTs are not recorded and their tokens are
kept apart (`warm_tokens`) so the run's figures can leave them out.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs

from kvroute.fleet import Fleet
from kvroute.request import RouteRequest
from kvroute.router import Router
from kvroute.warmup import HotPrefix, HotPrefixes, warm_plan
from kvroute_simulator.engine import DataParallelEngine, Engine
from kvroute_simulator.results import JoinResult, quantile
from kvroute_simulator.sequences import EngineRequest, EngineSequence
from kvroute_simulator.simulation_config import SimulationConfig
from kvroute_simulator.tokens import TokenSeq, vocabulary

__all__ = ["Join", "WarmJoins"]

#: ``schedule(at, callback)``: call ``callback(at)`` at virtual time ``at``.
Schedule = Callable[[float, Callable[[float], None]], None]


@attrs.define
class Join:
    """One instance's join: its pre-fill in progress, its home oracle, the TTFTs of its window's requests."""

    backend_id: str
    engine: Engine | DataParallelEngine
    time: float
    oracle: Router
    pending: list[HotPrefix] = attrs.field(factory=list)
    warming: int = 0
    warm_requests: int = 0
    serving_from: float | None = None
    moved: list[float] = attrs.field(factory=list)
    others: list[float] = attrs.field(factory=list)
    window_requests: int = 0

    def record(self, ttft: float, moved: bool) -> None:
        """Count the TTFT of a request of the window."""
        (self.moved if moved else self.others).append(ttft)

    def result(self) -> JoinResult:
        """The join's figures."""
        moved, others = sorted(self.moved), sorted(self.others)
        every = sorted(moved + others)
        return JoinResult(
            backend=self.backend_id,
            time=self.time,
            window_requests=self.window_requests,
            moved=len(moved),
            moved_ttft_p50=quantile(moved, 0.50),
            moved_ttft_p90=quantile(moved, 0.90),
            others_ttft_p90=quantile(others, 0.90),
            all_ttft_p90=quantile(every, 0.90),
            all_ttft_mean=sum(every) / len(every) if every else math.nan,
            warm_requests=self.warm_requests,
            serving_from=self.serving_from if self.serving_from is not None else math.nan,
        )


class WarmJoins:
    """The joins of one run; ``oracle(fleet)`` builds a router of the run's strategy over ``fleet``."""

    def __init__(
        self,
        config: SimulationConfig,
        fleet: Fleet,
        router: Router,
        oracle: Callable[[Fleet], Router],
        schedule: Schedule,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.router = router
        self.oracle = oracle
        self.schedule = schedule
        self.hot = HotPrefixes() if config.prefill > 0 else None
        self.joins: list[Join] = []
        self.warming: dict[int, Join] = {}  # id(EngineSequence) of a pre-fill request -> its join
        #: Per backend id: (prompt, hit, output) tokens of its pre-fill requests.
        self.warm_tokens: dict[str, tuple[int, int, int]] = {}

    def observe(self, request: RouteRequest) -> None:
        """Count a routed request's prefix (only when pre-filling)."""
        if self.hot is not None:
            self.hot.observe(request)

    def join(self, backend_id: str, engine: Engine | DataParallelEngine, now: float) -> None:
        """Start measuring a join; pre-fill the instance (drained meanwhile) and/or start its slow start."""
        oracle = self.oracle(Fleet([attrs.evolve(s.backend, weight=1.0) for s in self.fleet]))
        join = Join(backend_id, engine, now, oracle)
        self.joins.append(join)
        plan = [] if self.hot is None else warm_plan(self.router, backend_id, self.hot, self.config.prefill)
        if not plan:
            self._serve(join, now)
            return
        self.fleet.drain(backend_id)
        join.pending = plan[::-1]
        for _ in range(min(self.config.prefill_concurrency, len(plan))):
            self._warm_next(join, now)

    def is_prefill(self, seq: EngineSequence) -> bool:
        """Whether ``seq`` is a pre-fill request (not live traffic)."""
        return id(seq) in self.warming

    def prefill_done(self, seq: EngineSequence, now: float) -> None:
        """A pre-fill request finished: send the next, or let the instance serve when it was the last."""
        join = self.warming.pop(id(seq))
        prompt, hits, output = self.warm_tokens.get(join.backend_id, (0, 0, 0))
        self.warm_tokens[join.backend_id] = (
            prompt + len(seq.request.prompt),
            hits + (seq.cached_tokens or 0),
            output + seq.request.output_len,
        )
        join.warming -= 1
        present = join.backend_id in self.fleet
        if join.pending and present:
            self._warm_next(join, now)
        elif join.warming == 0:
            if present:
                self.fleet.drain(join.backend_id, False)
            self._serve(join, now)

    def window(self, request: RouteRequest, now: float) -> tuple[Join | None, bool]:
        """The join whose window ``now`` is in, and whether ``request``'s home is that join's instance.

        When windows overlap (instances added together or close in time), the request belongs
        to the join whose instance is its home, else to the latest. The join counts it.
        """
        active = [j for j in self.joins if j.time <= now < j.time + self.config.join_window]
        found: tuple[Join | None, bool] = ((active[-1] if active else None), False)
        for join in reversed(active):
            if join.oracle.decide(request)[0].backend.id == join.backend_id:
                found = (join, True)
                break
        if found[0] is not None:
            found[0].window_requests += 1
        return found

    def results(self) -> tuple[JoinResult, ...]:
        """Every join's figures, in the order they happened."""
        return tuple(join.result() for join in self.joins)

    def close(self) -> None:
        """Stop the oracles listening to their fleets."""
        for join in self.joins:
            join.oracle.close()

    def _warm_next(self, join: Join, now: float) -> None:
        """Send the next pre-fill request of ``join`` to its instance's engine."""
        body = join.pending.pop().body
        prompt = TokenSeq.of(vocabulary().render_chat(body["messages"]))
        request_id = f"warm-{join.backend_id}-{join.warm_requests}"
        seq = join.engine.submit(EngineRequest(request_id, prompt, 1, extra_key=body.get("cache_salt")), now)
        self.warming[id(seq)] = join
        join.warming += 1
        join.warm_requests += 1

    def _serve(self, join: Join, now: float) -> None:
        """The instance takes live traffic from ``now``: at full weight, or ramping up."""
        join.serving_from = now
        if self.config.slow_start is None or join.backend_id not in self.fleet:
            return
        ramp = self.config.slow_start.begin(self.fleet, join.backend_id, now)

        def step(at: float) -> None:
            due = ramp.advance(at)
            if due is not None:
                self.schedule(due, step)

        step(now)  # begin set the first weight; this schedules the next step
