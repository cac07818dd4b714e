"""kvroute.testing's capacity claims: the cache model, cache room, and the machine catching broken placements."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, Phase, settings

import kvroute
from kvroute import BackendState, Decision, FleetEvent, RouteRequest
from kvroute.hashing import hash64, hash_parts
from kvroute.testing import CacheModel, Claims, Coverage, ScalingStateMachine, cache_room

HUNT = settings(
    max_examples=60,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
    report_multiple_bugs=False,
)
CLAIMS = Claims(resident=True, cache_factor=1.1, cache_fill=0.8)
KV_BLOCKS = (2, 3, 4, 6)


def _score(request: RouteRequest, state: BackendState) -> float:
    h = hash_parts(request.text, state.id) | 1
    return (math.log(h) - 64 * math.log(2)) / state.weight


class Fitting(kvroute.BaseStrategy):
    """Rendezvous order; a key's holders first, else those with cache room, else those with room under the factor
    alone (no load limits)."""

    resident = True

    def __init__(self) -> None:
        self.cache = CacheModel()
        self.members: dict[str, BackendState] = {}

    def on_fleet_change(self, event: FleetEvent, members: Sequence[BackendState]) -> None:
        self.members = {s.id: s for s in members}
        self.cache.keep_only(self.members)

    def on_request_start(self, request: RouteRequest, decision: Decision) -> None:
        assert decision.key is not None
        load = self.members[decision.backend.id].fresh_load()
        self.cache.record(
            decision.backend.id, decision.key, decision.detail["footprint"], load.kv_tokens if load else None
        )

    def room(self, candidates: Sequence[BackendState], footprint: int, fill: float | None = 0.8) -> set[str]:
        loads = [s.fresh_load() for s in candidates]
        in_tokens = all(load is not None and load.kv_tokens for load in loads)
        capacities = {
            s.id: float(load.kv_tokens) if in_tokens and load and load.kv_tokens else s.weight
            for s, load in zip(candidates, loads, strict=True)
        }
        held = {s.id: self.cache.held(s.id) for s in candidates}
        return cache_room(held, capacities, footprint, cache_factor=1.1, cache_fill=fill, in_tokens=in_tokens)

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
        key, footprint = hash64(request.text), math.ceil(len(request.text) / 4)
        order = sorted(candidates, key=lambda s: (_score(request, s), s.id), reverse=True)
        holders = self.cache.holders(key, [s.id for s in order]) if self.resident else set()
        preferred = holders or self.room(candidates, footprint) or self.room(candidates, footprint, fill=None)
        chosen = next((s for s in order if s.id in preferred), order[0])
        return Decision(chosen.backend, reason="hash", key=key, detail={"footprint": footprint})


class Forgetful(Fitting):
    """Places every start by cache room, even a key some backend already holds."""

    resident = False


class HashOnly(Fitting):
    """Keeps held keys home but places cold ones on their rendezvous home whatever it holds."""

    def room(self, candidates: Sequence[BackendState], footprint: int, fill: float | None = 0.8) -> set[str]:
        return set()


class NoFootprint(Fitting):
    """Correct placement, but its decisions do not say the footprint."""

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
        decision = super().pick(request, candidates)
        self.pending = decision.detail["footprint"]
        return Decision(decision.backend, reason="hash", key=decision.key)

    def on_request_start(self, request: RouteRequest, decision: Decision) -> None:
        return None


def _machine(strategy: type[Fitting], **kwargs: object) -> type[ScalingStateMachine]:
    options = {"claims": CLAIMS, "kv_blocks": KV_BLOCKS, "max_examples": 8, "steps": 20} | kwargs
    return ScalingStateMachine.for_strategy(strategy, **options)  # type: ignore[arg-type]


class TestCacheModel:
    def test_lru_eviction_at_capacity(self) -> None:
        """A start makes its key the most recent; the least recent ones go while the total exceeds the capacity."""
        model = CacheModel()
        for key in (1, 2, 3):
            model.record("a", key, 10, capacity=25)
        assert model.holders(2, ["a", "b"]) == {"a"} and model.holders(1, ["a"]) == set()
        model.record("a", 2, 10, capacity=25)
        model.record("a", 4, 10, capacity=25)
        assert model.holders(3, ["a"]) == set() and model.held("a") == 20

    def test_keep_only(self) -> None:
        """A backend that left forgets what it held."""
        model = CacheModel()
        model.record("a", 1, 10, capacity=None)
        model.keep_only(["b"])
        assert model.held("a") == 0


class TestCacheRoom:
    def test_relative_bound_is_exact(self) -> None:
        """cache_factor 1.1, two equal backends, 10 more tokens: room while held + 10 <= 1.1 * (total + 10) / 2."""
        weights = {"a": 1.0, "b": 1.0}
        # total 190 + 10: the cap is exactly 110, so a at 100 (-> 110) fits and at 101 (-> 111) does not.
        assert cache_room({"a": 100, "b": 90}, weights, 10, cache_factor=1.1, cache_fill=None, in_tokens=False) == {
            "a",
            "b",
        }
        assert cache_room({"a": 101, "b": 89}, weights, 10, cache_factor=1.1, cache_fill=None, in_tokens=False) == {"b"}

    def test_empty_backend_always_fits_one_prefix_under_the_factor(self) -> None:
        """A backend holding nothing has room for any prefix under cache_factor (the floor of one footprint)."""
        room = cache_room(
            {"a": 0, "b": 0}, {"a": 1.0, "b": 1.0}, 50, cache_factor=1.0, cache_fill=None, in_tokens=False
        )
        assert room == {"a", "b"}

    def test_fill_applies_only_to_known_capacities(self) -> None:
        """cache_fill bounds a backend at that fraction of its KV tokens, and is ignored when capacities are weights."""
        kwargs = {"cache_factor": None, "cache_fill": 0.8}
        assert cache_room({"a": 70}, {"a": 100.0}, 10, in_tokens=True, **kwargs) == {"a"}  # type: ignore[arg-type]
        assert cache_room({"a": 71}, {"a": 100.0}, 10, in_tokens=True, **kwargs) == set()  # type: ignore[arg-type]
        assert cache_room({"a": 71}, {"a": 1.0}, 10, in_tokens=False, **kwargs) == {"a"}  # type: ignore[arg-type]


class TestCapacityClaims:
    def test_fitting_strategy_passes_and_the_checks_bind(self) -> None:
        """A strategy following the rules passes, and both the resident and the cache checks met cases they could
        fail."""
        coverage: Coverage = _machine(Fitting).run()
        assert coverage.live["resident"] > 0 and coverage.live["cache"] > 0

    def test_weights_as_capacities_pass(self) -> None:
        """Without KV telemetry the machine holds the strategy to cache_factor over weights."""
        _machine(Fitting, kv_blocks=None, claims=Claims(resident=True, cache_factor=1.1)).run()

    @pytest.mark.parametrize(
        ("strategy", "message"),
        [(Forgetful, "resident:"), (HashOnly, "cache bound:")],
    )
    def test_broken_placement_fails(self, strategy: type[Fitting], message: str) -> None:
        """Moving held keys, or placing cold keys whatever their homes hold, fails the machine."""
        with pytest.raises(AssertionError, match=message):
            _machine(strategy).run(HUNT)

    def test_decisions_must_carry_the_footprint(self) -> None:
        """A strategy claiming cache bounds whose decisions lack detail['footprint'] fails with that message."""
        with pytest.raises(AssertionError, match=r"detail\['footprint'\]"):
            _machine(NoFootprint).run(HUNT)
