"""The ``bounded-cache`` strategy: consistent hashing that places new prefixes where they fit in KV memory.

Bounded-load bounds what a backend *runs* (requests in flight); this strategy also bounds what it
*keeps*: the KV cache footprint of the prefixes placed on it, relative to its KV capacity. When
the fleet's working set of prefixes is close to its total KV memory, hashing eight prefixes over
two engines often puts five on one, whose LRU then thrashes while the other has room.

A request's key and preference order are consistent-hash's (weighted rendezvous). Then:

1. **Held prefixes stay home.** If some candidate holds the key (`Footprints`: the router routed
   it there and the modelled LRU has not aged it out), those candidates come first, in the key's
   order.
2. **A prefix nobody holds goes where it fits.** Otherwise the candidates with *cache room* for
   its footprint come first, in the key's order (the backend the key went last, if any, first of
   them): so the rendezvous home when it has room. A backend holding ``held`` tokens has room for
   ``f`` more when

   * ``cache_factor``: ``held + f <= max(f, cache_factor * capacity * (total held + f) / total capacity)``
     (totals over the candidates): its share of the footprint stays within ``cache_factor`` of its
     share of the capacity, as bounded-load's ``load_factor`` keeps its share of requests;
   * ``cache_fill``: ``held + f <= cache_fill * capacity``, when every candidate reports its KV size;
     the rest of the cache is left to running requests.

   ``capacity`` is the engine's KV size in tokens (fresh ``EngineLoad.kv_blocks * block_size``) when
   every candidate reports it, else the backend's weight (then only ``cache_factor`` applies). When
   no candidate has room under both, those with room under ``cache_factor`` alone come first (the
   fill is a target, and the footprint only an estimate); when none has room at all, the order is
   the key's own: it goes home, as with consistent hashing.
3. **Requests in flight are bounded as bounded-load bounds them** (`LoadBound`, `choose`): the first
   backend of that order with room under ``load_factor`` / ``concurrency_threshold`` takes it.

The footprint of a request is its prompt in tokens: ``len(token_ids)`` when the caller sent tokens,
else the routing text's length divided by ``chars_per_token``. Decisions: ``resident`` (a holder),
``hash`` (a cold key's home had room), ``fitted`` (a cold key went to a later backend of its order
that had room; ``fitted`` counts them), ``spilled`` / ``least_loaded`` (bounded-load's limits).
``detail`` has ``home`` (the key's rendezvous home), ``footprint`` (tokens) and, off the home, ``rank``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from fractions import Fraction

import attrs
from kvroute_bounded_load import LoadBound, choose
from kvroute_consistent_hash import HELD_SLACK, CandidateView, ConsistentHash, Rendezvous
from kvroute_consistent_hash.shares import Shares

import kvroute
from kvroute.options import bool_option, float_option, int_option, optional_float_option, optional_int_option
from kvroute_bounded_cache.footprints import Footprints

__all__ = ["BoundedCache", "Footprints"]


def _ratio(value: float) -> tuple[int, int]:
    """``value`` as the decimal it prints as, numerator and denominator (``1.1`` is 11/10): exact integer tests."""
    exact = Fraction(repr(float(value)))
    return exact.numerator, exact.denominator


@functools.lru_cache(maxsize=256)
def _weight_units(weights: tuple[float, ...]) -> tuple[int, ...]:
    """Weights as whole numbers in the same proportions (each weight's decimal, over a common denominator)."""
    exact = [Fraction(repr(w)) for w in weights]
    scale = math.lcm(*(w.denominator for w in exact))
    return tuple(int(w * scale) for w in exact)


@attrs.define
class BoundedCache(ConsistentHash):
    """Consistent hashing with a bounded KV cache footprint per backend, and bounded loads.

    Options (besides consistent-hash's ``prefix``, ``prefix_length`` and ``cache_size``):

    * ``cache_factor`` (1.0-100.0 or ``off``, default 1.1): a backend's share of the placed
      footprint may exceed its share of the KV capacity by this factor before a new prefix
      goes elsewhere.
    * ``cache_fill`` (0.05-1.0 or ``off``, default 0.8): the fraction of a backend's KV cache
      that placed prefixes may fill (needs ``kv_blocks`` telemetry from every candidate).
    * ``chars_per_token`` (0.5-64.0, default 4.0): turns routing text into a token estimate.
    * ``index_keys`` (1-16,777,216, default 65536): keys remembered per backend when its KV
      size is unknown, and keys whose last backend is remembered.
    * ``load_factor``, ``concurrency_threshold``, ``min_capacity``, ``engine_load``: as bounded-load.
    * ``share_factor`` (default 1.1), ``key_factor`` (default off: the footprints bound what a backend
      keeps) and the other share options: as consistent-hash.
    """

    cache_factor: float | None = optional_float_option(1.1, min=1.0, max=100.0)
    cache_fill: float | None = optional_float_option(0.8, min=0.05, max=1.0)
    chars_per_token: float = float_option(4.0, min=0.5, max=64.0)
    index_keys: int = int_option(65536, min=1, max=1 << 24)
    load_factor: float | None = optional_float_option(1.25, min=1.0, max=100.0)
    concurrency_threshold: int | None = optional_int_option(min=1, max=1024)
    engine_load: bool = bool_option(False)
    min_capacity: int = int_option(16, min=0, max=1024)
    share_factor: float | None = optional_float_option(1.1, min=1.0, max=100.0)
    fitted: int = attrs.field(default=0, init=False)
    _bound: LoadBound = attrs.field(init=False)
    _footprints: Footprints = attrs.field(init=False)
    _members: dict[str, kvroute.BackendState] = attrs.field(factory=dict, init=False)
    _factor: tuple[int, int] | None = attrs.field(default=None, init=False)
    _fill: tuple[int, int] | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._bound = LoadBound(self.load_factor, self.concurrency_threshold, self.engine_load, self.min_capacity)
        self._footprints = Footprints(max_keys=self.index_keys)
        self._factor = None if self.cache_factor is None else _ratio(self.cache_factor)
        self._fill = None if self.cache_fill is None else _ratio(self.cache_fill)

    @property
    def footprints(self) -> Footprints:
        """Which keys each backend holds, as this strategy models it."""
        return self._footprints

    # -- callbacks ---------------------------------------------------------------------

    def on_fleet_change(self, event: kvroute.FleetEvent, members: Sequence[kvroute.BackendState]) -> None:
        super().on_fleet_change(event, members)
        self._members = {s.id: s for s in members}
        self._footprints.keep_only(self._members)

    def on_request_start(self, request: kvroute.RouteRequest, decision: kvroute.Decision) -> None:
        super().on_request_start(request, decision)
        if decision.reason == "fitted":
            self.fitted += 1
        footprint = decision.detail.get("footprint")
        if decision.key is None or not isinstance(footprint, int):
            return
        state = self._members.get(decision.backend.id)
        load = state.fresh_load() if state is not None else None
        capacity = load.kv_tokens if load is not None else None
        self._footprints.record(decision.backend.id, decision.key, footprint, capacity)

    # -- deciding ----------------------------------------------------------------------

    def footprint(self, request: kvroute.RouteRequest) -> int:
        """The request's prompt in tokens: the tokens it carries, else its text length over ``chars_per_token``."""
        if request.token_ids is not None:
            return len(request.token_ids)
        return math.ceil(len(request.text) / self.chars_per_token)

    def capacities(self, candidates: Sequence[kvroute.BackendState]) -> tuple[list[int], bool]:
        """Each candidate's capacity, and whether it is KV tokens (every candidate fresh) or else weights.

        Weights are turned into whole numbers in the same proportions, so that every test is exact.
        """
        tokens = []
        for state in candidates:
            load = state.fresh_load()
            size = load.kv_tokens if load is not None else None
            if not size:
                return list(_weight_units(tuple(s.backend.weight for s in candidates))), False
            tokens.append(size)
        return tokens, True

    def tier(self, held: int, footprint: int, capacity: int, totals: tuple[int, int], in_tokens: bool) -> int:
        """How well ``footprint`` more tokens fit a backend holding ``held`` of ``capacity``: 0 best, 2 worst.

        0: room under ``cache_factor`` and ``cache_fill``; 1: under ``cache_factor`` only (the
        fill is over, or the estimate of the footprint too high, everywhere); 2: no room.
        ``totals`` is (tokens held, capacity) over the candidates; ``in_tokens`` says whether
        the capacities are KV tokens (``cache_fill`` applies) or weights.
        """
        after = held + footprint
        if self._factor is not None and after > footprint:
            num, den = self._factor
            total_held, total_capacity = totals
            if after * total_capacity * den > num * capacity * (total_held + footprint):
                return 2
        if self._fill is None or not in_tokens:
            return 0
        num, den = self._fill
        return 0 if after * den <= num * capacity else 1

    def pick(self, request: kvroute.RouteRequest, candidates: Sequence[kvroute.BackendState]) -> kvroute.Decision:
        key = self.key(request)
        footprint = self.footprint(request)
        order = self._order(key, request.model, candidates)
        held = self._footprints
        shares = self._shares if request.affinity_key is None else None
        conversation = self._conversation(request) if shares is not None else None
        holder = None
        if conversation is not None and shares is not None:
            holder_id = shares.holder(conversation, order[0].id if order else None)
            holder = next((s for s in order if s.id == holder_id), None) if holder_id is not None else None
        holders = [s for s in order if held.holds(s.id, key)]
        if shares is not None and conversation is not None and holder is None:
            # A new conversation leaves the holders of its key when they are over their share: 1.375x it
            # (`HELD_SLACK`), or the share itself for a short key (its shared prefix under ``prefix_length``
            # characters), which is cheap to copy.
            total_weight = sum(s.backend.weight for s in candidates)
            short = self._group(request)[0].group < self._length
            slack = 1.0 if short else HELD_SLACK
            holders = [s for s in holders if shares.has_room(s.id, s.backend.weight, total_weight, slack)]
            if self.share_choices > 1:  # the least loaded of the key's copies first (`Shares.load`)
                holders.sort(key=lambda s: shares.load(s.id, s.backend.weight, self.share_conversations))
            if short and holders:
                idle = self._starved(order, shares, total_weight)
                if idle is not None and idle not in holders:
                    holders.insert(0, idle)
        if holder is not None:
            preferred = [holder] + [s for s in order if s is not holder]
        elif holders:
            preferred = holders + [s for s in order if s not in holders]
        else:
            capacities, in_tokens = self.capacities(candidates)
            capacity = {id(s): c for s, c in zip(candidates, capacities, strict=True)}
            totals = (sum(held.held(s.id) for s in candidates), sum(capacities))
            tiers = {id(s): self.tier(held.held(s.id), footprint, capacity[id(s)], totals, in_tokens) for s in order}
            last = held.last(key)
            if shares is None:
                # Stable: each tier in the key's order, but where the key went last first (it may still be cached).
                preferred = sorted(order, key=lambda s: (tiers[id(s)], s.id != last))
            else:
                # Among the backends with room under both cache limits, those with share room first
                # (`Shares`), then where the key went last; the other tiers as without shares.
                total_weight = sum(s.backend.weight for s in candidates)
                crowded = {
                    id(s)
                    for s in order
                    if not shares.has_room(s.id, s.backend.weight, total_weight)
                    or (key != conversation and not shares.has_key_room(s.id, s.backend.weight, total_weight, key))
                }
                # The share bound orders the backends where the prefix fits: under both cache limits, or under
                # cache_factor when the fill is over only for what is held there (the prefix alone fits it).
                fill = self._fill
                bounded = {
                    id(s)
                    for s in order
                    if tiers[id(s)] == 0
                    or (tiers[id(s)] == 1 and fill is not None and footprint * fill[1] <= fill[0] * capacity[id(s)])
                }
                preferred = sorted(
                    order, key=lambda s: (tiers[id(s)], id(s) in bounded and id(s) in crowded, s.id != last)
                )
                preferred = self._choose(preferred, tiers, crowded | (set(map(id, order)) - bounded), last)
        choice = choose(preferred, self._bound.measure(candidates))
        home = order[0]
        detail: dict[str, object] = {"home": home.id, "footprint": footprint}
        if choice.state is not home:
            detail["rank"] = next(rank for rank, s in enumerate(order) if s is choice.state)
        if choice.state is holder:
            detail["held"] = "conversation"
        if choice.reason == "first":
            reason = "held" if choice.state is holder and holder is not home else ""
            reason = reason or ("resident" if holders else "hash" if choice.state is home else "fitted")
            return kvroute.Decision(choice.state.backend, reason=reason, key=key, detail=detail)
        return kvroute.Decision(
            choice.state.backend,
            reason=choice.reason,
            key=key,
            spilled=choice.state is not preferred[0],
            detail=detail,
            spill_reason=choice.spill_reason,
        )

    def _starved(
        self, order: Sequence[kvroute.BackendState], shares: Shares, total_weight: float
    ) -> kvroute.BackendState | None:
        """The least loaded backend, if it is starved (`Shares.is_starved`: under ``1 / share_factor`` of its weight
        share of a full window): a short key's new conversation goes there before its holders."""
        if len(shares) < shares.size:
            return None
        idle = min(order, key=lambda s: shares.count(s.id) / s.backend.weight)
        return idle if shares.is_starved(idle.id, idle.backend.weight, total_weight) else None

    def _choose(
        self,
        preferred: list[kvroute.BackendState],
        tiers: dict[int, int],
        crowded: set[int],
        last: str | None,
    ) -> list[kvroute.BackendState]:
        """``preferred`` with its first ``share_choices`` backends in the order of their load (`Shares.load`: active
        conversations with ``share_conversations``, then recent requests), as far as they fit as well as the first
        (the same tier) and have share room (not in ``crowded``): the power of d choices, as consistent-hash's share
        bound takes them. Where the key went last stays first."""
        shares = self._shares
        if shares is None or self.share_choices < 2 or (preferred and preferred[0].id == last):
            return preferred
        count, tier = 0, tiers[id(preferred[0])] if preferred else 0
        for state in preferred[: self.share_choices]:
            if tiers[id(state)] != tier or id(state) in crowded:
                break
            count += 1
        if count < 2:
            return preferred

        def load(state: kvroute.BackendState) -> tuple[float, float]:
            return shares.load(state.id, state.backend.weight, self.share_conversations)

        return sorted(preferred[:count], key=load) + preferred[count:]

    def _order(
        self, key: int, model: str | None, candidates: Sequence[kvroute.BackendState]
    ) -> list[kvroute.BackendState]:
        """The candidates in the key's preference order (over the candidates alone when the snapshot misses some)."""
        placement = self._placement
        view = CandidateView(placement, candidates)
        if not view.foreign:
            found = [view.get(index) for index in placement.ranking(key, model)]
            order = [state for state in found if state is not None]
            if order:
                return order
        placement = Rendezvous(candidates, cache_size=0)
        return [placement.states[index] for index in placement.ranking(key, None)]


@kvroute.hookimpl
def kvroute_register_strategies(register: Callable[..., None]) -> None:
    register("bounded-cache", BoundedCache)
