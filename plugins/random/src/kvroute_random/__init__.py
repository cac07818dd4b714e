"""The ``random`` strategy: uniform over candidates, proportional to weight when weights differ."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from itertools import accumulate

import attrs

import kvroute
from kvroute.options import optional_int_option

__all__ = ["RandomStrategy"]


@attrs.define
class RandomStrategy(kvroute.BaseStrategy):
    """Pick a candidate at random; P(backend) = weight / total weight.

    Options: ``seed`` (int, default unset = seeded from the OS) makes the sequence of picks
    reproducible for the same sequence of candidate lists.
    """

    seed: int | None = optional_int_option()
    _rng: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def pick(self, request: kvroute.RouteRequest, candidates: Sequence[kvroute.BackendState]) -> kvroute.Decision:
        first = candidates[0].weight
        if all(c.weight == first for c in candidates):
            chosen = candidates[self._rng.randrange(len(candidates))]
        else:
            cumulative = list(accumulate(c.weight for c in candidates))
            chosen = self._rng.choices(candidates, cum_weights=cumulative, k=1)[0]
        return kvroute.Decision(chosen.backend, reason="random")


@kvroute.hookimpl
def kvroute_register_strategies(register: Callable[..., None]) -> None:
    register("random", RandomStrategy)
