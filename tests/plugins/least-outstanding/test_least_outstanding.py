"""The least-outstanding strategy: fewest in flight per weight, random tie-breaks."""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute import Backend, EngineLoad, Fleet, Router, RouteRequest
from kvroute.testing import Claims, ScalingStateMachine
from tests.hypothesis_strategies import weights

REQ = RouteRequest.from_text("x")


class TestLeastOutstanding:
    @given(
        st.lists(st.tuples(weights, st.integers(0, 20)), min_size=1, max_size=8),
        st.integers(0, 1000),
    )
    def test_never_picks_a_more_loaded_backend(self, spec: list[tuple[float, int]], seed: int) -> None:
        """The chosen backend's in-flight per weight is never above any other candidate's."""
        fleet = Fleet([Backend(f"b{i}", weight=w) for i, (w, _) in enumerate(spec)])
        for i, (_, n) in enumerate(spec):
            fleet.get(f"b{i}").in_flight = n
        router = Router.create(fleet, "least-outstanding", {"seed": seed})
        decision, chosen = router.decide(REQ)
        assert all(chosen.in_flight / chosen.weight <= s.in_flight / s.weight for s in fleet)
        assert decision.reason == "least_loaded"

    def test_ties_are_not_always_first(self) -> None:
        """With every backend idle, 400 dry-run picks reach every backend (ties broken at random)."""
        fleet = Fleet([Backend(f"b{i}") for i in range(4)])
        router = Router.create(fleet, "least-outstanding", {"seed": 3})
        counts = Counter(router.decide(REQ)[0].backend.id for _ in range(400))
        assert set(counts) == {"b0", "b1", "b2", "b3"} and min(counts.values()) > 60

    def test_leases_spread_evenly(self) -> None:
        """Held requests spread so that counts never differ by more than one."""
        fleet = Fleet([Backend(f"b{i}") for i in range(3)])
        router = Router.create(fleet, "least-outstanding", {"seed": 0})
        for _ in range(10):
            router.acquire(REQ)
        counts = [s.in_flight for s in fleet]
        assert max(counts) - min(counts) <= 1 and sum(counts) == 10

    @pytest.mark.parametrize("observed_at_offset, expect", [(0.0, "b1"), (-60.0, "b0")])
    def test_engine_queue_counts_only_when_fresh(self, observed_at_offset: float, expect: str) -> None:
        """With engine_queue on, a fresh waiting queue counts as load; a stale one is ignored."""
        import time

        fleet = Fleet([Backend("b0"), Backend("b1")])
        fleet.get("b1").in_flight = 1
        fleet.update_load("b0", EngineLoad(waiting=5, observed_at=time.monotonic() + observed_at_offset))
        router = Router.create(fleet, "least-outstanding", {"seed": 0, "engine_queue": "true"})
        assert router.decide(REQ)[0].backend.id == expect


# least-outstanding claims least_loaded (every start goes to a candidate with the fewest requests in flight
# per unit of weight), checked on every start of the machine's history; it claims nothing about keys (on an
# idle fleet ties are broken at random, ignoring weights). Also checked: picks are candidates, in-flight
# counts are conserved.
TestLeastOutstandingScaling = ScalingStateMachine.for_strategy(
    "least-outstanding", {"seed": 1}, claims=attrs.evolve(Claims.none(), least_loaded=True), keys=200, max_examples=12
).TestCase
