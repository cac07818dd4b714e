"""The fleet cache view (kvroute.cache_view) and shadow strategies (kvroute.shadow)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute import (
    Backend,
    BackendState,
    CacheView,
    ConfigError,
    Decision,
    EngineLoad,
    Fleet,
    FleetEvent,
    Outcome,
    RouteRequest,
    Status,
)
from kvroute.shadow import ShadowRound, ShadowSet
from kvroute.strategy import BaseStrategy, Pick


def words(n: int, start: int = 0) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


def request(text: str, **kw: object) -> RouteRequest:
    return RouteRequest.from_text(text, model="m", **kw)


def state(backend_id: str) -> BackendState:
    return BackendState(Backend(backend_id))


class TestCacheView:
    def test_shared_prefix_shares_leading_hashes(self) -> None:
        """Two prompts share exactly the blocks that lie wholly inside their common prefix."""
        view = CacheView(block_size=4, units="words")
        a = view.blocks(request(words(40)))
        b = view.blocks(request(words(20) + " other " + words(19, 100)))
        assert a.units == 40 and b.units == 40
        assert a.hashes[:5] == b.hashes[:5]
        assert a.hashes[5] != b.hashes[5]

    def test_last_unit_never_counts(self) -> None:
        """A prompt of exactly k blocks has k-1 full blocks that may be reused (the engine computes its last token)."""
        view = CacheView(block_size=4, units="words")
        assert len(view.blocks(request(words(8))).hashes) == 1
        assert len(view.blocks(request(words(9))).hashes) == 2

    def test_tenants_and_adapters_never_share(self) -> None:
        """The same text under another cache_salt or LoRA adapter has different blocks."""
        view = CacheView(block_size=4, units="words")
        base = view.blocks(request(words(20))).hashes
        assert set(base).isdisjoint(view.blocks(request(words(20), cache_salt="t2")).hashes)
        assert set(base).isdisjoint(view.blocks(request(words(20), lora="a1")).hashes)

    def test_chars_units(self) -> None:
        """In chars mode a unit is chars_per_token bytes of the routing text."""
        view = CacheView(block_size=2, chars_per_token=4)
        blocks = view.blocks(request("x" * 33))
        assert blocks.units == 9
        assert len(blocks.hashes) == 4

    def test_blocks_kept_in_the_request(self) -> None:
        """Views that cut alike hash a request's prompt once (its memo); another cut, or a new request, hashes anew."""
        r = request(words(40), request_id="r1")
        first = CacheView(block_size=4, units="words").blocks(r)
        assert CacheView(block_size=4, units="words").blocks(r) is first
        other = CacheView(block_size=8, units="words").blocks(r)
        assert other is not first and len(other.hashes) == 4
        chars = CacheView(block_size=4).blocks(r)
        assert chars is not first and chars.units != first.units
        again = request(words(40), request_id="r1")
        assert again == r and not again.memo  # the memo is no part of equality
        fresh = CacheView(block_size=4, units="words").blocks(again)
        assert fresh is not first and fresh == first
        assert not attrs.evolve(r, text=words(41)).memo  # a request made from another starts afresh

    def test_token_ids_are_units(self) -> None:
        """A prompt sent as token ids is cut in blocks of ids."""
        view = CacheView(block_size=4, units="words")
        blocks = view.blocks(RouteRequest.from_text("", model="m", token_ids=list(range(13))))
        assert blocks.units == 13 and len(blocks.hashes) == 3

    def test_reuse_at_chosen_and_anywhere(self) -> None:
        """After a prompt went to b1, a prompt sharing its first 3 blocks finds 12 tokens at b1 and none at b2."""
        view = CacheView(block_size=4, units="words")
        view.record(state("b1"), view.blocks(request(words(40))))
        follow = view.blocks(request(words(12) + " x y z " + words(10, 200)))
        assert view.reuse(follow, "b2", ["b1", "b2"]).best == 12
        assert view.reuse(follow, "b2", ["b1", "b2"]).chosen == 0
        assert view.reuse(follow, "b1", ["b1", "b2"]).chosen == 12

    def test_capacity_evicts_oldest(self) -> None:
        """Past its capacity a backend forgets the least recently sent blocks first."""
        view = CacheView(block_size=4, units="words", capacity_tokens=40)
        b1 = state("b1")
        first, second = view.blocks(request(words(41))), view.blocks(request(words(41, 1000)))
        view.record(b1, first)
        view.record(b1, second)
        assert view.held_blocks("b1") == 10
        assert view.matched("b1", second) == 40
        assert view.matched("b1", first) == 0

    def test_engine_capacity_wins(self) -> None:
        """A backend whose load reports kv_blocks and block_size is bounded by them, not by the default."""
        view = CacheView(block_size=4, capacity_tokens=10_000)
        b1 = state("b1")
        b1.load = EngineLoad(kv_blocks=3, block_size=8)
        assert view.capacity_blocks(b1) == 6
        b1.load = None
        assert view.capacity_blocks(b1) == 2500

    def test_rejects_bad_settings(self) -> None:
        """Sizes must be positive integers and units one of the two names."""
        with pytest.raises(ValueError, match="'block_size' must be a positive integer"):
            CacheView(block_size=0)
        with pytest.raises(ValueError, match="'units' must be 'chars' or 'words'"):
            CacheView(units="bytes")

    @settings(derandomize=True, max_examples=60, deadline=None)
    @given(
        st.lists(
            st.tuples(st.sampled_from(["b1", "b2"]), st.integers(0, 5), st.integers(1, 30)), min_size=1, max_size=30
        ),
        st.integers(2, 40),
    )
    def test_bisection_equals_linear_count(self, sends: list[tuple[str, int, int]], capacity: int) -> None:
        """Under any sends and evictions a backend holds prefix-closed runs, so bisection finds the linear match."""
        view = CacheView(block_size=2, units="words", capacity_tokens=capacity * 2)
        states = {"b1": state("b1"), "b2": state("b2")}
        prompts = []
        for backend_id, family, length in sends:
            blocks = view.blocks(request(words(length * 2 + 1, family * 7)))
            prompts.append(blocks)
            view.record(states[backend_id], blocks)
        for blocks in prompts:
            for backend_id in states:
                held = view._held.get(backend_id, {})
                linear = 0
                while linear < len(blocks.hashes) and blocks.hashes[linear] in held:
                    linear += 1
                assert view.matched(backend_id, blocks) == linear * 2

    @settings(derandomize=True, max_examples=80, deadline=None)
    @given(
        st.lists(st.tuples(st.integers(0, 6), st.integers(1, 25)), min_size=1, max_size=60),
        st.integers(1, 30),
    )
    def test_eviction_is_lru_of_the_model(self, sends: list[tuple[int, int]], capacity: int) -> None:
        """After any sends, a backend holds exactly what a plain LRU holds (each prompt touched last block first)."""
        view = CacheView(block_size=2, units="words", capacity_tokens=capacity * 2)
        b1 = state("b1")
        model: OrderedDict[int, None] = OrderedDict()
        for family, length in sends:
            blocks = view.blocks(request(words(length * 2 + 1, family * 5)))
            view.record(b1, blocks)
            for h in reversed(blocks.hashes):
                model[h] = None
                model.move_to_end(h)
            while len(model) > capacity:
                model.popitem(last=False)
            assert list(view._held["b1"]) == list(model)


class _Fixed(BaseStrategy):
    """Always picks one backend id (the first candidate when absent); records what it is told."""

    def __init__(self, target: str | None = None, fail: bool = False) -> None:
        self.target = target
        self.fail = fail
        self.started: list[str] = []
        self.events: list[str] = []

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Pick:
        if self.fail:
            raise RuntimeError("boom")
        for c in candidates:
            if c.id == self.target:
                return c
        return candidates[0]

    def on_request_start(self, request: RouteRequest, decision: Decision) -> None:
        self.started.append(decision.backend.id)

    def on_fleet_change(self, event: FleetEvent, members: Sequence[BackendState]) -> None:
        self.events.append(event.kind)


class _LeastInFlight(BaseStrategy):
    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Pick:
        return min(candidates, key=lambda c: (c.in_flight, c.id))


class TestShadowSet:
    def _set(self, **shadows: BaseStrategy) -> tuple[Fleet, ShadowSet]:
        fleet = Fleet([Backend("b1"), Backend("b2")])
        view = lambda: CacheView(block_size=4, units="words")  # noqa: E731
        return fleet, ShadowSet(fleet, "live", shadows, view)

    def _route(self, fleet: Fleet, shadows: ShadowSet, text: str, live: str) -> ShadowRound:
        return shadows.routed(request(text), Decision(fleet.get(live).backend), fleet.candidates("m"))

    def test_verdicts_and_agreement(self) -> None:
        """Each strategy gets a verdict; a shadow agrees only when it picked the live backend."""
        fleet, shadows = self._set(same=_Fixed("b1"), other=_Fixed("b2"))
        round_ = self._route(fleet, shadows, words(20), "b1")
        by_name = {v.strategy: v for v in round_.verdicts}
        assert [v.strategy for v in round_.verdicts] == ["live", "same", "other"]
        assert by_name["live"].live and by_name["same"].agrees and not by_name["other"].agrees
        assert by_name["other"].backend == "b2"

    def test_shadows_touch_nothing_live(self) -> None:
        """Shadow picks count in no live in-flight count."""
        fleet, shadows = self._set(other=_Fixed("b2"))
        self._route(fleet, shadows, words(20), "b1")
        assert fleet.in_flight("b1") == 0 and fleet.in_flight("b2") == 0

    def test_shadow_sees_its_own_placements(self) -> None:
        """A shadow's in-flight view and callbacks follow its own picks until the live request finishes."""
        fleet, shadows = self._set(least=_LeastInFlight())
        first = self._route(fleet, shadows, words(20), "b1")
        second = self._route(fleet, shadows, words(20, 50), "b1")
        assert [v.backend for v in (first.verdicts[1], second.verdicts[1])] == ["b1", "b2"]
        shadows.finished(first, Outcome(Status.OK, 0.1))
        shadows.finished(first, Outcome(Status.OK, 0.1))
        third = self._route(fleet, shadows, words(20, 90), "b2")
        assert third.verdicts[1].backend == "b1"

    def test_shadow_reuse_comes_from_its_own_view(self) -> None:
        """The live view records the live backend and a shadow's view its own pick, so their predictions differ."""
        fleet, shadows = self._set(other=_Fixed("b2"))
        self._route(fleet, shadows, words(40), "b1")
        round_ = self._route(fleet, shadows, words(40), "b1")
        live, other = round_.verdicts
        assert live.reuse.chosen == 36 and other.reuse.chosen == 36
        round_ = self._route(fleet, shadows, words(40), "b2")
        live, other = round_.verdicts
        assert (live.reuse.chosen, live.reuse.best) == (0, 36)
        assert other.agrees and other.reuse.chosen == 36

    def test_failing_shadow_is_an_error_verdict(self) -> None:
        """A shadow that raises gives a verdict with the error and no backend; the round goes on."""
        fleet, shadows = self._set(bad=_Fixed(fail=True), good=_Fixed("b2"))
        round_ = self._route(fleet, shadows, words(20), "b1")
        bad, good = round_.verdicts[1:]
        assert bad.backend is None and bad.error == "RuntimeError: boom" and good.backend == "b2"

    def test_fleet_events_reach_shadows(self) -> None:
        """Shadows are attached to the fleet's members and told of later changes; close stops that."""
        strategy = _Fixed()
        fleet, shadows = self._set(s=strategy)
        fleet.drain("b2")
        shadows.close()
        fleet.drain("b2", False)
        assert strategy.events == ["attached", "draining"]

    def test_live_cannot_be_a_shadow(self) -> None:
        """Shadowing the live strategy by its own name is refused."""
        with pytest.raises(ConfigError, match="shadow 'live' is the live strategy"):
            ShadowSet(Fleet(), "live", {"live": _Fixed()})
