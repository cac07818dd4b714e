"""The choice (step 4 of `kvroute_tokenizer_prefix.strategy`): which candidate gets a request, given its matches.

* Cold (no candidate holds anything past the prompt's hot head): the key's rendezvous order,
  under the load bound without the ``min_capacity`` floor (the floor keeps hits, and a cold
  prompt has none to keep).
* Else: candidates ordered by ``matched tokens past the hot head - load_cost_tokens * load /
  weight``, best first, ties in the key's rendezvous order, under the placer's own bound.

Either way the ``bounded-load`` plugin's `choose` takes the first candidate with room, else
the least loaded. `Chooser.decide` is on the strategy's hot path: one call per ``pick``.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from kvroute_bounded_load import BoundedLoad, LoadBound, choose
from kvroute_consistent_hash import Rendezvous

import kvroute

__all__ = ["COLD_EVIDENCE", "EVIDENCE", "SHARE_FACTOR", "START_WINDOW", "Chooser", "StartWindow"]

#: Started requests per cache in the fleet that `StartWindow` keeps.
START_WINDOW = 256
#: A backend has *share room* while its count among the window's starts, plus one, is at most this many
#: times its weight share of them (`StartWindow.has_room`).
SHARE_FACTOR = 1.1
#: Starts the window must hold before a cold prompt's order looks at the shares: none (a cold prompt has no hits to
#: lose, and a burst's later siblings are not cold: they match the first one's blocks).
COLD_EVIDENCE = 0
#: Starts per candidate the window must hold before a new conversation leaves a holder for the shares: a fair
#: count of 64 varies by about 12 % (one standard deviation), the scale of the share factor, and each move
#: costs the shared prefix's prefill once more.
EVIDENCE = 64
_EPSILON = 1e-9
#: A cold prompt's order by use level (`StartWindow.levels`): the starved first, then the rest with share room.
_COLD_RANK = (0, 1, 1, 2)


@attrs.define
class StartWindow:
    """The backends of the last started requests (`START_WINDOW` per cache in the fleet), and how many each got.

    Requests another router replica started (its holds, ``kvroute serve --peer``) count too, so that
    replicas that share their holds measure the same use.
    """

    ids: deque[str] = attrs.field(factory=deque)
    counts: Counter[str] = attrs.field(factory=Counter)

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, backend: str, caches: int) -> None:
        """Count one started request on ``backend`` (the oldest leave the window)."""
        while len(self.ids) >= START_WINDOW * max(1, caches):
            gone = self.ids.popleft()
            left = self.counts[gone] - 1
            if left:
                self.counts[gone] = left
            else:
                del self.counts[gone]
        self.ids.append(backend)
        self.counts[backend] += 1

    def has_room(self, backend: str, weight: float, total_weight: float, factor: float = SHARE_FACTOR) -> bool:
        """Whether one more start keeps ``backend`` within ``factor`` times its weight share of the window."""
        cap = math.ceil(factor * weight * (len(self.ids) + 1) / total_weight - _EPSILON)
        return self.counts.get(backend, 0) + 1 <= max(1, cap)

    def room(self, candidates: Sequence[kvroute.BackendState], factor: float = SHARE_FACTOR) -> list[bool]:
        """`has_room` for each candidate (weight shares over the candidates)."""
        total = sum(state.backend.weight for state in candidates) or 1.0
        return [self.has_room(state.id, state.backend.weight, total, factor) for state in candidates]

    def levels(
        self, candidates: Sequence[kvroute.BackendState], factor: float = SHARE_FACTOR, evidence: int = 0
    ) -> list[int]:
        """Each candidate's use of its weight share of the window: 0 under ``1 / factor`` of it (*starved*), 1 under
        it, 2 within its share room (`has_room`), 3 without; all 1 until the window holds ``evidence`` starts."""
        if len(self.ids) < evidence:
            return [1] * len(candidates)
        total = sum(state.backend.weight for state in candidates) or 1.0
        seen = len(self.ids) + 1
        counts = self.counts
        out = []
        for state in candidates:
            share = state.backend.weight * seen / total
            used = counts.get(state.id, 0) + 1
            if used > max(1, math.ceil(factor * share - _EPSILON)):
                out.append(3)
            elif used * factor < share:
                out.append(0)
            else:
                out.append(1 if used < share else 2)
        return out

    def clear(self) -> None:
        """Forget every start."""
        self.ids.clear()
        self.counts.clear()


@attrs.define
class Chooser:
    """Orders a request's candidates (cold: by rendezvous rank; else by score) and takes the first with room."""

    #: The strategy's load-bounded placement: its rendezvous order and its bound.
    placer: BoundedLoad
    #: Tokens of match one unit of load per unit of weight is worth (the ``load_cost_tokens`` option).
    load_cost_tokens: float
    #: Cold prompts: how many of the key's first backends to take the least used of (1: the first with room).
    cold_choices: int = 1
    #: Requests started per backend id over the strategy's recent window (``cold_choices`` orders by them).
    recent_starts: Mapping[str, int] = attrs.field(factory=dict)
    _cold_bound: LoadBound = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        placer = self.placer
        self._cold_bound = LoadBound(
            placer.load_factor, placer.concurrency_threshold, placer.engine_load, min_capacity=0
        )

    def decide(
        self,
        key: int,
        model: str | None,
        candidates: Sequence[kvroute.BackendState],
        matched: list[int],
        best: int,
        hot: int,
        block_size: int,
        detail: dict[str, Any],
        credit: Sequence[float] | None = None,
        room: Sequence[int] | None = None,
        held: int | None = None,
    ) -> kvroute.Decision:
        """The decision for a request whose candidates hold ``matched`` leading blocks (``best`` at most), ``hot``
        of them hot.

        ``credit``: each candidate's match past the hot head in blocks, blocks on a slower tier
        counted at their tier's credit (``None``: every matched block counts one).
        ``room``: each candidate's use level (`StartWindow.levels`); a cold prompt's order then takes
        the starved candidates first, then those with share room (``None``: the key's order alone).
        ``held``: the candidate the key's last request went to (here or, through its holds, on another
        router replica); a cold prompt tries it first, a warm one among the best scores.

        Reason ``cold`` or ``prefix`` when the first of the order had room, else `choose`'s
        (``spilled``, ``least_loaded``). Adds ``matched_tokens`` (the chosen candidate's) and,
        on a spill, ``preferred`` to ``detail``, which becomes the decision's.
        """
        bs = block_size
        ranks = self._ranks(key, model, candidates)
        cold = best <= hot
        if cold:
            # Nothing past the hot head is cached anywhere, so no backend has hits to lose: the key's
            # rendezvous order under the bound without the min_capacity floor (which exists to keep hits).
            loads = self._cold_bound.measure(candidates)
            order = sorted(range(len(candidates)), key=ranks.__getitem__)
            if room is not None:
                # Stable: the starved first, then those with share room, then the rest, each in the key's order.
                order.sort(key=lambda j: _COLD_RANK[room[j]])
            choices = min(self.cold_choices, len(order))
            if choices > 1:
                # The key's first few, least used first (ties in the key's order), then the rest.
                used = self.recent_starts
                head = sorted(
                    order[:choices], key=lambda j: used.get(candidates[j].id, 0) / candidates[j].backend.weight
                )
                order[:choices] = head
            if held is not None:
                order.remove(held)
                order.insert(0, held)
        else:
            loads = self.placer.bound.measure(candidates)
            cost = self.load_cost_tokens
            scores = [
                max(0, m - hot) * bs - cost * loads.load(s) / s.backend.weight
                for m, s in zip(matched, candidates, strict=True)
            ]
            if credit is not None:
                scores = [
                    c * bs - cost * loads.load(s) / s.backend.weight for c, s in zip(credit, candidates, strict=True)
                ]
            order = sorted(range(len(candidates)), key=lambda j: (-scores[j], j != held, ranks[j]))
        choice = choose((candidates[j] for j in order), loads)
        chosen = next(j for j in order if candidates[j] is choice.state)
        first = candidates[order[0]]
        reason = choice.reason  # spilled or least_loaded
        if choice.reason == "first":
            reason = "cold" if cold else "prefix"
        detail["matched_tokens"] = matched[chosen] * bs
        spill_reason = None
        if choice.state is not first:
            detail["preferred"] = first.id
            spill_reason = choice.spill_reason
        return kvroute.Decision(
            choice.state.backend,
            reason=reason,
            key=key,
            spilled=choice.state is not first,
            detail=detail,
            spill_reason=spill_reason,
        )

    def _ranks(self, key: int, model: str | None, candidates: Sequence[kvroute.BackendState]) -> list[int]:
        """Each candidate's rank in the key's rendezvous order (over the candidates alone if one is unknown)."""
        placement = self.placer.placement
        order = placement.ranking(key, model)
        rank_of = {index: r for r, index in enumerate(order)}
        ranks = []
        for state in candidates:
            member = placement.index(state)
            r = rank_of.get(member) if member is not None else None
            if r is None:  # a candidate the placement does not know: rank over the candidates alone
                alone = Rendezvous(candidates, cache_size=0)
                position = {index: r for r, index in enumerate(alone.ranking(key, None))}
                return [position[i] for i in range(len(candidates))]
            ranks.append(r)
        return ranks
