"""Measuring placement: key samples, assignments, movement and the tolerances they are held to.

Pure functions with no test-framework dependency, shared by the Hypothesis state machine
(`kvroute.testing.ScalingStateMachine`), plugin tests and the benchmarks.

Tolerances
----------
A hash placement sends each of ``K`` independent keys to backend ``b`` with probability
``p_b = weight_b / total weight``, so ``b``'s count is Binomial(K, p_b): its share has standard
deviation ``sqrt(p_b (1 - p_b) / K)``. `Tolerance` allows ``z`` such deviations (default 6:
a correct placement exceeds it with probability about 2e-9 per check, so thousands of checks
per test run stay far from a false failure) plus an optional ``relative`` allowance for
placements with structural variance of their own (a ring with ``V`` virtual nodes per
backend adds a relative error of about ``1 / sqrt(V)``). The same bound applies to the
fraction of keys that move on a scale-out (they are the keys whose new home is the new
backend: Binomial(K, p_new)) and to how a removed backend's ``O`` orphaned keys spread over
the survivors (Binomial(O, p_survivor)).

Load caps
---------
`load_factor_cap` is the documented ``load_factor`` cap of bounded-load,
``max(min_capacity, ceil(load_factor * weight * (total + 1) / total weight))``, computed with
exact rational arithmetic on the numbers as written (``1.1`` is 11/10), so a whole value is
its own ceiling: no epsilon that would let one request more through, or one fewer.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction

import attrs

from kvroute.backend import Backend, BackendState
from kvroute.request import RouteRequest
from kvroute.strategy import Decision, Strategy

__all__ = [
    "Movement",
    "Tolerance",
    "assign",
    "backend_id_of",
    "exact",
    "load_factor_cap",
    "sample_requests",
    "shares",
    "weight_shares",
]


@attrs.frozen
class Tolerance:
    """How far a measured share may sit from its expectation: ``z`` binomial deviations plus ``relative * p``."""

    z: float = 6.0
    relative: float = 0.0

    def bound(self, p: float, n: int) -> float:
        """The allowed absolute deviation of a share with expectation ``p`` measured over ``n`` trials."""
        if n <= 0:
            return math.inf
        return self.z * math.sqrt(max(p * (1.0 - p), 0.0) / n) + self.relative * p

    def allows(self, observed: float, p: float, n: int) -> bool:
        """Whether ``observed`` (a share of ``n`` trials) is within the bound of ``p``."""
        return abs(observed - p) <= self.bound(p, n) + 1e-12

    def max_count(self, p: float, n: int) -> float:
        """The largest count out of ``n`` trials this tolerance accepts for a share ``p``."""
        return n * (p + self.bound(p, n))


def exact(value: float) -> Fraction:
    """``value`` as the decimal it prints as: ``exact(1.1) == Fraction(11, 10)``, not 1.1's binary neighbour."""
    return Fraction(repr(float(value)))


def load_factor_cap(
    load_factor: float, weight: float, total: int, weights: Iterable[float], min_capacity: int = 0
) -> int:
    """``max(min_capacity, ceil(load_factor * weight * (total + 1) / sum(weights)))``, exactly.

    ``total`` is the candidates' load before the new request and ``weights`` their weights; a
    backend with ``load`` in flight has room under ``load_factor`` when ``load + 1 <= cap``.
    """
    total_weight = sum((exact(w) for w in weights), Fraction(0))
    if total_weight <= 0:
        raise ValueError(f"load_factor_cap() needs a positive total weight (got {total_weight}).")
    share = exact(load_factor) * exact(weight) * (total + 1) / total_weight
    return max(min_capacity, math.ceil(share))


def sample_requests(
    count: int, *, seed: int = 0, model: str = "model", length: int = 64, prefix: str = ""
) -> list[RouteRequest]:
    """``count`` requests with distinct, deterministic routing texts (same seed, same texts)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz      ,.0123456789"
    out: list[RouteRequest] = []
    for i in range(count):
        body = "".join(rng.choices(alphabet, k=length))
        out.append(RouteRequest.from_text(f"{prefix}{i}:{body}", model=model, request_id=f"sample-{seed}-{i}"))
    return out


def backend_id_of(pick: object) -> str:
    """The backend id of whatever ``pick`` returned (a `Decision`, `Backend` or `BackendState`)."""
    if isinstance(pick, Decision):
        return pick.backend.id
    if isinstance(pick, BackendState):
        return pick.id
    if isinstance(pick, Backend):
        return pick.id
    raise TypeError(f"pick() must return a Decision, a Backend or a BackendState (got {type(pick).__name__}).")


def assign(strategy: Strategy, requests: Iterable[RouteRequest], candidates: Sequence[BackendState]) -> tuple[str, ...]:
    """The backend id ``strategy.pick`` chooses for each request, over fixed ``candidates`` (a dry run)."""
    if not candidates:
        raise ValueError("assign() needs at least one candidate (got none).")
    return tuple(backend_id_of(strategy.pick(request, candidates)) for request in requests)


def shares(assignment: Sequence[str]) -> dict[str, float]:
    """Each backend's share of an assignment."""
    total = len(assignment)
    return {b: n / total for b, n in Counter(assignment).items()} if total else {}


def weight_shares(states: Iterable[BackendState]) -> dict[str, float]:
    """Each backend's weight share: what a weighted placement should give it."""
    weights = {s.id: s.weight for s in states}
    total = sum(weights.values())
    return {b: w / total for b, w in weights.items()}


@attrs.frozen
class Movement:
    """What changed between two assignments of the same keys."""

    before: tuple[str, ...]
    after: tuple[str, ...]

    @property
    def moved(self) -> list[int]:
        """Indices of the keys whose backend changed."""
        return [i for i, (a, b) in enumerate(zip(self.before, self.after, strict=True)) if a != b]

    @property
    def fraction(self) -> float:
        """The fraction of keys that moved."""
        return len(self.moved) / len(self.before) if self.before else 0.0

    def destinations(self) -> Counter[str]:
        """How many moved keys each backend received."""
        return Counter(self.after[i] for i in self.moved)

    def origins(self) -> Counter[str]:
        """How many moved keys each backend lost."""
        return Counter(self.before[i] for i in self.moved)

    def owned_by(self, backend_id: str) -> int:
        """How many keys ``backend_id`` had before."""
        return sum(1 for b in self.before if b == backend_id)

    def worst_spread(self, expected: Mapping[str, float]) -> float:
        """The largest ratio of received keys to fair share (``expected`` shares of the moved keys)."""
        moved = len(self.moved)
        if not moved:
            return 0.0
        got = self.destinations()
        return max((got.get(b, 0) / (moved * p) for b, p in expected.items() if p > 0), default=0.0)
