"""kvroute_bounded_load.capacity: the load bound, one decision's loads, and the walk."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvroute_bounded_load import LoadBound, capacity, choose, engine_adjusted_load

from kvroute import Backend, BackendState, EngineLoad
from kvroute.testing import load_factor_cap


def states(*loads: int, weights: tuple[float, ...] | None = None) -> list[BackendState]:
    ws = weights or (1.0,) * len(loads)
    return [
        BackendState(Backend(f"b{i}", weight=w), in_flight=n) for i, (n, w) in enumerate(zip(loads, ws, strict=True))
    ]


class TestCapacity:
    @pytest.mark.parametrize(
        ("lf", "weight", "total", "total_weight", "expected"),
        [
            (1.25, 1, 0, 4, 1),  # idle fleet: room for one each
            (1.25, 1, 7, 4, 3),  # ceil(1.25 * 8 / 4) = ceil(2.5)
            (1.1, 1, 9, 1, 11),  # ceil(1.1 * 10) is 11 despite 1.1 * 10 = 11.000000000000002
            (1.25, 2, 11, 4, 8),  # weight 2 of 4: ceil(1.25 * 2 * 12 / 4) = ceil(7.5)
            (1.0, 1, 3, 4, 1),
        ],
    )
    def test_formula(self, lf: float, weight: float, total: int, total_weight: float, expected: int) -> None:
        """capacity = ceil(load_factor * weight * (total + 1) / total weight), at least 1."""
        assert capacity(lf, weight, total, total_weight) == expected

    @given(
        st.integers(100, 400).map(lambda n: n / 100),
        st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0, 4.0]), min_size=1, max_size=9),
        st.integers(0, 500),
    )
    def test_agrees_with_the_exact_bound(self, lf: float, weights: list[float], total: int) -> None:
        """The float formula and its epsilon give exactly the documented cap, computed with fractions (whole values
        too)."""
        for weight in weights:
            assert capacity(lf, weight, total, sum(weights)) == load_factor_cap(lf, weight, total, weights)

    @given(st.floats(1.0, 4.0), st.lists(st.integers(0, 50), min_size=1, max_size=12))
    def test_someone_always_has_room(self, lf: float, loads: list[int]) -> None:
        """With load_factor >= 1 the caps add up to more than the load: some backend has room."""
        bound = LoadBound(load_factor=lf).measure(states(*loads))
        assert any(bound.limit(s) is None for s in bound.candidates)

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"load_factor": 0.9}, r"'load_factor' must be >= 1.0 or unset \(got 0.9\)"),
            ({"concurrency_threshold": 0}, r"'concurrency_threshold' must be >= 1 or unset \(got 0\)"),
        ],
    )
    def test_invalid_bound(self, kwargs: dict[str, float], message: str) -> None:
        """An infeasible bound is a ValueError that says what was got."""
        with pytest.raises(ValueError, match=message):
            LoadBound(**kwargs)  # type: ignore[arg-type]


class TestLoads:
    def test_limits_and_their_order(self) -> None:
        """The threshold is reported before the load factor; an idle backend always has room."""
        cands = states(3, 0, 0, 0)
        loads = LoadBound(load_factor=1.25, concurrency_threshold=3).measure(cands)
        assert loads.limit(cands[0]) == "concurrency_threshold"
        assert loads.limit(cands[1]) is None
        assert LoadBound(load_factor=1.25).measure(cands).limit(cands[0]) == "load_factor"  # cap ceil(1.25) = 2
        assert LoadBound(load_factor=None, concurrency_threshold=None).measure(cands).limit(cands[0]) is None

    def test_min_capacity_is_a_floor(self) -> None:
        """min_capacity raises small caps and leaves large ones alone; a negative floor is refused."""
        cands = states(2, 0, 0, 0)
        assert LoadBound(load_factor=1.25).measure(cands).limit(cands[0]) == "load_factor"
        floored = LoadBound(load_factor=1.25, min_capacity=3).measure(cands)
        assert floored.capacity(cands[0]) == 3 and floored.limit(cands[0]) is None
        busy = states(40, 40, 40, 40)
        assert LoadBound(load_factor=1.25, min_capacity=3).measure(busy).capacity(busy[0]) == 51
        with pytest.raises(ValueError, match=r"'min_capacity' must be >= 0 \(got -1\)"):
            LoadBound(min_capacity=-1)

    def test_weights_scale_the_cap(self) -> None:
        """A backend of weight 3 may hold three times the load of a backend of weight 1."""
        cands = states(5, 1, weights=(3.0, 1.0))
        loads = LoadBound(load_factor=1.0).measure(cands)
        assert (loads.capacity(cands[0]), loads.capacity(cands[1])) == (6, 2)
        assert loads.limit(cands[0]) is None and loads.limit(cands[1]) is None

    def test_engine_load_counts_fresh_telemetry_only(self) -> None:
        """engine_load takes max(in flight, running + waiting) from fresh telemetry and ignores stale."""
        fresh = BackendState(Backend("a"), in_flight=1, load=EngineLoad(running=4, waiting=2))
        stale = BackendState(Backend("b"), in_flight=1, load=EngineLoad(running=9, observed_at=time.monotonic() - 60))
        silent = BackendState(Backend("c"), in_flight=2, load=EngineLoad(kv_usage=0.5))
        assert [engine_adjusted_load(s) for s in (fresh, stale, silent)] == [6, 1, 2]
        loads = LoadBound(concurrency_threshold=5, engine_load=True).measure([fresh, stale, silent])
        assert loads.total == 9 and loads.limit(fresh) == "concurrency_threshold" and loads.limit(stale) is None
        assert LoadBound(concurrency_threshold=5).measure([fresh]).limit(fresh) is None


class TestChoose:
    def test_first_with_room(self) -> None:
        """The first backend of the order with room wins; the first one's limit is the spill reason."""
        cands = states(2, 2, 0, 0)
        loads = LoadBound(load_factor=None, concurrency_threshold=2).measure(cands)
        assert choose(iter(cands[2:]), loads).reason == "first"
        choice = choose(iter(cands), loads)
        assert (choice.state, choice.rank, choice.reason, choice.spill_reason) == (
            cands[2],
            2,
            "spilled",
            "concurrency_threshold",
        )
        assert choice.spilled

    def test_walk_is_lazy(self) -> None:
        """The order is consumed only up to the first backend with room."""
        cands = states(0, 0, 0)
        consumed: list[str] = []

        def order() -> Iterator[BackendState]:
            for s in cands:
                consumed.append(s.id)
                yield s

        choose(order(), LoadBound().measure(cands))
        assert consumed == ["b0"]

    def test_all_full_goes_to_least_loaded(self) -> None:
        """When every candidate is full the least loaded per weight wins, ties to the earlier in the order."""
        cands = states(4, 2, 2, 3)
        loads = LoadBound(load_factor=None, concurrency_threshold=2).measure(cands)
        choice = choose(iter(cands), loads)
        assert (choice.state, choice.rank, choice.reason, choice.spill_reason) == (
            cands[1],
            1,
            "least_loaded",
            "concurrency_threshold",
        )

    def test_candidates_left_out_of_the_order_count_when_all_are_full(self) -> None:
        """The least-loaded fallback considers every candidate, not only the ones the order listed."""
        cands = states(3, 3, 2)
        loads = LoadBound(load_factor=None, concurrency_threshold=2).measure(cands)
        assert choose(iter(cands[:2]), loads).state is cands[2]

    def test_empty(self) -> None:
        """No candidate at all is a ValueError."""
        with pytest.raises(ValueError, match="at least one candidate"):
            choose(iter([]), LoadBound().measure([]))
