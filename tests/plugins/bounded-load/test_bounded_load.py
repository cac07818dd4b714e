"""The bounded-load strategy: homes, stable second homes, limits, all-full fallback, options."""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

import pytest
from kvroute_bounded_load import BoundedLoad

from kvroute import Backend, ConfigError, EngineLoad, Fleet, Lease, Router, RouteRequest
from kvroute.testing import Claims, ScalingStateMachine, StrategyConformance, assign, sample_requests

FOUR = [Backend(f"b{i}") for i in range(4)]


def router(backends: list[Backend] | None = None, strategy: str = "bounded-load", **options: object) -> Router:
    return Router.create(Fleet(backends if backends is not None else FOUR), strategy, options)


def order_of(r: Router, request: RouteRequest) -> list[str]:
    strategy = r.strategy
    assert isinstance(strategy, BoundedLoad)
    placement = strategy.placement
    return [placement.states[i].id for i in placement.ranking(strategy.key(request))]


class TestBoundedLoad:
    def test_idle_fleet_places_like_consistent_hash(self) -> None:
        """With nothing in flight, bounded-load and consistent-hash agree on every key."""
        backends = [Backend(f"b{i}", weight=1 + i % 3) for i in range(9)]
        bl, ch = router(backends), router(backends, "consistent-hash")
        requests = sample_requests(3000, seed=5)
        assert assign(bl.strategy, requests, bl.fleet.candidates()) == assign(
            ch.strategy, requests, ch.fleet.candidates()
        )

    def test_hot_prefix_walks_its_own_order(self) -> None:
        """Concurrent requests for one prefix fill its home, then its second home, and so on, in the key's order."""
        r = router(load_factor="off", concurrency_threshold=2)
        request = RouteRequest.from_text("one hot system prompt")
        leases = [r.acquire(request) for _ in range(8)]
        placed = [lease.backend.id for lease in leases]
        order = order_of(r, request)
        assert placed == [order[0], order[0], order[1], order[1], order[2], order[2], order[3], order[3]]
        assert [lease.decision.reason for lease in leases[:3]] == ["hash", "hash", "spilled"]
        assert leases[2].decision.detail == {"home": order[0], "rank": 1}
        assert leases[2].decision.spill_reason == "concurrency_threshold"

    def test_second_home_is_stable(self) -> None:
        """Each time the home is full, the same prefix spills to the same second backend."""
        r = router(load_factor="off", concurrency_threshold=1)
        request = RouteRequest.from_text("a prompt")
        for _ in range(5):
            first, second = r.acquire(request), r.acquire(request)
            assert (first.backend.id, second.backend.id) == tuple(order_of(r, request)[:2])
            r.release(first)
            r.release(second)

    def test_threshold_never_exceeded_while_others_have_room(self) -> None:
        """Under a threshold of 3 no backend goes above 3 in flight until all 4 hold 3; then least loaded."""
        r = router(load_factor="off", concurrency_threshold=3)
        leases: list[Lease] = []
        for i in range(12):
            leases.append(r.acquire(RouteRequest.from_text(f"key {i % 3}")))
            assert max(s.in_flight for s in r.fleet) <= 3
        overflow = r.acquire(RouteRequest.from_text("key 0"))
        assert overflow.decision.reason == "least_loaded" and overflow.decision.spill_reason == "concurrency_threshold"
        assert sorted(s.in_flight for s in r.fleet) == [3, 3, 3, 4]

    def test_load_factor_cap(self) -> None:
        """With load_factor 1.25 over 4 backends and 7 in flight, the 8th request may not make any backend exceed 3."""
        r = router(load_factor=1.25, min_capacity=0)
        request = RouteRequest.from_text("same")
        for _ in range(8):
            r.acquire(request)
        counts = Counter(s.in_flight for s in r.fleet)
        assert max(s.in_flight for s in r.fleet) <= 3 and sum(s.in_flight for s in r.fleet) == 8, counts

    def test_min_capacity_floor(self) -> None:
        """Below min_capacity a backend is never full under load_factor; at it, the paper's cap applies again."""
        r = router(load_factor=1.25, min_capacity=3)
        request = RouteRequest.from_text("same")
        placed = [r.acquire(request).decision for _ in range(4)]
        assert [d.reason for d in placed] == ["hash", "hash", "hash", "spilled"]
        assert placed[3].spill_reason == "load_factor"
        assert isinstance(r.strategy, BoundedLoad) and r.strategy.bound.min_capacity == 3

    def test_both_limits_combine(self) -> None:
        """With both limits, a backend must be under both: the tighter one decides."""
        r = router([Backend("a"), Backend("b")], load_factor=4.0, concurrency_threshold=2)
        request = RouteRequest.from_text("x")
        placed = [r.acquire(request).decision for _ in range(3)]
        assert [d.reason for d in placed] == ["hash", "hash", "spilled"]
        assert placed[2].spill_reason == "concurrency_threshold"

    def test_unroutable_home(self) -> None:
        """An ejected home sends its keys to the next in their order, reason home_unroutable."""
        r = router()
        request = RouteRequest.from_text("who")
        home, second = order_of(r, request)[:2]
        r.fleet.set_healthy(home, False)
        decision = r.decide(request)[0]
        assert decision.backend.id == second and decision.detail == {"home": home, "rank": 1}
        assert decision.spill_reason == "home_unroutable"

    def test_spills_counted_by_reason(self) -> None:
        """Started spills are counted by reason; an all-full request that stays home is not a spill."""
        r = router(load_factor="off", concurrency_threshold=1)
        request = RouteRequest.from_text("z")
        leases = [r.acquire(request) for _ in range(5)]
        strategy = r.strategy
        assert isinstance(strategy, BoundedLoad)
        assert [lease.decision.spilled for lease in leases] == [False, True, True, True, False]
        assert leases[4].decision.reason == "least_loaded"
        assert strategy.spills == 3 and strategy.spill_reasons == Counter(concurrency_threshold=3)

    def test_engine_load_makes_the_threshold_global(self) -> None:
        """With engine_load, a home the engine reports busy (other replicas' requests) is full for this replica."""
        request = RouteRequest.from_text("shared by replicas")
        plain, engine = router(concurrency_threshold=4), router(concurrency_threshold=4, engine_load=True)
        home = order_of(plain, request)[0]
        for r in (plain, engine):
            r.fleet.update_load(home, EngineLoad(running=3, waiting=1))
        assert plain.decide(request)[0].backend.id == home
        decision = engine.decide(request)[0]
        assert decision.backend.id != home and decision.spill_reason == "concurrency_threshold"

    def test_hot_key_spreads_over_its_first_homes(self) -> None:
        """With hot_replicas=3, one hot prefix is spread evenly over the first 3 backends of its order, no further."""
        r = router(load_factor="off", hot_replicas=3, min_capacity=0)
        request = RouteRequest.from_text("a very popular system prompt")
        leases = [r.acquire(request) for _ in range(12)]
        order = order_of(r, request)
        assert Counter(lease.backend.id for lease in leases) == {order[0]: 4, order[1]: 4, order[2]: 4}
        strategy = r.strategy
        assert isinstance(strategy, BoundedLoad)
        replicated = [lease.decision for lease in leases if lease.decision.reason == "replicated"]
        assert replicated and strategy.replicated == len(replicated) and strategy.spills == 0
        assert all(d.detail["replicas"] in (2, 3) and not d.spilled for d in replicated)
        assert strategy.in_flight_for(leases[0].decision.key or 0) == 12
        for lease in leases:
            r.release(lease)
        assert strategy.in_flight_for(leases[0].decision.key or 0) == 0
        assert r.decide(request)[0].reason == "hash"

    def test_replication_is_off_by_default(self) -> None:
        """By default a hot prefix stays on its home while the home has room."""
        r = router(load_factor="off")
        request = RouteRequest.from_text("a very popular system prompt")
        assert {r.acquire(request).backend.id for _ in range(12)} == {order_of(r, request)[0]}

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"load_factor": 0.5}, r"'load_factor' must be between 1.0 and 100.0 \(got 0.5\)"),
            ({"load_factor": "much"}, r"'load_factor': expected a number \(got 'much'\)"),
            ({"concurrency_threshold": 0}, r"'concurrency_threshold' must be between 1 and 1024 \(got 0\)"),
            ({"concurrency_threshold": 2000}, r"'concurrency_threshold' must be between 1 and 1024 \(got 2000\)"),
            ({"engine_load": "maybe"}, r"'engine_load': expected true or false \(got 'maybe'\)"),
            ({"prefix_length": 100000}, r"'prefix_length' must be between 1024 and 65536 \(got 100000\)"),
            ({"hot_replicas": 0}, r"'hot_replicas' must be between 1 and 64 \(got 0\)"),
            ({"min_capacity": -1}, r"'min_capacity' must be between 0 and 1024 \(got -1\)"),
        ],
    )
    def test_bad_options(self, options: dict[str, object], message: str) -> None:
        """Bad options are ConfigErrors that say what was expected and what was got."""
        with pytest.raises(ConfigError, match=message):
            router(**options)

    def test_options_from_strings(self) -> None:
        """CLI strings convert; 'off' unsets the load factor (SageMaker's threshold-only behaviour)."""
        strategy = router(load_factor="off", concurrency_threshold="16", engine_load="yes").strategy
        assert isinstance(strategy, BoundedLoad)
        assert (strategy.load_factor, strategy.concurrency_threshold, strategy.engine_load) == (None, 16, True)


# Every run below must meet a candidate full under each claimed limit at least once (Coverage.require),
# so none can pass without its load check having been able to fail.
# min_capacity=0: the paper's bound exactly.
TestBoundedLoadScaling = ScalingStateMachine.for_strategy(
    "bounded-load", {"min_capacity": 0}, claims=Claims(load_factor=1.25)
).TestCase
# The default options (load_factor 1.25, min_capacity 16): bursts of up to 40 requests fill backends past 16.
TestDefaultOptionsScaling = ScalingStateMachine.for_strategy(
    "bounded-load", claims=Claims(load_factor=1.25, min_capacity=16), max_examples=12
).TestCase
TestMinCapacityScaling = ScalingStateMachine.for_strategy(
    "bounded-load", {"min_capacity": 2}, claims=Claims(load_factor=1.25, min_capacity=2), max_examples=12
).TestCase
TestThresholdOnlyScaling = ScalingStateMachine.for_strategy(
    "bounded-load",
    {"load_factor": "off", "concurrency_threshold": 2},
    claims=Claims(concurrency_threshold=2),
    max_examples=12,
).TestCase
TestHotReplicasScaling = ScalingStateMachine.for_strategy(
    "bounded-load", {"hot_replicas": 3, "min_capacity": 0}, claims=Claims(load_factor=1.25), max_examples=12
).TestCase
TestBothLimitsScaling = ScalingStateMachine.for_strategy(
    "bounded-load",
    {"load_factor": 1.5, "concurrency_threshold": 3, "min_capacity": 0},
    claims=Claims(load_factor=1.5, concurrency_threshold=3),
    max_examples=12,
).TestCase


class TestBoundedLoadConformance(StrategyConformance):
    strategy = "bounded-load"
    options: ClassVar[dict[str, object]] = {"concurrency_threshold": 4}
    deterministic = True
