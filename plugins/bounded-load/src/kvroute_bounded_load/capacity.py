"""Load bounds, reusable by any strategy that has a preference order for a request.

`LoadBound` holds the two limits and `LoadBound.measure` takes one pick's snapshot of the
candidates' loads (`Loads`). A backend *has room* when both limits that are set allow one
more request:

* ``load_factor`` (consistent hashing with bounded loads, Mirrokni-Thorup-Zadimoghaddam):
  ``load + 1 <= ceil(load_factor * weight * (total load + 1) / total weight)``, totals over
  the candidates. With ``load_factor >= 1`` the capacities add up to at least the total load
  plus one, so some candidate always has room;
* ``concurrency_threshold`` (SageMaker's ``ConcurrencyThreshold``): ``load < threshold``.

``min_capacity`` puts a floor under the first cap: ``max(min_capacity, ceil(...))``.

`choose` walks a preference order and returns the first candidate with room, or, when
every candidate is full, the least loaded (per unit of weight; ties go to the earlier in
the order), with the reason. A strategy with its own order (longest cached prefix first,
then a hash order, for example) calls it instead of re-implementing the walk.

What "load" means: the router's own count of requests in flight (``BackendState.in_flight``).
With ``engine_load=True`` it is ``max(in_flight, running + waiting)`` where the engine's
counts come from ``BackendState.fresh_load()`` (absent or stale telemetry is ignored): the
engine counts every router replica's requests, the router counts what it sent since the
last telemetry sample.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from operator import attrgetter, is_

import attrs

from kvroute import BackendState, SpillReason

__all__ = ["Choice", "LoadBound", "Loads", "capacity", "choose"]

_in_flight = attrgetter("in_flight")
_weight = attrgetter("backend.weight")
# Capacities are computed in floating point; this keeps ceil(1.1 * 10) at 11 and makes every
# process round the same way.
_EPSILON = 1e-9


def capacity(load_factor: float, weight: float, total: float, total_weight: float) -> int:
    """``ceil(load_factor * weight * (total + 1) / total_weight)``: the in-flight cap of one backend.

    ``total`` is the candidates' load before the new request; the cap counts the new one.
    """
    return max(1, math.ceil(load_factor * weight * (total + 1) / total_weight - _EPSILON))


@attrs.frozen
class LoadBound:
    """The limits a backend's load must respect to take one more request.

    ``load_factor`` ``None`` disables the relative bound, ``concurrency_threshold`` ``None``
    the absolute one; with both unset every candidate always has room. ``min_capacity`` is a
    floor under the relative cap: a backend with fewer requests in flight than that is never
    full under ``load_factor`` (engines batch many requests; a difference of one or two is
    not worth a cache miss).
    """

    load_factor: float | None = 1.25
    concurrency_threshold: int | None = None
    engine_load: bool = False
    min_capacity: int = 0

    def __attrs_post_init__(self) -> None:
        if self.load_factor is not None and not self.load_factor >= 1.0:
            raise ValueError(f"'load_factor' must be >= 1.0 or unset (got {self.load_factor!r}).")
        if self.concurrency_threshold is not None and self.concurrency_threshold < 1:
            raise ValueError(f"'concurrency_threshold' must be >= 1 or unset (got {self.concurrency_threshold!r}).")
        if self.min_capacity < 0:
            raise ValueError(f"'min_capacity' must be >= 0 (got {self.min_capacity!r}).")

    def measure(
        self,
        candidates: Sequence[BackendState],
        *,
        members: Sequence[BackendState] | None = None,
        members_weight: float | None = None,
    ) -> Loads:
        """Snapshot the candidates' loads for one decision (totals are computed when first needed).

        ``members`` with their total weight ``members_weight`` is a shortcut: when the
        candidates are exactly those objects, in that order, their total weight is not summed.
        """
        return Loads(self, candidates, members=members, members_weight=members_weight)


def engine_adjusted_load(state: BackendState) -> int:
    """``max(in_flight, running + waiting)`` from fresh engine telemetry, else ``in_flight``."""
    load = state.fresh_load()
    if load is None or (load.running is None and load.waiting is None):
        return state.in_flight
    return max(state.in_flight, (load.running or 0) + (load.waiting or 0))


class Loads:
    """One decision's view of the candidates' loads under a `LoadBound`."""

    __slots__ = ("_loads", "_members", "_members_weight", "_total", "_total_weight", "bound", "candidates")

    def __init__(
        self,
        bound: LoadBound,
        candidates: Sequence[BackendState],
        *,
        members: Sequence[BackendState] | None = None,
        members_weight: float | None = None,
    ) -> None:
        self.bound = bound
        self.candidates = candidates
        self._total: float | None = None
        self._total_weight: float | None = None
        self._members = members
        self._members_weight = members_weight
        self._loads: dict[int, int] | None = None
        if bound.engine_load:
            self._loads = {id(s): engine_adjusted_load(s) for s in candidates}

    def load(self, state: BackendState) -> int:
        """The load of one candidate as the bound counts it."""
        if self._loads is None:
            return state.in_flight
        found = self._loads.get(id(state))
        return engine_adjusted_load(state) if found is None else found

    @property
    def total(self) -> float:
        """The candidates' total load (before the request being placed)."""
        if self._total is None:
            self._total = (
                sum(self._loads.values()) if self._loads is not None else sum(map(_in_flight, self.candidates))
            )
        return self._total

    @property
    def total_weight(self) -> float:
        """The candidates' total weight."""
        if self._total_weight is None:
            members, candidates = self._members, self.candidates
            if (
                members is not None
                and self._members_weight is not None
                and len(members) == len(candidates)
                and all(map(is_, members, candidates))
            ):
                self._total_weight = self._members_weight
            else:
                self._total_weight = sum(map(_weight, candidates))
        return self._total_weight

    def capacity(self, state: BackendState) -> int | None:
        """The ``load_factor`` cap of one candidate, at least ``min_capacity`` (``None`` when ``load_factor`` is
        unset)."""
        lf = self.bound.load_factor
        if lf is None:
            return None
        return max(self.bound.min_capacity, capacity(lf, state.backend.weight, self.total, self.total_weight))

    def limit(self, state: BackendState) -> SpillReason | None:
        """``None`` when ``state`` has room for one more request, else which limit it hit.

        The threshold is checked first: ``concurrency_threshold``, then ``load_factor``.
        """
        load = self.load(state)
        threshold = self.bound.concurrency_threshold
        if threshold is not None and load >= threshold:
            return SpillReason.CONCURRENCY_THRESHOLD
        # Below the floor (and at 0: every cap is at least 1) there is room: skip the totals.
        if load >= self.bound.min_capacity and load > 0 and self.bound.load_factor is not None:
            cap = self.capacity(state)
            assert cap is not None
            if load + 1 > cap:
                return SpillReason.LOAD_FACTOR
        return None

    def least_loaded(self, order: Iterable[BackendState]) -> tuple[int, BackendState]:
        """The ``(rank, state)`` with the lowest load per unit of weight; ties go to the lower rank."""
        best: tuple[float, int, BackendState] | None = None
        for rank, state in enumerate(order):
            score = self.load(state) / state.backend.weight
            if best is None or score < best[0]:
                best = (score, rank, state)
        if best is None:
            raise ValueError("least_loaded() needs at least one backend (got an empty order).")
        return best[1], best[2]


@attrs.frozen
class Choice:
    """Where `choose` placed a request and why.

    ``reason``: ``first`` (the first backend of the order had room), ``spilled`` (a later one),
    ``least_loaded`` (every candidate was full). ``spill_reason`` says why the first backend
    was passed over (``concurrency_threshold`` or ``load_factor``); ``None`` for ``first``.
    """

    state: BackendState
    rank: int
    reason: str
    spill_reason: SpillReason | None = None

    @property
    def spilled(self) -> bool:
        return self.rank > 0


def choose(order: Iterable[BackendState], loads: Loads) -> Choice:
    """The first backend of ``order`` (candidates, best first) with room, else the least loaded.

    ``order`` must list candidates only, each at most once; it is walked lazily, so a long
    order costs only as far as the first backend with room. When all it lists are full, the
    least loaded of every candidate in ``loads`` is chosen. Raises ``ValueError`` if there is
    no candidate at all.
    """
    walked: list[BackendState] = []
    first_limit: str | None = None
    for rank, state in enumerate(order):
        hit = loads.limit(state)
        if hit is None:
            return Choice(state, rank, "first" if rank == 0 else "spilled", first_limit)
        if rank == 0:
            first_limit = hit
        walked.append(state)
    # Everyone walked is full: the least loaded of them, or of any candidate the order left out.
    seen = {id(s) for s in walked}
    everyone = walked + [c for c in loads.candidates if id(c) not in seen]
    if not everyone:
        raise ValueError("choose() needs at least one candidate (got an empty order).")
    rank, state = loads.least_loaded(everyone)
    return Choice(state, rank, "least_loaded", first_limit)
