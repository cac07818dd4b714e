"""The working set against the fleet's KV capacity: the pooled-LRU reference, sizing engines, the sweep."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute import ConfigError
from kvroute.cli import main
from kvroute.plugins import PluginManager
from kvroute_simulator.bound import ideal_hit_tokens, pooled_lru_hit_tokens, reused_blocks
from kvroute_simulator.driver import SimulationConfig, compare
from kvroute_simulator.engine import EngineRequest
from kvroute_simulator.tokens import TokenSeq
from kvroute_simulator.workloads import LongPrefix, MultiTurn

BLOCK = 16


def words(seed: int, n: int) -> tuple[int, ...]:
    """Return ``n`` deterministic word ids."""
    return tuple(random.Random(seed).choices(range(8, 32_000), k=n))


def request(name: str, prefix: TokenSeq, tail_seed: int, tail: int = 5, output: int = 1) -> EngineRequest:
    """A request of ``prefix`` plus a unique tail."""
    return EngineRequest(name, prefix.extend(words(tail_seed, tail)), output)


@st.composite
def shared_requests(draw: st.DrawFn) -> list[EngineRequest]:
    """Requests over a few shared prefixes of 1-6 blocks, in a drawn order."""
    prefixes = [TokenSeq.of(words(seed, BLOCK * draw(st.integers(1, 6)))) for seed in range(draw(st.integers(1, 5)))]
    order = draw(st.lists(st.integers(0, len(prefixes) - 1), min_size=1, max_size=30))
    return [request(f"r{i}", prefixes[p], 1000 + i, tail=draw(st.integers(1, 20))) for i, p in enumerate(order)]


class TestPooledLru:
    @settings(max_examples=60, derandomize=True, deadline=None)
    @given(shared_requests(), st.integers(1, 40), st.integers(0, 40))
    def test_more_capacity_never_hits_less_and_never_beats_the_bound(
        self, requests: list[EngineRequest], capacity: int, more: int
    ) -> None:
        """Hits grow with the pooled cache's capacity (LRU keeps what a smaller LRU keeps) up to the bound."""
        small, total = pooled_lru_hit_tokens(requests, capacity)
        large, _ = pooled_lru_hit_tokens(requests, capacity + more)
        ideal, ideal_total = ideal_hit_tokens(requests)
        assert total == ideal_total
        assert small <= large <= ideal

    @settings(max_examples=40, derandomize=True, deadline=None)
    @given(shared_requests())
    def test_a_cache_holding_everything_is_the_bound(self, requests: list[EngineRequest]) -> None:
        """With room for every block, the pooled LRU hits exactly what the infinite cache hits."""
        assert pooled_lru_hit_tokens(requests, 10_000) == ideal_hit_tokens(requests)

    def test_alternating_prefixes_thrash_a_cache_that_holds_one(self) -> None:
        """Two 3-block prefixes in turn: a 4-block cache keeps only each one's first block, a 6-block cache all."""
        a, b = TokenSeq.of(words(1, 3 * BLOCK)), TokenSeq.of(words(2, 3 * BLOCK))
        requests = [request(f"r{i}", (a, b)[i % 2], 100 + i) for i in range(6)]
        assert pooled_lru_hit_tokens(requests, 4)[0] == 4 * BLOCK
        assert pooled_lru_hit_tokens(requests, 6)[0] == 4 * 3 * BLOCK

    def test_the_tail_is_evicted_before_the_prefix(self) -> None:
        """A request's blocks are freed last-to-first: a cache too small for all keeps the leading ones."""
        prefix = TokenSeq.of(words(1, 4 * BLOCK))
        first = EngineRequest("a", prefix.extend(words(2, 2 * BLOCK)), 1)  # 6 full blocks
        again = request("b", prefix, 3)
        assert pooled_lru_hit_tokens([first, again], 4)[0] == 4 * BLOCK

    def test_capacity_must_be_positive(self) -> None:
        """A pooled cache of no block is refused with the value got."""
        with pytest.raises(ValueError, match=r"'capacity_blocks' must be at least 1 \(got 0\)"):
            pooled_lru_hit_tokens([], 0)


class TestReusedBlocks:
    def test_long_prefix_reuses_the_prefix_of_every_group_seen_twice(self) -> None:
        """The working set of long-prefix is the full prefix blocks of each group requested more than once."""
        workload = LongPrefix(groups=6, prefix_tokens=318, question_tokens=(20, 40), requests=40)
        arrivals = list(workload.arrivals())
        groups = {a.session_id for a in arrivals}
        repeated = [g for g in groups if sum(a.session_id == g for a in arrivals) > 1]
        assert len(repeated) == 6
        # <|system|> + 318 words + <|end|> = 320 tokens = 20 full blocks per prefix.
        assert reused_blocks([a.engine_request() for a in arrivals]) == 6 * 20

    def test_conversations_reuse_their_history(self) -> None:
        """In multi-turn, the history a later turn reuses (answers included) is part of the working set."""
        arrivals = list(MultiTurn(system_tokens=40, requests=60, rate=2.0).arrivals())
        requests = [a.engine_request() for a in arrivals]
        system_blocks = 42 // BLOCK
        assert reused_blocks(requests) > 10 * system_blocks
        assert reused_blocks(requests) * BLOCK <= ideal_hit_tokens(requests)[0]


@pytest.fixture(scope="module")
def requests() -> list[EngineRequest]:
    """10 groups of a 20-block prefix, each requested several times."""
    workload = LongPrefix(
        groups=10, prefix_tokens=318, question_tokens=(20, 40), output_tokens=(5, 10), requests=100, rate=20.0
    )
    return [a.engine_request() for a in workload.arrivals()]


class TestSizedFor:
    @pytest.mark.parametrize("ratio", [0.5, 0.8, 1.0, 1.5])
    def test_the_reused_blocks_fill_that_share_of_the_fleet(self, requests: list[EngineRequest], ratio: float) -> None:
        """Each engine gets ceil(reused blocks / (ratio x instances)) blocks, and the ratio is recorded."""
        sized = SimulationConfig(instances=4).sized_for(requests, ratio)
        assert sized.engine.capacity_blocks == math.ceil(200 / (ratio * 4))
        assert sized.working_set == ratio and sized.instances == 4
        assert sized.fleet_blocks == 4 * sized.engine.capacity_blocks

    def test_too_small_for_the_largest_request_is_refused(self, requests: list[EngineRequest]) -> None:
        """A ratio that leaves an engine smaller than the largest request says so, with both sizes."""
        with pytest.raises(ConfigError, match=r"would leave 5 KV blocks per instance .* largest request needs \(2\d\)"):
            SimulationConfig(instances=4).sized_for(requests, 10.0)

    def test_needs_shared_prefixes(self) -> None:
        """A workload that reuses nothing cannot be sized by its working set."""
        unique = [request(f"r{i}", TokenSeq.of(words(i, 40)), 100 + i) for i in range(5)]
        with pytest.raises(ConfigError, match="needs a workload whose requests share prefixes"):
            SimulationConfig().sized_for(unique, 0.8)

    @pytest.mark.parametrize("ratio", [0, -1.0, math.nan, math.inf])
    def test_ratio_must_be_positive_and_finite(self, requests: list[EngineRequest], ratio: float) -> None:
        """A ratio that is not a positive number is refused with its value."""
        with pytest.raises(ConfigError, match="'working_set' must be a positive number"):
            SimulationConfig().sized_for(requests, ratio)


class TestComparisonReference:
    def test_pooled_reference_between_strategies_and_bound(self) -> None:
        """On a tight fleet the pooled LRU loses hits against the bound, and hash placement stays under it."""
        arrivals = list(LongPrefix(groups=8, prefix_tokens=500, requests=200, rate=4.0).arrivals())
        config = SimulationConfig(instances=2).sized_for([a.engine_request() for a in arrivals], 1.5)
        comparison = compare(arrivals, ["random", "consistent-hash"], config, plugins=PluginManager())
        assert comparison.pooled_hit_rate < comparison.upper_bound_hit_rate - 0.05
        for result in comparison.results:
            assert result.hit_rate <= comparison.pooled_hit_rate + 0.02, result.strategy

    def test_a_cache_large_enough_reaches_the_bound(self) -> None:
        """With the default (huge) engines the pooled reference equals the upper bound."""
        arrivals = list(LongPrefix(groups=8, prefix_tokens=500, requests=60).arrivals())
        comparison = compare(arrivals, ["random"], SimulationConfig(instances=2), plugins=PluginManager())
        assert comparison.pooled_hit_rate == comparison.upper_bound_hit_rate


SWEEP = ["simulate", "-n", "2", "-W", "groups=8", "-W", "prefix_tokens=500", "--requests", "150", "--rate", "4"]


class TestWorkingSetCommand:
    def test_one_ratio_prints_the_table_with_the_pooled_reference(self, tmp_path: Path) -> None:
        """--working-set 0.8 sizes the engines and the caption and JSON give the pooled LRU reference."""
        out = tmp_path / "run.json"
        result = CliRunner().invoke(
            main, [*SWEEP, "-s", "random", "--working-set", "0.8", "--json", str(out), "--no-progress"]
        )
        assert result.exit_code == 0, result.output
        assert "pooled LRU reference (one cache of the fleet's" in result.output
        assert "sized for a working set of 80%" in result.output
        data = json.loads(out.read_text())
        assert data["working_set"] == 0.8
        assert data["engine"]["capacity_blocks"] * 2 * 0.8 >= 8 * 31
        assert 0 < data["pooled_hit_rate"] <= data["upper_bound_hit_rate"]

    def test_no_pooled_line_when_the_caches_hold_everything(self) -> None:
        """Without --working-set the default engines keep every block: the caption stays as it was, no reference."""
        result = CliRunner().invoke(main, [*SWEEP, "-s", "random", "--no-progress"])
        assert result.exit_code == 0, result.output
        assert "upper bound hit rate" in result.output and "pooled LRU" not in result.output

    def test_several_ratios_print_a_sweep(self, tmp_path: Path) -> None:
        """A comma-separated list prints one column per ratio, the references and every strategy; JSON per run."""
        out = tmp_path / "sweep.json"
        args = [*SWEEP, "-s", "random,consistent-hash", "--working-set", "0.5,1.5", "--json", str(out)]
        result = CliRunner().invoke(main, [*args, "--no-progress"])
        assert result.exit_code == 0, result.output
        for text in ("working set 50%", "working set 150%", "pooled LRU (reference)", "upper bound", "consistent-hash"):
            assert text in result.output
        runs = json.loads(out.read_text())["sweep"]
        assert [r["working_set"] for r in runs] == [0.5, 1.5]
        assert runs[0]["engine"]["capacity_blocks"] > 2.9 * runs[1]["engine"]["capacity_blocks"]
        assert runs[0]["pooled_hit_rate"] > runs[1]["pooled_hit_rate"]
        assert [s["strategy"] for s in runs[1]["strategies"]] == ["random", "consistent-hash"]

    def test_sweep_plot_writes_a_png(self, tmp_path: Path) -> None:
        """--plot with a sweep draws hit rate and TTFT against the working set."""
        pytest.importorskip("matplotlib")
        out = tmp_path / "sweep.png"
        args = [*SWEEP, "-s", "random", "--working-set", "0.5,1.0", "--plot", str(out), "--no-progress"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    @pytest.mark.parametrize(
        ("extra", "message"),
        [
            (["--working-set", "0.5,lots"], "expected positive numbers separated by commas"),
            (["--working-set", "0"], "expected positive numbers separated by commas"),
            (["--working-set", "0.8", "-E", "capacity_blocks=900"], "give one or the other"),
            (["-W", "working_set=0.8"], "use --working-set 0.8"),
        ],
    )
    def test_mistakes_exit_2(self, extra: list[str], message: str) -> None:
        """A bad ratio, a ratio with an explicit capacity, or the ratio as a workload option is a usage error."""
        result = CliRunner().invoke(main, [*SWEEP, "-s", "random", *extra, "--no-progress"])
        assert result.exit_code == 2, result.output
        assert message in result.output and "--working-set" in result.output
