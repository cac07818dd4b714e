"""Seeded content shared by the generated workloads and the trace replay, and JSON type guards."""

from __future__ import annotations

import math
import random
from typing import TypeGuard

from kvroute_simulator.tokens import Vocabulary

__all__ = ["draw_words", "is_int", "is_number", "seeded_rng"]


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[float]:
    """Whether ``value`` is a finite int or float and not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def seeded_rng(seed: int, *parts: object) -> random.Random:
    """Return an independent random stream for one purpose (seeding with a string is stable across runs)."""
    return random.Random(":".join(map(str, (seed, *parts))))


def draw_words(rng: random.Random, vocab: Vocabulary, n: int) -> tuple[int, ...]:
    """Return ``n`` word ids drawn uniformly from ``vocab``."""
    return tuple(rng.choices(vocab.word_ids(), k=n))
