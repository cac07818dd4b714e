"""The ``least-outstanding`` strategy: fewest requests in flight per unit of weight."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import attrs

import kvroute
from kvroute.options import bool_option, optional_int_option

__all__ = ["LeastOutstanding"]


@attrs.define
class LeastOutstanding(kvroute.BaseStrategy):
    """Pick the candidate with the lowest ``outstanding / weight``; ties are broken at random.

    ``outstanding`` is the router's own in-flight count. With ``engine_queue=true`` the
    engine's reported waiting queue is added when the backend's adapter reported it
    recently (stale telemetry is ignored), so that several router replicas, which each
    only count their own requests, still see a backend that is queueing.

    Options: ``seed`` (tie-breaks), ``engine_queue`` (default false).
    """

    seed: int | None = optional_int_option()
    engine_queue: bool = bool_option(False)
    _rng: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def _score(self, state: kvroute.BackendState) -> float:
        outstanding = float(state.in_flight)
        if self.engine_queue:
            load = state.fresh_load()
            if load is not None and load.waiting:
                outstanding += load.waiting
        return outstanding / state.weight

    def pick(self, request: kvroute.RouteRequest, candidates: Sequence[kvroute.BackendState]) -> kvroute.Decision:
        best: list[kvroute.BackendState] = []
        best_score = float("inf")
        for state in candidates:
            score = self._score(state)
            if score < best_score:
                best, best_score = [state], score
            elif score == best_score:
                best.append(state)
        chosen = best[0] if len(best) == 1 else best[self._rng.randrange(len(best))]
        return kvroute.Decision(
            chosen.backend,
            reason="least_loaded",
            detail={"outstanding_per_weight": round(best_score, 3), "ties": len(best)},
        )


@kvroute.hookimpl
def kvroute_register_strategies(register: Callable[..., None]) -> None:
    register("least-outstanding", LeastOutstanding)
