"""kvroute.testing: the scaling state machine passes a correct placement and catches broken ones."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import kvroute
from kvroute import BackendState, Decision, FleetEvent, RouteRequest
from kvroute.hashing import hash64, hash_parts
from kvroute.testing import Claims, Movement, ScalingStateMachine, Tolerance, sample_requests

# Failing machines need room to find the failure (no shrinking: only that it fails matters here,
# and one failure is reported rather than a group); passing ones keep their default budget.
HUNT = settings(
    max_examples=60,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
    report_multiple_bugs=False,
)


def _score(request: RouteRequest, state: BackendState) -> float:
    h = hash_parts(request.text, state.id) | 1
    return (math.log(h) - 64 * math.log(2)) / state.weight


class Hrw(kvroute.BaseStrategy):
    """A textbook weighted rendezvous strategy, written here so the core tests need no plugin."""

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
        return Decision(max(candidates, key=lambda s: (_score(request, s), s.id)).backend, reason="hash")


class Modulo(kvroute.BaseStrategy):
    """hash mod N over the sorted candidates: deterministic, but moves most keys on any change."""

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> BackendState:
        ordered = sorted(candidates, key=lambda s: s.id)
        return ordered[hash64(request.text) % len(ordered)]


class PileOnFirst(kvroute.BaseStrategy):
    """Remembers every backend it ever saw; a key whose backend is gone goes to the first survivor."""

    def __init__(self) -> None:
        self.ever: dict[str, BackendState] = {}

    def on_fleet_change(self, event: FleetEvent, members: Sequence[BackendState]) -> None:
        for state in members:
            self.ever.setdefault(state.id, state)

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> BackendState:
        pool = {**self.ever, **{c.id: c for c in candidates}}
        home = max(pool.values(), key=lambda s: (_score(request, s), s.id)).id
        for state in candidates:
            if state.id == home:
                return state
        return min(candidates, key=lambda s: s.id)


class Coin(kvroute.BaseStrategy):
    """Uniformly random: claims nothing about placement."""

    def __init__(self) -> None:
        self.rng = random.Random(5)

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> BackendState:
        return self.rng.choice(list(candidates))


class Unweighted(Hrw):
    """Rendezvous that ignores weights: balanced by count, not by capacity."""

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
        best = max(candidates, key=lambda s: (hash_parts(request.text, s.id), s.id))
        return Decision(best.backend, reason="hash")


class HrwWithThreshold(Hrw):
    """Rendezvous with a concurrency threshold of 2 and least-loaded fallback, done right."""

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
        order = sorted(candidates, key=lambda s: (_score(request, s), s.id), reverse=True)
        for state in order:
            if state.in_flight < 2:
                return Decision(state.backend, reason="hash")
        return Decision(min(order, key=lambda s: s.in_flight / s.weight).backend, reason="least_loaded")


def _run(machine: type[ScalingStateMachine], budget: settings | None = None) -> None:
    run_state_machine_as_test(machine, settings=budget or machine.TestCase.settings)


class TestScalingStateMachine:
    def test_textbook_rendezvous_passes_every_claim(self) -> None:
        """Weighted rendezvous hashing satisfies determinism, minimal disruption, return and balance."""
        _run(ScalingStateMachine.for_strategy(Hrw, keys=600, max_examples=10, steps=20))

    def test_bounded_strategy_passes_its_load_claim(self) -> None:
        """A rendezvous walk under a threshold of 2 satisfies the bounded-load invariant."""
        _run(ScalingStateMachine.for_strategy(HrwWithThreshold, claims=Claims(concurrency_threshold=2), keys=200, max_examples=10))

    def test_claims_none_only_needs_candidates(self) -> None:
        """A random strategy with no claims runs every rule without a failure."""
        _run(ScalingStateMachine.for_strategy(Coin, claims=Claims.none(), keys=200, max_examples=10))

    def test_modulo_hashing_fails_minimal_disruption(self) -> None:
        """hash mod N moves keys between old backends on scale-out: the machine says so."""
        claims = Claims(deterministic=False, returns=False, balance=False)
        with pytest.raises(AssertionError, match=r"moved to other backends|keys of other backends moved"):
            _run(ScalingStateMachine.for_strategy(Modulo, claims=claims, keys=300), HUNT)

    def test_piling_orphans_on_one_survivor_fails_spread(self) -> None:
        """Sending a removed backend's keys to one survivor breaks the fair-share bound."""
        claims = Claims(deterministic=False, returns=False, balance=False)
        with pytest.raises(AssertionError, match="orphaned keys"):
            _run(ScalingStateMachine.for_strategy(PileOnFirst, claims=claims, keys=600), HUNT)

    def test_random_placement_fails_determinism(self) -> None:
        """A strategy that claims determinism but picks at random is caught."""
        claims = Claims(minimal_disruption=False, returns=False, balance=False)
        with pytest.raises(AssertionError, match="determinism"):
            _run(ScalingStateMachine.for_strategy(Coin, claims=claims, keys=200), HUNT)

    def test_ignoring_weights_fails_balance(self) -> None:
        """Shares that ignore capacity weights fall outside the balance tolerance."""
        claims = Claims(deterministic=False, minimal_disruption=False, returns=False)
        with pytest.raises(AssertionError, match="balance"):
            _run(ScalingStateMachine.for_strategy(Unweighted, claims=claims, keys=1000), HUNT)

    def test_ignoring_load_fails_bounded_load(self) -> None:
        """Pure hashing under a claimed threshold of 1 overloads a home: the machine says so."""
        claims = Claims(deterministic=False, minimal_disruption=False, returns=False, balance=False, concurrency_threshold=1)
        with pytest.raises(AssertionError, match="bounded load"):
            _run(ScalingStateMachine.for_strategy(Hrw, claims=claims, keys=50), HUNT)

    def test_for_strategy_configures_a_subclass(self) -> None:
        """for_strategy returns a configured subclass whose TestCase carries the run budget."""
        machine = ScalingStateMachine.for_strategy("random", {"seed": 3}, claims=Claims.none(), keys=10, max_examples=7)
        assert issubclass(machine, ScalingStateMachine)
        assert (machine.strategy_name, dict(machine.strategy_options), machine.keys) == ("random", {"seed": 3}, 10)
        assert machine.TestCase.settings.max_examples == 7
        assert ScalingStateMachine.keys == 1000


class TestTolerance:
    def test_binomial_bound(self) -> None:
        """The bound is z standard deviations of a binomial share plus the relative allowance."""
        assert Tolerance(z=6).bound(0.125, 2000) == pytest.approx(6 * math.sqrt(0.125 * 0.875 / 2000))
        assert Tolerance(z=0, relative=0.1).bound(0.5, 10) == pytest.approx(0.05)

    def test_allows_and_max_count(self) -> None:
        """allows() accepts exactly the shares within the bound; max_count scales it to counts."""
        tol = Tolerance(z=2)
        bound = tol.bound(0.25, 400)
        assert tol.allows(0.25 + bound * 0.99, 0.25, 400) and not tol.allows(0.25 + bound * 1.01, 0.25, 400)
        assert tol.max_count(0.25, 400) == pytest.approx(400 * (0.25 + bound))


class TestMovement:
    def test_moved_destinations_origins(self) -> None:
        """Movement lists moved keys, where they went and where they came from."""
        m = Movement(("a", "b", "a", "c"), ("a", "c", "c", "c"))
        assert m.moved == [1, 2] and m.fraction == 0.5
        assert dict(m.destinations()) == {"c": 2} and dict(m.origins()) == {"a": 1, "b": 1}
        assert m.owned_by("a") == 2
        assert m.worst_spread({"c": 0.5, "a": 0.5}) == pytest.approx(2.0)


class TestSampleRequests:
    def test_deterministic_and_distinct(self) -> None:
        """The same seed gives the same texts; the texts are distinct."""
        a, b = sample_requests(50, seed=1), sample_requests(50, seed=1)
        assert [r.text for r in a] == [r.text for r in b]
        assert len({r.text for r in a}) == 50
