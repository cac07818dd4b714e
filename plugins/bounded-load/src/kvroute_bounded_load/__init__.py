"""The ``bounded-load`` strategy: consistent hashing with bounded loads.

Each request's prefix key is placed as ``consistent-hash`` places it (weighted rendezvous
over the whole fleet). If the home has no room under the `LoadBound` (``load_factor``
relative cap, ``concurrency_threshold`` absolute cap), or cannot take requests at all, the
request walks the key's own preference order to the first candidate with room, so a
spilled prefix keeps a stable second home. If every candidate is full, the least loaded
one gets it: a request is never refused for being busy.

Other strategies reuse the load logic through `LoadBound`, `Loads` and `choose`
(see `kvroute_bounded_load.capacity`), or place a key of their own with `BoundedLoad.place`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import attrs
from kvroute_consistent_hash import CandidateView, ConsistentHash, Rendezvous, _balanced_decision

import kvroute
from kvroute.options import bool_option, int_option, optional_float_option, optional_int_option
from kvroute_bounded_load.capacity import Choice, LoadBound, Loads, capacity, choose, engine_adjusted_load

__all__ = ["BoundedLoad", "Choice", "LoadBound", "Loads", "capacity", "choose", "engine_adjusted_load"]


@attrs.define
class BoundedLoad(ConsistentHash):
    """Consistent hashing with bounded loads, plus SageMaker's concurrency threshold.

    Options (besides ``prefix``, ``prefix_length`` and ``cache_size`` from ``consistent-hash``, whose
    default key is the system prompt or, for a hot one, the conversation; see docs/strategies.md):

    * ``load_factor`` (1.0-100.0 or ``off``, default 1.25): a backend is full when its load
      reaches ``ceil(load_factor * weight * (total load + 1) / total weight)``.
    * ``concurrency_threshold`` (1-1024, default unset): a backend is full at that many
      requests in flight. With both set, a backend must be under both to take a request.
    * ``engine_load`` (default false): count ``max(in_flight, engine running + waiting)``
      from fresh engine telemetry, so limits mean the same with several router replicas.
    * ``min_capacity`` (0-1024, default 16): a floor under the ``load_factor`` cap; below it
      a backend is never full under ``load_factor``. An engine batching dozens of sequences
      is not overloaded at 3 requests in flight, and spilling there only loses cache hits
      (docs/strategies.md has the measurements). 0 gives the paper's bound exactly.
    * ``hot_replicas`` (1-64, default 1 = off): the most homes a hot key is spread over. A
      key with ``k`` requests in flight (on this router) gets ``ceil(k / max(average load per
      unit of weight, min_capacity))`` homes, at most ``hot_replicas``: the first ones of its
      order, and each request goes to the least loaded of them that has room.

    Decisions: ``hash`` (the home had room), ``replicated`` (another of a hot key's homes),
    ``spilled`` (a later backend of the key's order; ``spill_reason`` is ``load_factor``,
    ``concurrency_threshold`` or ``home_unroutable``), ``least_loaded`` (every candidate was
    full). Started spills are counted in ``spills`` and ``spill_reasons``, replicated
    placements in ``replicated``.
    """

    load_factor: float | None = optional_float_option(1.25, min=1.0, max=100.0)
    concurrency_threshold: int | None = optional_int_option(min=1, max=1024)
    engine_load: bool = bool_option(False)
    min_capacity: int = int_option(16, min=0, max=1024)
    hot_replicas: int = int_option(1, min=1, max=64)
    share_factor: float | None = optional_float_option(1.1, min=1.0, max=100.0)
    key_factor: float | None = optional_float_option(1.1, min=1.0, max=100.0)
    replicated: int = attrs.field(default=0, init=False)
    _bound: LoadBound = attrs.field(init=False)
    _key_in_flight: Counter[int] = attrs.field(factory=Counter, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._bound = LoadBound(self.load_factor, self.concurrency_threshold, self.engine_load, self.min_capacity)

    @property
    def bound(self) -> LoadBound:
        """The load limits this strategy applies."""
        return self._bound

    def on_request_start(self, request: kvroute.RouteRequest, decision: kvroute.Decision) -> None:
        super().on_request_start(request, decision)
        if decision.reason == "replicated":
            self.replicated += 1
        if self.hot_replicas > 1 and decision.key is not None:
            self._key_in_flight[decision.key] += 1

    def on_request_finish(
        self, request: kvroute.RouteRequest, decision: kvroute.Decision, outcome: kvroute.Outcome
    ) -> None:
        key = decision.key
        if self.hot_replicas > 1 and key is not None and key in self._key_in_flight:
            left = self._key_in_flight[key] - 1
            if left > 0:
                self._key_in_flight[key] = left
            else:
                del self._key_in_flight[key]  # only keys with requests in flight are kept

    def in_flight_for(self, key: int) -> int:
        """Requests in flight for ``key`` that this strategy placed (tracked when ``hot_replicas`` > 1)."""
        return self._key_in_flight.get(key, 0)

    def _replicate(
        self,
        key: int,
        model: str | None,
        placement: Rendezvous,
        view: CandidateView,
        loads: Loads,
        home_id: str,
    ) -> kvroute.Decision | None:
        """Spread a hot key over its first homes; ``None`` when it is not hot or none of them has room."""
        hot = self._key_in_flight.get(key, 0)
        if not hot:
            return None
        # A key's share of one backend: the average load per unit of weight, but never below
        # the floor under which a backend is not considered busy.
        average = max(1.0, float(self.min_capacity), (loads.total + 1) / loads.total_weight)
        replicas = min(self.hot_replicas, math.ceil(hot / average))
        if replicas < 2:
            return None
        best: tuple[float, int, kvroute.BackendState] | None = None
        found = 0
        for rank, index in enumerate(placement.ranking(key, model)):
            state = view.get(index)
            if state is None:
                continue
            found += 1
            if loads.limit(state) is None:
                score = loads.load(state) / state.backend.weight
                if best is None or score < best[0]:
                    best = (score, rank, state)
            if found == replicas:
                break
        if best is None:
            return None
        _, rank, state = best
        detail = {"home": home_id, "replicas": replicas, "rank": rank}
        return kvroute.Decision(state.backend, reason="hash" if rank == 0 else "replicated", key=key, detail=detail)

    def place(
        self,
        key: int,
        model: str | None,
        candidates: Sequence[kvroute.BackendState],
        *,
        conversation: int | None = None,
        choices: int = 1,
        balance: bool = False,
        short: bool = False,
    ) -> kvroute.Decision:
        """Place an already computed key under both bounds: the first of `ConsistentHash.balanced`'s order with room.

        With ``balance`` (`pick` sets it): the backend holding the key's conversation (or the key),
        else the first backend of the key's order with share room, as long as it has room for a
        request; else the next with room, else the least loaded. Without it (a session id placed by
        the session table, which every replica must place alike), with the share bound off, or for a
        hot key being replicated: `place_home`.
        """
        balanced = None
        if balance and not (self.hot_replicas > 1 and key in self._key_in_flight):
            balanced = self.balanced(key, model, candidates, conversation, choices, short)
        if balanced is None:
            return self.place_home(key, model, candidates)
        loads = self._bound.measure(
            candidates, members=self._placement.states, members_weight=self._placement.total_weight
        )
        first = next(balanced.preferred())
        hit = loads.limit(first)
        if hit is None:
            return _balanced_decision(balanced, first, key)

        def rest() -> Iterator[kvroute.BackendState]:
            # Past a full first choice, the key's own order: a spilled key keeps a stable second home.
            yield first
            yield from (state for state in balanced.order if state is not first)

        choice = choose(rest(), loads)
        detail: dict[str, object] = {"home": balanced.home_id, "rank": balanced.rank(choice.state)}
        spill_reason = hit if balanced.home is not None else kvroute.SpillReason.HOME_UNROUTABLE
        if choice.reason == "least_loaded":
            return kvroute.Decision(
                choice.state.backend,
                reason="least_loaded",
                key=key,
                spilled=choice.state is not first,
                detail=detail,
                spill_reason=spill_reason,
            )
        return kvroute.Decision(
            choice.state.backend, reason="spilled", key=key, spilled=True, detail=detail, spill_reason=spill_reason
        )

    def place_home(self, key: int, model: str | None, candidates: Sequence[kvroute.BackendState]) -> kvroute.Decision:
        """Place an already computed key: its home if it has room, else the next with room, else the least loaded."""
        placement = self._placement
        loads = self._bound.measure(candidates, members=placement.states, members_weight=placement.total_weight)
        view = CandidateView(placement, candidates)
        home = placement.home(key, model)
        home_state = None if home is None else view.get(home)
        if self.hot_replicas > 1 and key in self._key_in_flight and home is not None and not view.foreign:
            replicated = self._replicate(key, model, placement, view, loads, placement.states[home].id)
            if replicated is not None:
                return replicated
        if home_state is not None:
            hit = loads.limit(home_state)
            if hit is None:
                return kvroute.Decision(home_state.backend, reason="hash", key=key, detail={"home": home_state.id})
        elif home is None or view.foreign:
            # The snapshot does not cover these candidates: rendezvous over the candidates alone.
            placement = Rendezvous(candidates, cache_size=0)
            view = CandidateView(placement, candidates)
            model = None
            home = placement.home(key, model)
            assert home is not None
            home_state = view.get(home)
            assert home_state is not None
            hit = loads.limit(home_state)
            if hit is None:
                return kvroute.Decision(home_state.backend, reason="hash", key=key, detail={"home": home_state.id})
        assert home is not None
        home_id = placement.states[home].id
        ranks: dict[int, int] = {}

        def order() -> Iterator[kvroute.BackendState]:
            for rank, index in enumerate(placement.ranking(key, model)):
                state = view.get(index)
                if state is not None:
                    ranks[id(state)] = rank
                    yield state

        choice = choose(order(), loads)
        spill_reason = choice.spill_reason if home_state is not None else kvroute.SpillReason.HOME_UNROUTABLE
        detail: dict[str, object] = {"home": home_id, "rank": ranks.get(id(choice.state))}
        if choice.reason == "least_loaded":
            return kvroute.Decision(
                choice.state.backend,
                reason="least_loaded",
                key=key,
                spilled=choice.state is not home_state,
                detail=detail,
                spill_reason=spill_reason,
            )
        return kvroute.Decision(
            choice.state.backend, reason="spilled", key=key, spilled=True, detail=detail, spill_reason=spill_reason
        )


@kvroute.hookimpl
def kvroute_register_strategies(register: Callable[..., None]) -> None:
    register("bounded-load", BoundedLoad)
