"""Weighted rendezvous hashing (highest random weight) over a snapshot of the fleet.

Each backend gets a score per key: ``u`` is a stable hash of (key, backend id) mapped to
(0, 1), and the score is ``ln(u) / weight`` (the order of ``-weight / ln(u)``). A key's
*preference order* is the members sorted by score, highest first; its *home* is the first.
This gives, with no state but the membership and no coordination between processes:

* every process computes the same order (xxh3 hashes, ties broken by backend id);
* backend ``b`` is the home of a fraction ``weight_b / total weight`` of keys, exactly in
  expectation (the minimum of exponentials ``-ln(u) / w`` falls on ``b`` with that probability);
* adding ``b`` moves only the keys whose new home is ``b``; removing ``b`` moves only its
  keys, and each goes to its own second choice, so they spread over the survivors in
  proportion to weight; re-adding ``b`` gives it back exactly the keys it had;
* each key's order is an independent random permutation, so a key that spills (bounded
  load) has a stable second home, and spills of one busy backend spread over all others.

A pick is O(members) hash evaluations; homes and full orders are memoized per key in
LRU caches that live as long as the membership snapshot (see ``cache_size``).

Members that do not serve a model are left out of that model's order (`Backend.serves`).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat

import xxhash

from kvroute import BackendState
from kvroute.hashing import hash_parts

__all__ = ["CandidateView", "Rendezvous", "backend_seed"]

_h64 = xxhash.xxh3_64_intdigest
_LN_2_64 = 64 * math.log(2)
#: Upper bound on memoized full orders per snapshot (each is a tuple of member indices).
_MAX_RANKING_CACHE = 4096
#: Members in a key's memoized head (`Rendezvous.head`): enough for a walk past a few busy backends.
HEAD = 4


def backend_seed(backend_id: str) -> int:
    """The per-backend seed of its rendezvous scores: a stable hash of the backend id."""
    return hash_parts("kvroute-rendezvous-seed/1", backend_id)


def _log_u(h: int) -> float:
    # ln(u) for u = h / 2**64; ``| 1`` keeps u > 0 (changes no order that matters).
    return math.log(h | 1) - _LN_2_64


class _Subset:
    """The members that serve one model, in canonical order (by backend id), with HRW over them."""

    __slots__ = ("groups", "head", "home", "members", "ranking", "seeds", "uniform", "weights")

    def __init__(self, members: Sequence[int], states: Sequence[BackendState], cache_size: int) -> None:
        ordered = sorted(members, key=lambda i: states[i].backend.id)
        self.members: tuple[int, ...] = tuple(ordered)
        self.seeds: tuple[int, ...] = tuple(backend_seed(states[i].backend.id) for i in ordered)
        self.weights: tuple[float, ...] = tuple(states[i].backend.weight for i in ordered)
        self.uniform = len(set(self.weights)) <= 1
        # Members grouped by equal weight: within a group the score is monotone in the raw
        # hash, so a home needs one logarithm per group, not one per member.
        by_weight: dict[float, list[int]] = {}
        for pos, w in enumerate(self.weights):
            by_weight.setdefault(w, []).append(pos)
        self.groups: tuple[tuple[float, tuple[int, ...], tuple[int, ...]], ...] = tuple(
            (w, tuple(self.seeds[p] for p in poss), tuple(poss)) for w, poss in sorted(by_weight.items())
        )
        self.home: Callable[[int], int | None] = self._home
        self.ranking: Callable[[int], tuple[int, ...]] = self._ranking
        self.head: Callable[[int], tuple[int, ...]] = self._head
        if cache_size > 0:
            self.home = functools.lru_cache(maxsize=cache_size)(self._home)
            self.ranking = functools.lru_cache(maxsize=min(cache_size, _MAX_RANKING_CACHE))(self._ranking)
            self.head = functools.lru_cache(maxsize=cache_size)(self._head)

    def _home(self, key: int) -> int | None:
        seeds = self.seeds
        if not seeds:
            return None
        kb = key.to_bytes(8, "little")
        if self.uniform:
            scores = list(map(_h64, repeat(kb, len(seeds)), seeds))
            return self.members[scores.index(max(scores))]
        best: tuple[float, int, int] | None = None
        for weight, group_seeds, positions in self.groups:
            scores = list(map(_h64, repeat(kb, len(group_seeds)), group_seeds))
            top = max(scores)
            pos = positions[scores.index(top)]
            candidate = (_log_u(top) / weight, top, -pos)
            if best is None or candidate > best:
                best = candidate
        assert best is not None
        return self.members[-best[2]]

    def _head(self, key: int) -> tuple[int, ...]:
        """The first `HEAD` members of the key's order (all of them when there are fewer): O(members), no sort."""
        seeds = self.seeds
        kb = key.to_bytes(8, "little")
        raw = list(map(_h64, repeat(kb, len(seeds)), seeds))
        if self.uniform:
            top = heapq.nlargest(HEAD, range(len(seeds)), key=raw.__getitem__)
        else:
            scores = [(_log_u(h) / w, h) for h, w in zip(raw, self.weights, strict=True)]
            top = heapq.nlargest(HEAD, range(len(seeds)), key=scores.__getitem__)
        members = self.members
        return tuple(members[p] for p in top)

    def _ranking(self, key: int) -> tuple[int, ...]:
        seeds = self.seeds
        kb = key.to_bytes(8, "little")
        raw = list(map(_h64, repeat(kb, len(seeds)), seeds))
        order: list[int]
        if self.uniform:
            order = sorted(range(len(seeds)), key=raw.__getitem__, reverse=True)
        else:
            scores = [(_log_u(h) / w, h) for h, w in zip(raw, self.weights, strict=True)]
            order = sorted(range(len(seeds)), key=scores.__getitem__, reverse=True)
        members = self.members
        return tuple(members[p] for p in order)


class Rendezvous:
    """Rendezvous placement over one membership snapshot (every member, routable or not).

    ``states`` keeps the order it was given (the fleet's); indices returned by `home` and
    `ranking` point into it. Build a new one when membership or weights change; health and
    draining do not change placement (a key whose home is unroutable walks its order).
    """

    __slots__ = ("_all_serve_all", "_by_backend_id", "_by_object", "_cache_size", "_subsets", "states", "total_weight")

    def __init__(self, members: Iterable[BackendState], *, cache_size: int = 65536) -> None:
        self.states: tuple[BackendState, ...] = tuple(members)
        #: The members' total weight when the snapshot was taken (weight changes make a new snapshot).
        self.total_weight = sum(s.backend.weight for s in self.states)
        self._cache_size = cache_size
        self._by_object: dict[int, int] = {id(s): i for i, s in enumerate(self.states)}
        self._by_backend_id: dict[str, int] = {s.backend.id: i for i, s in enumerate(self.states)}
        self._all_serve_all = all(not s.models for s in self.states)
        self._subsets: dict[str | None, _Subset] = {}

    def __len__(self) -> int:
        return len(self.states)

    def signature(self) -> tuple[tuple[str, float, frozenset[str]], ...]:
        """What placement depends on: each member's id, weight and models (declared or reported), in fleet order."""
        return tuple((s.backend.id, s.backend.weight, s.models) for s in self.states)

    def subset(self, model: str | None) -> _Subset:
        """The members serving ``model`` (all of them when no member declares models)."""
        if self._all_serve_all:
            model = None
        found = self._subsets.get(model)
        if found is None:
            members = [i for i, s in enumerate(self.states) if s.serves(model)]
            found = self._subsets[model] = _Subset(members, self.states, self._cache_size)
        return found

    def home(self, key: int, model: str | None = None) -> int | None:
        """Index of the key's home among members serving ``model``; ``None`` if none serves it."""
        return self.subset(model).home(key)

    def ranking(self, key: int, model: str | None = None) -> tuple[int, ...]:
        """Indices of the members serving ``model``, in the key's preference order."""
        return self.subset(model).ranking(key)

    def head(self, key: int, model: str | None = None) -> tuple[int, ...]:
        """The first `HEAD` indices of `ranking` (all of them with fewer members), without sorting every member."""
        return self.subset(model).head(key)

    def preference(self, key: int, model: str | None = None) -> Iterator[BackendState]:
        """The members serving ``model``, in the key's preference order."""
        states = self.states
        return (states[i] for i in self.ranking(key, model))

    def member(self, backend_id: str) -> int | None:
        """Index of the member with id ``backend_id``; ``None`` if there is none."""
        return self._by_backend_id.get(backend_id)

    def index(self, state: BackendState) -> int | None:
        """Index of a member, by identity or else by backend id; ``None`` if it is not a member."""
        found = self._by_object.get(id(state))
        if found is not None and self.states[found] is state:
            return found
        return self._by_backend_id.get(state.backend.id)


class CandidateView:
    """Which members are candidates for one pick, answered in O(1) in the common case.

    The router passes the fleet's own `BackendState` objects, in fleet order, so when no
    backend is filtered out, member ``i`` is ``candidates[i]``. Otherwise a lookup table
    is built once per pick. ``foreign`` is true when some candidate is not a member (the
    strategy was not told about it): callers then place over the candidates alone.
    """

    __slots__ = ("_table", "candidates", "placement")

    def __init__(self, placement: Rendezvous, candidates: Sequence[BackendState]) -> None:
        self.placement = placement
        self.candidates = candidates
        self._table: dict[int, BackendState] | None = None

    def get(self, index: int) -> BackendState | None:
        """The candidate that is member ``index``, or ``None`` when that member is not a candidate."""
        candidates = self.candidates
        member = self.placement.states[index]
        if index < len(candidates) and candidates[index] is member:
            return member
        return self.table().get(index)

    def table(self) -> dict[int, BackendState]:
        """Member index -> candidate, for every candidate that is a member."""
        if self._table is None:
            placement = self.placement
            table: dict[int, BackendState] = {}
            for state in self.candidates:
                i = placement.index(state)
                if i is not None:
                    table[i] = state
            self._table = table
        return self._table

    @property
    def foreign(self) -> bool:
        """Whether some candidate is not a member of the placement's snapshot."""
        return len(self.candidates) > len(self.placement) or len(self.table()) < len(self.candidates)
