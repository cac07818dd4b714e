"""SLO-aware choice: the router re-ranks any strategy's pick by predicted latency (`kvroute.predictor`).

`SloChoice` sits between the strategy and the lease, for every strategy alike (no plugin is
changed). With ``aware=True``, after the strategy picked its backend (its *home*: the cache home
of a prefix strategy):

* a request with objectives (`RouteRequest.objectives`) stays on its home when the home is
  predicted to meet them; otherwise it goes to the candidate within the load bound predicted to
  meet them at the lowest cost (``TTFT + tpot_weight * TPOT``), and when none is, where ``unmet``
  says (`UNMET_POLICIES`; its `Decision.prediction` then does not meet them: no candidate can);
* a request without objectives goes to the candidate of lowest cost, the home winning ties.

On a fleet of more than ``scan + 1`` candidates only ``scan`` of them besides the home are predicted
(a window starting where the request id's hash points), which bounds the added decision time; a
request with objectives that none of them meets has the other candidates predicted too, so that a
prediction that does not meet its objectives always means that no candidate within the load bound
is predicted to (the signal a host's admission acts on). Candidates at their load bound never count.

A re-ranking stays cheap on large fleets: each candidate's request-independent part is the
predictor's kept `Predictor.base` (recomputed only when that backend changed), and a candidate's
cached tokens are looked up only when bounds say it could win: one whose TTFT before any prefill, or
TPOT, already misses the objectives is passed over (unless ``unmet="cheapest"``, which ranks those
that miss), and for the sink one whose TTFT with the whole prompt uncached is not the longest yet.
The choice is the one predicting every candidate would make (a test holds it to that).

*Within the load bound* is bounded-load's rule: a candidate other than the home may take the
request while its in-flight count is below ``max(min_capacity, ceil(load_factor * weight *
(total in flight + 1) / total weight))``, so re-ranking never piles requests on one backend.

A candidate's uncached prompt tokens come from the choice's own `CacheView` (fed with every
request's final backend), except the home's when the strategy said how much it matched
(``matched_tokens`` and ``tokenized`` in `Decision.detail`, tokenizer-prefix's exact index) or
implements `ReuseEstimator`. With ``aware=False`` the strategy's pick stands and only gets its
prediction (for a host that admits or sheds on it).

A moved decision has reason ``slo``, ``spilled`` set, ``spill_reason`` ``slo``, the strategy's own
pick in ``detail["home"]`` and the predictions in ``detail``; every decision carries its
prediction, and ``detail["predicted_ttft_ms"]`` (``stale`` when the backend's telemetry was).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from kvroute.backend import BackendState
from kvroute.cache_view import CacheView, PromptBlocks
from kvroute.hashing import hash64
from kvroute.predictor import Predictor
from kvroute.request import RouteRequest
from kvroute.slo import Prediction
from kvroute.strategy import Decision

__all__ = ["SLO_REASON", "UNMET_POLICIES", "ReuseEstimator", "SloChoice"]

#: Where a request no candidate can serve in time goes: the strategy's pick (``home``, the default), the
#: candidate of lowest predicted cost within the load bound (``cheapest``), or the candidate of the longest
#: predicted TTFT, load bound or not (``sink``: late work piles up on one backend, so the others stay on
#: time). In the simulator past capacity ``sink`` raised goodput most and ``cheapest`` lowered it below the
#: plain strategy's (docs/performance.md).
UNMET_POLICIES = ("cheapest", "home", "sink")

#: `Decision.reason` and `Decision.spill_reason` of a request the SLO-aware choice moved off its home.
SLO_REASON = "slo"


@runtime_checkable
class ReuseEstimator(Protocol):
    """A strategy that can say how many prompt tokens each candidate holds (optional; used for the home)."""

    def cached_tokens(self, request: RouteRequest, decision: Decision) -> tuple[int, int] | None:
        """``(prompt tokens, tokens the decision's backend holds)`` for ``request``, or ``None`` if unknown."""
        ...


def _non_negative(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"'{name}' must be a non-negative number (got {value!r}).")


class SloChoice:
    """Predicts each decision's latency and, when ``aware``, re-ranks the strategy's pick (module docstring).

    Not thread-safe: the `Router` calls it under its fleet's lock.
    """

    def __init__(
        self,
        predictor: Predictor | None = None,
        *,
        aware: bool = True,
        tpot_weight: float = 50.0,
        load_factor: float = 1.25,
        min_capacity: int = 16,
        view: CacheView | None = None,
        unmet: str = "home",
        scan: int = 8,
        clock: Any = time.monotonic,
    ) -> None:
        if isinstance(scan, bool) or not isinstance(scan, int) or scan < 1:
            raise ValueError(f"'scan' must be a positive integer (got {scan!r}).")
        if unmet not in UNMET_POLICIES:
            raise ValueError(f"'unmet' must be one of {', '.join(UNMET_POLICIES)} (got {unmet!r}).")
        _non_negative("tpot_weight", tpot_weight)
        if isinstance(load_factor, bool) or not isinstance(load_factor, int | float) or not 1 <= load_factor < math.inf:
            raise ValueError(f"'load_factor' must be a number of at least 1 (got {load_factor!r}).")
        if isinstance(min_capacity, bool) or not isinstance(min_capacity, int) or min_capacity < 0:
            raise ValueError(f"'min_capacity' must be a non-negative integer (got {min_capacity!r}).")
        self.predictor = predictor or Predictor()
        self.aware = aware
        self.tpot_weight = float(tpot_weight)
        self.load_factor = float(load_factor)
        self.min_capacity = min_capacity
        self.view = view or CacheView(block_size=512)
        self.clock = clock
        #: At most this many candidates besides the home are predicted per decision (a window of the
        #: candidates starting where the request id's hash points), so the cost stays flat on large fleets.
        self.scan = scan
        #: Where a request goes when no candidate is predicted to meet its objectives (`UNMET_POLICIES`).
        self.unmet_policy = unmet
        #: Leased decisions moved off the strategy's pick, and leased requests with objectives no candidate
        #: was predicted to meet (counted in `started`, so dry runs do not count).
        self.moved = 0
        self.unmet = 0
        self._last: tuple[str, PromptBlocks, int] | None = None
        #: The last strategy `choose` saw and its ``cached_tokens`` (`ReuseEstimator`), if it has one.
        self._estimator_of: object = None
        self._estimate: Any = None

    # -- choosing ------------------------------------------------------------------------

    def _uncached(self, state: BackendState, blocks: PromptBlocks) -> int:
        return max(blocks.units - self.view.matched(state.backend.id, blocks), 0)

    def _home_uncached(
        self, request: RouteRequest, decision: Decision, state: BackendState, blocks: PromptBlocks, strategy: object
    ) -> int:
        detail: Mapping[str, Any] = decision.detail
        if "matched_tokens" in detail:
            matched, tokens = detail.get("matched_tokens"), detail.get("tokenized")
            if type(matched) is int and type(tokens) is int:
                return max(tokens - matched, 0)
        if strategy is not self._estimator_of:  # ReuseEstimator (isinstance on a Protocol is slow), looked up once
            self._estimator_of, self._estimate = strategy, getattr(strategy, "cached_tokens", None)
        estimate = self._estimate
        if estimate is not None:
            said = estimate(request, decision)
            if said is not None:
                return max(int(said[0]) - int(said[1]), 0)
        return self._uncached(state, blocks)

    def choose(
        self,
        request: RouteRequest,
        decision: Decision,
        state: BackendState,
        candidates: Sequence[BackendState],
        strategy: object = None,
        *,
        name: str | None = None,
        since: float | None = None,
    ) -> tuple[Decision, BackendState]:
        """The decision to make of the strategy's ``decision`` on ``state`` (see the module docstring).

        The router's stamp, so that it need not copy the decision again: ``name``, the strategy's name
        (`Decision.strategy`), and ``since``, the `time.perf_counter` reading the decision began at
        (`Decision.duration_s` is the time from there to the decision's making). Without them the
        decision keeps the strategy's fields.
        """
        now = self.clock()
        predictor = self.predictor
        blocks = self.view.blocks(request)
        home_uncached = self._home_uncached(request, decision, state, blocks, strategy)
        self._last = (request.request_id, blocks, home_uncached)
        if decision.data_parallel_rank is None:
            # The same arithmetic as the other candidates' (`_rerank`), so that equal predictions tie.
            ttft0, per_token, tpot, stale = predictor.base(state, now)
            home = Prediction(ttft0 + home_uncached * per_token, tpot, stale)
        else:
            home = predictor.predict(state, home_uncached, rank=decision.data_parallel_rank, now=now)
        objectives = request.objectives
        wants = objectives is not None and objectives.any
        if not self.aware or len(candidates) == 1 or (wants and home.meets(objectives)):
            return self._with(decision, home, name, since), state
        best_state, best, best_uncached = self._rerank(request, state, home, home_uncached, blocks, candidates, now)
        if best_state is state:
            return self._with(decision, home, name, since), state
        self._last = (request.request_id, blocks, best_uncached)
        detail: dict[str, Any] = {
            "home": state.id,
            "home_ttft_ms": round(home.ttft_s * 1000, 1),
            "predicted_ttft_ms": round(best.ttft_s * 1000, 1),
            "predicted_tpot_ms": round((best.tpot_s or 0.0) * 1000, 1),
        }
        if best.stale:
            detail["stale"] = True
        moved = Decision(
            best_state.backend,
            reason=SLO_REASON,
            strategy=decision.strategy if name is None else name,
            key=decision.key,
            spilled=True,
            detail=detail,
            duration_s=decision.duration_s if since is None else time.perf_counter() - since,
            spill_reason=SLO_REASON,
            prediction=best,
        )
        return moved, best_state

    def _rerank(
        self,
        request: RouteRequest,
        state: BackendState,
        home: Prediction,
        home_uncached: int,
        blocks: PromptBlocks,
        candidates: Sequence[BackendState],
        now: float,
    ) -> tuple[BackendState, Prediction, int]:
        """The candidate a request whose home does not meet its objectives (or has none) goes to.

        Each candidate's request-independent part comes from `Predictor.base` (kept per backend
        until it changes), and its uncached tokens are looked up only when a bound says it could
        beat the best so far: a candidate whose TTFT before any prefill, or TPOT, already misses the
        objectives cannot meet them, and one whose cost before prefill exceeds the best cannot win.
        """
        objectives = request.objectives
        wants = objectives is not None and objectives.any
        base_of = self.predictor.base
        # `Predictor.base`'s kept entries read in place (the call costs more than the lookup on large fleets).
        kept_of = self.predictor._bases.get
        matched = self.view.matched
        units = blocks.units
        weight = self.tpot_weight
        ttft_goal = math.inf
        tpot_goal = math.inf
        if wants:
            assert objectives is not None
            if objectives.ttft_s is not None:
                ttft_goal = objectives.ttft_s
            if objectives.tpot_s is not None:
                tpot_goal = objectives.tpot_s
        floor, factor = self.min_capacity, self.load_factor
        fair = -1.0  # computed at the first candidate whose in-flight count reaches ``min_capacity``
        capacity_of: dict[float, float] = {}

        home_tpot = home.tpot_s or 0.0
        best_state, best_ttft, best_tpot, best_stale = state, home.ttft_s, home_tpot, home.stale
        best_cost, best_uncached = home.ttft_s + weight * home_tpot, home_uncached
        best_meets = bool(wants and home.meets(objectives))
        sink = wants and self.unmet_policy == "sink"
        keep_misses = not wants or self.unmet_policy == "cheapest"
        worst_state, worst_ttft, worst_tpot, worst_stale, worst_uncached = (
            state,
            home.ttft_s,
            home_tpot,
            home.stale,
            home_uncached,
        )
        n = len(candidates)
        windows: list[Sequence[BackendState]] = [candidates]
        if n - 1 > self.scan:
            # A window of ``scan`` candidates first; the rest only when a request with objectives finds
            # none meeting them there (so a miss means no candidate within the bound can meet them).
            # Both are slices of the candidates rotated to start at ``start``, without rotating them all.
            start = hash64(request.request_id) % n
            stop = start + self.scan + 1
            if stop <= n:
                windows = [candidates[start:stop]]
                if wants:
                    windows.append([*candidates[stop:], *candidates[:start]])
            else:
                windows = [[*candidates[start:], *candidates[: stop - n]]]
                if wants:
                    windows.append(candidates[stop - n : start])
        for k, window in enumerate(windows):
            if k and best_meets:
                break
            for c in window:
                if c is state:
                    continue
                bounded = False
                if c.in_flight >= floor:
                    if fair < 0:
                        total = weight_sum = 0.0
                        for other in candidates:
                            total += other.in_flight
                            weight_sum += other.backend.weight
                        fair = (total + 1) / weight_sum if weight_sum > 0 else math.inf
                    w = c.backend.weight
                    capacity = capacity_of.get(w)
                    if capacity is None:
                        capacity = capacity_of[w] = max(floor, math.ceil(factor * w * fair))
                    bounded = c.in_flight >= capacity
                if bounded and not sink:
                    continue
                kept = kept_of(c.backend.id)
                if kept is not None and kept[0] is c.load and kept[1] == c.in_flight and now <= kept[2]:
                    ttft0, per_token, tpot, stale = kept[3]  # `Predictor.base`'s own test, inlined
                else:
                    ttft0, per_token, tpot, stale = base_of(c, now)
                if sink and ttft0 + units * per_token > worst_ttft:
                    uncached = max(units - matched(c.backend.id, blocks), 0)
                    ttft = ttft0 + uncached * per_token
                    if ttft > worst_ttft:
                        worst_state, worst_ttft, worst_tpot, worst_stale, worst_uncached = (
                            c,
                            ttft,
                            tpot,
                            stale,
                            uncached,
                        )
                if bounded:
                    continue
                if not keep_misses and (ttft0 > ttft_goal or tpot > tpot_goal):
                    continue  # cannot meet, and only the cheapest policy ranks candidates that miss
                # Bounds before the cache lookup: uncached tokens only add to TTFT and cost.
                least_cost = ttft0 + weight * tpot
                if wants:
                    could_meet = ttft0 <= ttft_goal and tpot <= tpot_goal
                    if best_meets:
                        if not could_meet or least_cost >= best_cost:
                            continue
                    elif not could_meet and least_cost >= best_cost:
                        continue
                elif least_cost >= best_cost:
                    continue
                uncached = max(units - matched(c.backend.id, blocks), 0)
                ttft = ttft0 + uncached * per_token
                c_cost = ttft + weight * tpot
                if wants:
                    meets = ttft <= ttft_goal and tpot <= tpot_goal
                    if (meets, -c_cost) <= (best_meets, -best_cost):
                        continue
                    best_meets = meets
                elif c_cost >= best_cost:
                    continue
                best_state, best_ttft, best_tpot, best_stale, best_cost, best_uncached = (
                    c,
                    ttft,
                    tpot,
                    stale,
                    c_cost,
                    uncached,
                )
        if wants and not best_meets:
            if self.unmet_policy == "home":
                return state, home, home_uncached
            if sink:
                best_state, best_ttft, best_tpot, best_stale, best_uncached = (
                    worst_state,
                    worst_ttft,
                    worst_tpot,
                    worst_stale,
                    worst_uncached,
                )
        if best_state is state:
            return state, home, home_uncached
        return best_state, Prediction(best_ttft, best_tpot, best_stale), best_uncached

    @staticmethod
    def _with(
        decision: Decision, prediction: Prediction, name: str | None = None, since: float | None = None
    ) -> Decision:
        """``decision`` with ``prediction`` (and the router's stamp, see `choose`)."""
        detail = dict(decision.detail)
        detail["predicted_ttft_ms"] = round(prediction.ttft_s * 1000, 1)
        if prediction.stale:
            detail["stale"] = True
        strategy = decision.strategy if name is None else name
        duration_s = decision.duration_s if since is None else time.perf_counter() - since
        if type(decision) is not Decision:  # a subclass may add fields: evolve copies them
            return attrs.evolve(
                decision, prediction=prediction, detail=detail, strategy=strategy, duration_s=duration_s
            )
        return Decision(
            backend=decision.backend,
            reason=decision.reason,
            strategy=strategy,
            key=decision.key,
            spilled=decision.spilled,
            detail=detail,
            duration_s=duration_s,
            spill_reason=decision.spill_reason,
            data_parallel_rank=decision.data_parallel_rank,
            prediction=prediction,
        )

    # -- accounting (the router) ---------------------------------------------------------

    def started(self, request: RouteRequest, decision: Decision, state: BackendState) -> None:
        """The request was counted on ``state``: record its prompt there and queue its prefill."""
        last = self._last
        self._last = None
        if last is not None and last[0] == request.request_id:
            _, blocks, uncached = last
        else:
            blocks = self.view.blocks(request)
            uncached = self._uncached(state, blocks)
        prediction = decision.prediction
        if decision.reason == SLO_REASON:
            self.moved += 1
        if prediction is not None and prediction.meets(request.objectives) is False:
            self.unmet += 1
        self.predictor.started(
            request.request_id,
            state,
            blocks.units,
            uncached,
            rank=decision.data_parallel_rank,
            prediction=prediction,
            now=self.clock(),
        )
        self.view.record(state, blocks)

    def finished(self, request: RouteRequest) -> None:
        """The request left its backend."""
        self.predictor.forget(request.request_id)

    def backend_left(self, backend_id: str) -> None:
        """A backend left the fleet: forget what its cache held and its rates."""
        self.view.forget(backend_id)
        self.predictor.forget_backend(backend_id)
