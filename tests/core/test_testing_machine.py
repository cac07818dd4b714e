"""kvroute.testing: the scaling state machine passes a correct placement and catches broken ones."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from fractions import Fraction

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings

import kvroute
from kvroute import BackendState, Decision, FleetEvent, RouteRequest
from kvroute.hashing import hash64, hash_parts
from kvroute.testing import Claims, Coverage, Movement, ScalingStateMachine, Tolerance, load_factor_cap, sample_requests

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


class HrwWithCap(Hrw):
    """Rendezvous walk under bounded-load's load_factor cap, done right: the key's first backend with room."""

    def __init__(self, load_factor: float = 1.25, min_capacity: int = 0) -> None:
        self.load_factor, self.min_capacity = load_factor, min_capacity

    def share(self, state: BackendState, candidates: Sequence[BackendState]) -> Fraction:
        """``load_factor * weight * (total + 1) / total weight``, exactly (the numbers as written)."""
        total = sum(c.in_flight for c in candidates)
        total_weight = sum(Fraction(repr(c.weight)) for c in candidates)
        return Fraction(repr(self.load_factor)) * Fraction(repr(state.weight)) * (total + 1) / total_weight

    def cap(self, state: BackendState, candidates: Sequence[BackendState]) -> int:
        return max(self.min_capacity, math.ceil(self.share(state, candidates)))

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
        order = sorted(candidates, key=lambda s: (_score(request, s), s.id), reverse=True)
        for state in order:
            if state.in_flight + 1 <= self.cap(state, candidates):
                return Decision(state.backend, reason="hash")
        return Decision(min(order, key=lambda s: s.in_flight / s.weight).backend, reason="least_loaded")


class CapOneMore(HrwWithCap):
    """The cap as ``floor(x) + 1``: right when x is fractional, one request too many when x is whole."""

    def cap(self, state: BackendState, candidates: Sequence[BackendState]) -> int:
        return max(self.min_capacity, math.floor(self.share(state, candidates)) + 1)


class CapIgnoringLoadFactor(HrwWithCap):
    """The cap at the fair share ``weight * (total + 1) / total weight`` times 2, whatever load_factor says."""

    def cap(self, state: BackendState, candidates: Sequence[BackendState]) -> int:
        return max(self.min_capacity, math.ceil(2 * self.share(state, candidates) / Fraction(repr(self.load_factor))))


class CapIgnoringWeights(HrwWithCap):
    """The cap as if every backend had the same weight: a small backend may take a big one's share."""

    def cap(self, state: BackendState, candidates: Sequence[BackendState]) -> int:
        total = sum(c.in_flight for c in candidates)
        return max(self.min_capacity, math.ceil(Fraction(repr(self.load_factor)) * (total + 1) / len(candidates)))


class CapFloorTooHigh(HrwWithCap):
    """A floor one above the ``min_capacity`` it claims."""

    def cap(self, state: BackendState, candidates: Sequence[BackendState]) -> int:
        return max(self.min_capacity + 1, math.ceil(self.share(state, candidates)))


class Fewest(kvroute.BaseStrategy):
    """The fewest requests in flight per unit of weight, ties to the lowest id."""

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> BackendState:
        return min(candidates, key=lambda s: (s.in_flight / s.weight, s.id))


class FewestByCount(kvroute.BaseStrategy):
    """The fewest requests in flight, ignoring weights."""

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> BackendState:
        return min(candidates, key=lambda s: (s.in_flight, s.id))


class Scribbler(Hrw):
    """Counts its own picks in ``in_flight``: a write the fleet's owner never sees coming."""

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
        decision = super().pick(request, candidates)
        for state in candidates:
            if state.id == decision.backend.id:
                state.in_flight += 1
        return decision


def _run(machine: type[ScalingStateMachine], budget: settings | None = None) -> Coverage:
    return machine.run(budget)


class TestScalingStateMachine:
    def test_textbook_rendezvous_passes_every_claim(self) -> None:
        """Weighted rendezvous hashing satisfies determinism, minimal disruption, return and balance."""
        _run(ScalingStateMachine.for_strategy(Hrw, keys=600, max_examples=10, steps=20))

    def test_bounded_strategy_passes_its_load_claim(self) -> None:
        """A rendezvous walk under a threshold of 2 satisfies the bounded-load invariant."""
        _run(
            ScalingStateMachine.for_strategy(
                HrwWithThreshold, claims=Claims(concurrency_threshold=2), keys=200, max_examples=10
            )
        )

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
        claims = Claims(
            deterministic=False, minimal_disruption=False, returns=False, balance=False, concurrency_threshold=1
        )
        with pytest.raises(AssertionError, match="bounded load"):
            _run(ScalingStateMachine.for_strategy(Hrw, claims=claims, keys=50), HUNT)

    def test_for_strategy_configures_a_subclass(self) -> None:
        """for_strategy returns a configured subclass whose TestCase (its own) carries the run budget."""
        machine = ScalingStateMachine.for_strategy(
            "random", {"seed": 3}, claims=Claims.none(), keys=10, burst=5, max_examples=7
        )
        assert issubclass(machine, ScalingStateMachine)
        assert (machine.strategy_name, dict(machine.strategy_options), machine.keys) == ("random", {"seed": 3}, 10)
        assert (machine.burst, ScalingStateMachine.burst) == (5, 0)
        assert machine.TestCase.settings.max_examples == 7
        assert machine.TestCase is machine.TestCase and machine.TestCase is not ScalingStateMachine.TestCase
        assert ScalingStateMachine.keys == 1000

    def test_writing_in_flight_fails_conservation(self) -> None:
        """A strategy that writes the in-flight counts it reads breaks conservation, even with no claim at all."""
        with pytest.raises(AssertionError, match="in-flight conservation"):
            _run(ScalingStateMachine.for_strategy(Scribbler, claims=Claims.none(), keys=50), HUNT)


class TestLoadFactorClaim:
    """The load_factor invariant holds strategies to the exact documented cap, not one request more."""

    CLAIM = Claims(deterministic=False, minimal_disruption=False, returns=False, balance=False, load_factor=1.25)

    def test_exact_cap_passes_and_reaches_the_cap(self) -> None:
        """A walk under the exact cap passes every claim, and the run met candidates exactly at their cap."""
        machine = ScalingStateMachine.for_strategy(
            HrwWithCap, claims=Claims(load_factor=1.25), keys=300, max_examples=12
        )
        coverage = _run(machine)
        assert coverage.live["load_factor"] > 0 and coverage.at_cap > 0, coverage

    def test_floor_of_min_capacity_16_binds(self) -> None:
        """With min_capacity=16 the machine's bursts still fill backends to the cap, so the check is live."""
        claims = attrs.evolve(self.CLAIM, min_capacity=16)
        machine = ScalingStateMachine.for_strategy(
            HrwWithCap, {"min_capacity": 16}, claims=claims, keys=50, max_examples=12
        )
        coverage = _run(machine)
        assert coverage.live["load_factor"] > 0 and coverage.at_cap > 0, coverage

    @pytest.mark.parametrize(
        ("strategy", "options", "claims"),
        [
            (CapOneMore, {}, CLAIM),
            (CapOneMore, {"load_factor": 1.5}, attrs.evolve(CLAIM, load_factor=1.5)),
            (CapIgnoringLoadFactor, {}, CLAIM),
            (CapIgnoringWeights, {}, CLAIM),
            (CapFloorTooHigh, {"min_capacity": 2}, attrs.evolve(CLAIM, min_capacity=2)),
            (Hrw, {}, CLAIM),
        ],
        ids=[
            "floor-plus-one",
            "floor-plus-one-lf-1.5",
            "ignores-load-factor",
            "ignores-weights",
            "floor-too-high",
            "no-cap",
        ],
    )
    def test_wrong_cap_fails(
        self, strategy: type[kvroute.BaseStrategy], options: dict[str, object], claims: Claims
    ) -> None:
        """A cap that lets one request more through than the documented bound, in any state, is caught."""
        with pytest.raises(AssertionError, match=r"bounded load: placed on .* full under load_factor cap"):
            _run(ScalingStateMachine.for_strategy(strategy, options, claims=claims, keys=50), HUNT)

    def test_claim_that_never_binds_fails(self) -> None:
        """A run in which no candidate is ever full under the claimed cap fails: its check could not have."""
        claims = attrs.evolve(self.CLAIM, min_capacity=1000)
        machine = ScalingStateMachine.for_strategy(
            HrwWithCap, {"min_capacity": 1000}, claims=claims, keys=50, burst=4, max_examples=5
        )
        with pytest.raises(AssertionError, match="the load_factor check never met a candidate full"):
            _run(machine)

    def test_cap_is_exact_at_whole_values(self) -> None:
        """load_factor_cap is x itself when x is whole (1.25 * 1 * 8 / 2 = 5), reads 1.1 as 11/10, and floors."""
        assert load_factor_cap(1.25, 1.0, 7, [1.0, 1.0]) == 5
        assert load_factor_cap(1.25, 1.0, 8, [1.0, 1.0]) == 6
        assert load_factor_cap(1.1, 1.0, 9, [1.0]) == 11
        assert load_factor_cap(1.5, 0.5, 0, [0.5, 3.0], min_capacity=16) == 16


class TestLeastLoadedClaim:
    def test_fewest_per_weight_passes(self) -> None:
        """Fewest in flight per unit of weight satisfies the least_loaded claim, on runs where loads differ."""
        claims = attrs.evolve(Claims.none(), least_loaded=True)
        coverage = _run(ScalingStateMachine.for_strategy(Fewest, claims=claims, keys=50, max_examples=10))
        assert coverage.live["least_loaded"] > 0

    @pytest.mark.parametrize("strategy", [FewestByCount, Coin], ids=["ignores-weights", "random"])
    def test_other_choices_fail(self, strategy: type[kvroute.BaseStrategy]) -> None:
        """Ignoring weights, or choosing at random, puts a request on a backend that is not a least loaded one."""
        claims = attrs.evolve(Claims.none(), least_loaded=True)
        with pytest.raises(AssertionError, match="least loaded: expected a least loaded candidate"):
            _run(ScalingStateMachine.for_strategy(strategy, claims=claims, keys=50), HUNT)


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
