"""Warm join in the simulator: pre-filling and slow-starting an instance that --scale adds, and what it measures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.plugins import PluginManager
from kvroute.warmup import SlowStart
from kvroute_simulator.driver import Comparison, ScaleEvent, SimulationConfig, compare
from kvroute_simulator.workloads import Arrival, LongPrefix

JOIN_AT = 25.0


@pytest.fixture(scope="module")
def arrivals() -> list[Arrival]:
    """30 groups of a 2,000-token prefix on 3 instances, 500 requests at 8 per second; one instance joins at 25 s."""
    return list(LongPrefix(groups=30, prefix_tokens=2000, requests=500, rate=8.0).arrivals())


def run(arrivals: list[Arrival], **warm: object) -> Comparison:
    config = SimulationConfig(instances=3, scale=(ScaleEvent(JOIN_AT, 1),), **warm)  # type: ignore[arg-type]
    return compare(arrivals, ["consistent-hash"], config, plugins=PluginManager())


@pytest.fixture(scope="module")
def cold(arrivals: list[Arrival]) -> Comparison:
    return run(arrivals)


@pytest.fixture(scope="module")
def prefilled(arrivals: list[Arrival]) -> Comparison:
    return run(arrivals, prefill=16)


class TestColdJoin:
    def test_the_join_is_measured(self, cold: Comparison, arrivals: list[Arrival]) -> None:
        """A join has a result: its window's requests, those whose home is the new instance, serving at once."""
        (join,) = cold.results[0].joins
        assert join.backend == "i3" and join.time == JOIN_AT and join.serving_from == JOIN_AT
        assert join.warm_requests == 0
        assert 0 < join.moved < join.window_requests
        window = cold.config.join_window
        assert join.window_requests == sum(JOIN_AT <= a.time < JOIN_AT + window for a in arrivals)

    def test_instances_added_together_each_get_their_moved_requests(self, arrivals: list[Arrival]) -> None:
        """With two instances added at once, each join counts the requests homed on its own instance."""
        config = SimulationConfig(instances=3, scale=(ScaleEvent(JOIN_AT, 2),))
        result = compare(arrivals, ["consistent-hash"], config, plugins=PluginManager()).results[0]
        first, second = result.joins
        assert (first.backend, second.backend) == ("i3", "i4")
        assert first.moved > 0 and second.moved > 0
        window = config.join_window
        assert first.window_requests + second.window_requests == sum(
            JOIN_AT <= a.time < JOIN_AT + window for a in arrivals
        )

    def test_no_join_no_result(self, arrivals: list[Arrival]) -> None:
        """Without a scale-up there is no join result."""
        comparison = compare(arrivals[:50], ["consistent-hash"], SimulationConfig(instances=3), plugins=PluginManager())
        assert comparison.results[0].joins == ()


class TestPrefill:
    def test_warms_the_hottest_prefixes_before_taking_traffic(self, prefilled: Comparison) -> None:
        """The new instance gets pre-fill requests and takes live traffic only once they are done."""
        (join,) = prefilled.results[0].joins
        assert 0 < join.warm_requests <= 16
        assert join.serving_from > JOIN_AT

    def test_moved_requests_start_sooner_and_nobody_waits_more(self, cold: Comparison, prefilled: Comparison) -> None:
        """The requests that moved have a lower TTFT p90, and the window's total TTFT is not higher than cold."""
        (c,), (w,) = cold.results[0].joins, prefilled.results[0].joins
        assert w.moved == c.moved and w.window_requests == c.window_requests
        assert w.moved_ttft_p90 < c.moved_ttft_p90
        assert w.all_ttft_mean <= c.all_ttft_mean

    def test_warm_up_requests_are_not_live_traffic(
        self, cold: Comparison, prefilled: Comparison, arrivals: list[Arrival]
    ) -> None:
        """Pre-fill requests count in no TTFT, share or hit rate: the prompt tokens served are the live ones."""
        result = prefilled.results[0]
        assert len(result.ttfts) == result.completed == len(arrivals)
        assert sum(i.prompt_tokens for i in result.instances) == prefilled.prompt_tokens
        assert sum(i.requests for i in result.instances) == len(arrivals)
        assert result.hit_rate >= cold.results[0].hit_rate
        assert result.hit_rate <= prefilled.upper_bound_hit_rate + 1e-12

    def test_without_hot_prefixes_nothing_is_sent(self, arrivals: list[Arrival]) -> None:
        """A join before any prefix was seen twice sends no pre-fill request and serves at once."""
        config = SimulationConfig(instances=3, scale=(ScaleEvent(0.0, 1),), prefill=16)
        (join,) = compare(arrivals[:40], ["consistent-hash"], config, plugins=PluginManager()).results[0].joins
        assert join.warm_requests == 0 and join.serving_from == 0.0


class TestSlowStart:
    def test_the_new_instance_takes_less_in_the_window_and_full_weight_after(self, arrivals: list[Arrival]) -> None:
        """While ramping the new instance serves fewer requests than cold, and the run still completes every request."""
        cold_share = run(arrivals).results[0].instances[-1].requests
        ramped = run(arrivals, slow_start=SlowStart(period=40.0)).results[0]
        assert ramped.instances[-1].requests < cold_share
        assert ramped.completed == len(arrivals)
        assert not math.isnan(ramped.joins[0].moved_ttft_p90)


class TestWarmJoinCommand:
    def test_prints_the_join_table_and_writes_it(self, tmp_path: Path) -> None:
        """--scale with --prefill and --slow-start prints the join table; the JSON holds the joins and settings."""
        out = tmp_path / "run.json"
        args = ["simulate", "-n", "3", "-W", "groups=30", "-W", "prefix_tokens=2000", "--requests", "300"]
        args += ["--rate", "8", "-s", "consistent-hash", "--scale", "20s:+1", "--prefill", "8", "--slow-start", "10"]
        result = CliRunner().invoke(main, [*args, "--json", str(out), "--no-progress"])
        assert result.exit_code == 0, result.output
        assert (
            "after each join (pre-fill of the 8 hottest prefixes, 2 at a time, slow start over 10 s)" in result.output
        )
        assert "moved TTFT p50 / p90" in result.output
        data = json.loads(out.read_text())
        assert data["warm_join"] == {"slow_start": 10.0, "prefill": 8, "prefill_concurrency": 2, "join_window": 60.0}
        (join,) = data["strategies"][0]["joins"]
        assert join["backend"] == "i3" and join["warm_requests"] > 0
