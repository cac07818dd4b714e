"""kvroute.warmup, the warm-join mechanism the simulator and the proxy share: slow start, hot prefixes, warm plan.

It lives in the library (core/src/kvroute/warmup.py); its tests sit with the simulator, its first user.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute import Backend, ConfigError, Fleet, FleetEvent, Router, RouteRequest
from kvroute.plugins import PluginManager
from kvroute.warmup import HotPrefixes, SlowStart, prefix_body, warm_plan

MODEL = "m"


def chat(system: str, *turns: str, salt: str | None = None) -> RouteRequest:
    """A chat request: a system prompt, then alternating user and assistant turns (the last one a user's)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    body: dict[str, Any] = {"model": MODEL, "messages": messages}
    if salt is not None:
        body["cache_salt"] = salt
    return RouteRequest.from_openai(body)


def fleet_of(n: int) -> Fleet:
    return Fleet([Backend(f"b{i}") for i in range(n)])


class TestSlowStart:
    def test_weight_rises_in_equal_steps_to_full_at_the_period(self) -> None:
        """The fraction starts at ``initial``, rises by (1 - initial) / steps per step, and is 1.0 from ``period``."""
        ramp = SlowStart(period=10.0, initial=0.2, steps=4)
        assert [ramp.fraction(t) for t in (0.0, 2.4, 2.5, 5.0, 9.99, 10.0, 60.0)] == pytest.approx(
            [0.2, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
        )

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"period": 0}, r"'period' must be a positive number of seconds \(got 0\)"),
            ({"period": 5, "initial": 0}, r"'initial' must be a fraction in \(0, 1\]"),
            ({"period": 5, "initial": 1.5}, r"'initial' must be a fraction in \(0, 1\]"),
            ({"period": 5, "steps": 0}, r"'steps' must be a positive integer \(got 0\)"),
        ],
    )
    def test_settings_are_validated(self, kwargs: dict[str, Any], message: str) -> None:
        """A bad setting is a ConfigError naming it and the value got."""
        with pytest.raises(ConfigError, match=message):
            SlowStart(**kwargs)

    def test_ramp_sets_each_step_on_the_fleet_then_stops(self) -> None:
        """begin lowers the weight to initial x weight; advance sets each due step and says when the next is due."""
        fleet = Fleet([Backend("old"), Backend("new", weight=2.0)])
        events: list[FleetEvent] = []
        fleet.subscribe(events.append)
        ramp = SlowStart(period=10.0, initial=0.5, steps=2).begin(fleet, "new", now=100.0)
        assert fleet.get("new").backend.weight == 1.0
        assert ramp.advance(101.0) == 105.0  # nothing new due yet
        assert ramp.advance(105.0) == 110.0
        assert fleet.get("new").backend.weight == 1.5
        assert ramp.advance(110.0) is None
        assert fleet.get("new").backend.weight == 2.0
        assert [e.kind for e in events] == ["weight", "weight", "weight"]

    def test_ramp_of_a_removed_backend_ends(self) -> None:
        """Once the backend left the fleet, advance changes nothing and ends the ramp."""
        fleet = fleet_of(2)
        ramp = SlowStart(period=10.0).begin(fleet, "b1", now=0.0)
        fleet.remove("b1")
        assert ramp.advance(5.0) is None

    @settings(max_examples=10, derandomize=True, deadline=None)
    @given(st.integers(2, 6), st.integers(1, 8))
    def test_keys_only_move_to_the_ramping_backend(self, members: int, steps: int) -> None:
        """Under consistent-hash each step gives the new backend more keys and takes none; it ends at its full share."""
        fleet = fleet_of(members)
        router = Router.create(fleet, "consistent-hash", plugins=PluginManager())
        requests = [RouteRequest.from_text(f"prompt {i} " * 30, model=MODEL) for i in range(300)]

        def owned() -> set[int]:
            return {i for i, r in enumerate(requests) if router.decide(r)[0].backend.id == "new"}

        fleet.add(Backend("new"))
        full = owned()
        ramp = SlowStart(period=float(steps), initial=0.05, steps=steps).begin(fleet, "new", now=0.0)
        previous = owned()
        for t in range(1, steps + 1):
            ramp.advance(float(t))
            now_owned = owned()
            assert previous <= now_owned
            previous = now_owned
        assert previous == full and len(full) > 0
        router.close()


class TestPrefixBody:
    def test_a_chat_warms_with_what_comes_before_its_newest_user_message(self) -> None:
        """The body is the messages before the newest user message, one output token, the same model and salt."""
        body = prefix_body(chat("be brief", "hi", "hello", "and now?", salt="t1"))
        assert body == {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
            ],
            "max_tokens": 1,
            "cache_salt": "t1",
        }

    def test_fields_that_shape_the_prompt_come_along(self) -> None:
        """Tools and the other prompt-shaping fields are part of the prefix an engine caches: the body keeps them."""
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
        request = RouteRequest.from_openai({"model": MODEL, "messages": messages, "tools": tools})
        body = prefix_body(request)
        assert body is not None and body["tools"] == tools and body["messages"] == messages[:1]

    def test_nothing_to_warm_without_a_shared_part(self) -> None:
        """A chat that starts with its only user message, and a completions prompt, have no prefix body."""
        alone = RouteRequest.from_openai({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        completion = RouteRequest.from_openai({"model": MODEL, "prompt": "hi"}, endpoint="completions")
        assert prefix_body(alone) is None and prefix_body(completion) is None


class TestHotPrefixes:
    def test_counts_requests_per_prefix_most_shared_first(self) -> None:
        """Requests sharing a system prompt count together; hottest lists those seen at least twice, most first."""
        hot = HotPrefixes()
        for i in range(3):
            hot.observe(chat("alpha", f"question {i}"))
        for i in range(2):
            hot.observe(chat("beta", f"question {i}"))
        hot.observe(chat("gamma", "once"))
        hottest = hot.hottest(5)
        assert [(e.body["messages"][0]["content"], e.count) for e in hottest] == [("alpha", 3), ("beta", 2)]
        assert hottest[0].request.messages[-1]["content"] == "question 2"  # the latest request is kept
        assert [e.count for e in hot.hottest(5, min_count=1)] == [3, 2, 1]

    def test_salts_keep_prefixes_apart(self) -> None:
        """The same prompt under two cache salts is two prefixes (engines do not share them)."""
        hot = HotPrefixes()
        for salt in ("a", "b", "a"):
            hot.observe(chat("same", "q", salt=salt))
        assert [e.count for e in hot.hottest(5, min_count=1)] == [2, 1]

    def test_keeps_at_most_capacity_prefixes(self) -> None:
        """Beyond ``capacity`` distinct prefixes the least recently seen is forgotten."""
        hot = HotPrefixes(capacity=2)
        for system in ("a", "a", "b", "c"):
            hot.observe(chat(system, "q"))
        assert {e.body["messages"][0]["content"] for e in hot.hottest(5, min_count=1)} == {"b", "c"}

    def test_capacity_is_validated(self) -> None:
        """A capacity below one is refused with the value got."""
        with pytest.raises(ConfigError, match=r"'capacity' must be a positive integer \(got 0\)"):
            HotPrefixes(capacity=0)


class TestWarmPlan:
    def test_lists_the_hottest_prefixes_the_new_backend_owns(self) -> None:
        """The plan holds only prefixes whose requests the router now sends to the backend, hottest first, at most n."""
        fleet = fleet_of(3)
        router = Router.create(fleet, "consistent-hash", {"prefix_length": 1024}, plugins=PluginManager())
        hot = HotPrefixes()
        systems = [f"system prompt number {k} " * 60 for k in range(40)]
        for k, system in enumerate(systems):
            for i in range(2 + k % 3):
                hot.observe(chat(system, f"q{i}"))
        fleet.add(Backend("new"))
        plan = warm_plan(router, "new", hot, n=100)
        assert plan, "some of 40 prefixes land on one of 4 backends"
        for entry in plan:
            assert router.decide(entry.request)[0].backend.id == "new"
        owned = [e for e in hot.hottest(100) if router.decide(e.request)[0].backend.id == "new"]
        assert [e.count for e in plan] == [e.count for e in owned]
        assert warm_plan(router, "new", hot, n=1) == plan[:1]
        router.close()
