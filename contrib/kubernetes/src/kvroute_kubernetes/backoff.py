"""Capped exponential backoff between reconnects, with optional jitter from a seeded RNG."""

from __future__ import annotations

import random

import attrs

__all__ = ["Backoff"]


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"'{attribute.name}' must be a positive number of seconds (got {value!r}).")


def _fraction(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 <= value < 1:
        raise ValueError(f"'{attribute.name}' must be in [0, 1) (got {value!r}).")


@attrs.define
class Backoff:
    """``delay(n)`` for the n-th consecutive failure: ``initial * 2**(n-1)``, capped at ``maximum``.

    With ``jitter`` j > 0 each delay is multiplied by a factor drawn uniformly from [1 - j, 1 + j]
    (then capped), from ``random.Random(seed)``: the same seed gives the same delays, so replicas
    given different seeds spread their reconnects and tests stay reproducible.
    """

    initial: float = attrs.field(default=0.5, converter=float, validator=_positive)
    maximum: float = attrs.field(default=30.0, converter=float, validator=_positive)
    jitter: float = attrs.field(default=0.2, converter=float, validator=_fraction)
    seed: int | None = None
    _rng: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.maximum < self.initial:
            raise ValueError(f"'backoff_max' must be at least 'backoff_initial' (got {self.maximum} < {self.initial}).")
        self._rng = random.Random(self.seed)

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure in a row (``failures`` >= 1)."""
        if failures < 1:
            raise ValueError(f"'failures' must be at least 1 (got {failures}).")
        base = self.initial * 2.0 ** min(failures - 1, 64)
        if self.jitter:
            base *= 1.0 + self.jitter * (2.0 * self._rng.random() - 1.0)
        return min(base, self.maximum)
