"""The simulation driver and the ``kvroute simulate`` command: real strategies over simulated engines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvroute import ConfigError
from kvroute.cli import main
from kvroute.plugins import PluginManager
from kvroute_simulator.driver import ScaleEvent, SimulationConfig, StrategyResult, compare, parse_scale, simulate
from kvroute_simulator.engine import Engine, EngineConfig, EngineRequest, EngineSequence
from kvroute_simulator.workloads import Arrival, LongPrefix, MultiTurn, make_workload

FIXTURES = Path(__file__).parent / "fixtures"
#: 80 Mooncake lines sharing prefixes; line 41 asks for 135,000 + 155 tokens, over max_model_len.
SHARED_TRACE = FIXTURES / "mooncake_shared.jsonl"
OVER_MAX_MODEL_LEN = "prompt + output longer than max_model_len=131,072 tokens"

SMALL = {"groups": 12, "prefix_tokens": 1000, "requests": 150, "rate": 15.0}


@pytest.fixture(scope="module")
def plugins() -> PluginManager:
    return PluginManager()


@pytest.fixture(scope="module")
def arrivals() -> list[Arrival]:
    return list(LongPrefix(**SMALL).arrivals())  # type: ignore[arg-type]


def figures(result: StrategyResult) -> dict[str, Any]:
    """Everything but wall-clock measurements."""
    data = result.to_json(include_samples=True)
    for key in ("wall_time", "route_cost_p50", "route_cost_p99"):
        data.pop(key)
    return data


class TestParseScale:
    def test_parses_times_with_units_in_order(self) -> None:
        """Items are TIME:+N or TIME:-N with ms, s, m or h (seconds by default), returned in time order."""
        assert parse_scale("10m:-2, 300s:+1,90:+3") == (
            ScaleEvent(90.0, 3),
            ScaleEvent(300.0, 1),
            ScaleEvent(600.0, -2),
        )

    @pytest.mark.parametrize("spec", ["300s", "300s:1", "soon:+1", "5s:+0"])
    def test_bad_item_names_the_expected_shape(self, spec: str) -> None:
        """A malformed item is refused with an example of the right shape."""
        with pytest.raises(ConfigError, match=r"must look like TIME:\+N or TIME:-N"):
            parse_scale(spec)


class TestSimulate:
    def test_every_request_completes_with_a_ttft(self, arrivals: list[Arrival], plugins: PluginManager) -> None:
        """Each arrival is routed, served and released; TTFT percentiles are ordered."""
        result = simulate(arrivals, "random", config=SimulationConfig(instances=3), plugins=plugins)
        assert result.completed == result.requests == len(arrivals)
        assert len(result.ttfts) == len(arrivals)
        assert 0 < result.ttft_p50 <= result.ttft_p90 <= result.ttft_p99
        assert sum(i.requests for i in result.instances) == len(arrivals)
        assert result.decisions == {"random": len(arrivals)}

    def test_same_seed_same_figures(self, arrivals: list[Arrival], plugins: PluginManager) -> None:
        """Two runs with the same seed give the same figures for seeded and hash strategies."""
        config = SimulationConfig(instances=4, seed=5)
        for name in ("random", "bounded-load"):
            one = simulate(arrivals, name, config=config, plugins=plugins)
            two = simulate(arrivals, name, config=config, plugins=plugins)
            assert figures(one) == figures(two)

    def test_prefix_routing_beats_random_on_shared_prefixes(
        self, arrivals: list[Arrival], plugins: PluginManager
    ) -> None:
        """Consistent hashing by prefix hits the cache more and gets the first token sooner than random."""
        config = SimulationConfig(instances=4)
        rnd = simulate(arrivals, "random", config=config, plugins=plugins)
        ch = simulate(arrivals, "consistent-hash", config=config, plugins=plugins)
        assert ch.hit_rate > rnd.hit_rate + 0.1
        assert ch.ttft_p50 < rnd.ttft_p50

    def test_random_hits_more_with_fewer_instances(self, arrivals: list[Arrival], plugins: PluginManager) -> None:
        """Spreading the same traffic over more instances dilutes each cache."""
        hit = {
            n: simulate(arrivals, "random", config=SimulationConfig(instances=n), plugins=plugins).hit_rate
            for n in (1, 3, 8)
        }
        assert hit[1] > hit[3] > hit[8]

    def test_one_instance_makes_strategies_equal(self, arrivals: list[Arrival], plugins: PluginManager) -> None:
        """With a single instance every strategy sends everything to it: identical TTFTs and hit rate."""
        config = SimulationConfig(instances=1)
        results = [simulate(arrivals, name, config=config, plugins=plugins) for name in sorted(plugins.strategies)]
        assert len({r.ttfts for r in results}) == 1
        assert len({r.hit_rate for r in results}) == 1

    def test_unknown_strategy_is_a_config_error(self, arrivals: list[Arrival], plugins: PluginManager) -> None:
        """A strategy that no plugin registered is refused by name."""
        with pytest.raises(ConfigError, match="unknown strategy 'nope'"):
            simulate(arrivals, "nope", plugins=plugins)

    def test_closed_loop_turns_wait_for_the_previous_answer(
        self, plugins: PluginManager, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A conversation's next turn reaches an engine exactly think_time after the previous turn finished."""
        # Long answers (~6 s of decoding) and short think times: sent at its nominal time, a turn
        # would arrive while the turn it follows is still decoding.
        turns = list(
            MultiTurn(system_tokens=50, requests=60, rate=2.0, think_time=0.5, answer_tokens=(400, 500)).arrivals()
        )
        followers = [a for a in turns if a.follows is not None]
        assert len(followers) > 20
        submitted: dict[str, tuple[float, EngineSequence]] = {}
        original = Engine.submit

        def recording_submit(engine: Engine, request: EngineRequest, now: float) -> EngineSequence:
            seq = original(engine, request, now)
            submitted[request.request_id] = (now, seq)
            return seq

        monkeypatch.setattr(Engine, "submit", recording_submit)
        result = simulate(turns, "random", config=SimulationConfig(instances=2), plugins=plugins)
        assert result.completed == 60
        for turn in followers:
            assert turn.follows is not None
            sent, _ = submitted[turn.request_id]
            finished = submitted[turn.follows][1].finish_time
            assert finished is not None
            assert sent == pytest.approx(finished + turn.think_time, abs=1e-9), turn.request_id

    def test_scale_events_add_and_remove_instances(self, plugins: PluginManager) -> None:
        """A scale-up adds a cold instance at its time; a scale-down removes the newest; every request completes."""
        arrivals = list(LongPrefix(**{**SMALL, "requests": 200, "rate": 10.0}).arrivals())  # type: ignore[arg-type]
        config = SimulationConfig(instances=3, scale=(ScaleEvent(5.0, 1), ScaleEvent(12.0, -2)), sample_interval=2.0)
        result = simulate(arrivals, "least-outstanding", config=config, plugins=plugins)
        by_id = {i.id: i for i in result.instances}
        assert set(by_id) == {"i0", "i1", "i2", "i3"}
        assert by_id["i3"].added_at == 5.0 and by_id["i3"].removed_at == 12.0
        assert by_id["i2"].removed_at == 12.0 and by_id["i0"].removed_at is None
        assert by_id["i3"].requests > 0
        assert result.completed == 200
        late = [flight for t, _, flight in result.timeline if t >= 14.0]
        assert late and all(set(f) == {"i0", "i1"} for f in late)

    def test_compare_reports_the_upper_bound(self, arrivals: list[Arrival], plugins: PluginManager) -> None:
        """The comparison carries every result and an upper bound no strategy exceeds."""
        comparison = compare(arrivals, ["random", "consistent-hash"], SimulationConfig(instances=3), plugins=plugins)
        assert [r.strategy for r in comparison.results] == ["random", "consistent-hash"]
        assert all(r.hit_rate <= comparison.upper_bound_hit_rate + 1e-9 for r in comparison.results)
        assert comparison.baseline() is comparison.results[0]

    def test_engine_settings_apply(self, arrivals: list[Arrival], plugins: PluginManager) -> None:
        """A tiny cache evicts prefixes and lowers the hit rate."""
        big = simulate(arrivals, "consistent-hash", config=SimulationConfig(instances=2), plugins=plugins)
        small = simulate(
            arrivals,
            "consistent-hash",
            config=SimulationConfig(instances=2, engine=EngineConfig(capacity_blocks=300)),
            plugins=plugins,
        )
        assert small.hit_rate < big.hit_rate


class TestRejections:
    def test_a_request_over_max_model_len_is_rejected_and_the_rest_served(self, plugins: PluginManager) -> None:
        """An engine refuses a request longer than max_model_len (as vLLM's 400): it counts as rejected, with its
        reason."""
        arrivals = list(make_workload("trace", path=SHARED_TRACE).arrivals())
        result = simulate(arrivals, "consistent-hash", config=SimulationConfig(instances=3), plugins=plugins)
        assert result.rejected == 1
        assert result.rejected_reasons == {OVER_MAX_MODEL_LEN: 1}
        assert result.completed == len(arrivals) - 1
        assert sum(i.requests for i in result.instances) == len(arrivals) - 1
        # The router saw it routed and released (as an error), like every other request.
        assert sum(result.decisions.values()) == len(arrivals)

    def test_engine_limits_apply(self, plugins: PluginManager) -> None:
        """A lower max_model_len refuses more requests; the reason names the limit."""
        arrivals = list(make_workload("trace", path=SHARED_TRACE).arrivals())
        config = SimulationConfig(instances=2, engine=EngineConfig(max_model_len=2048))
        result = simulate(arrivals, "random", config=config, plugins=plugins)
        expected = sum(1 for a in arrivals if a.prompt_len + a.output_len > 2048)
        assert expected > 1
        assert result.rejected_reasons == {"prompt + output longer than max_model_len=2,048 tokens": expected}
        assert result.completed == len(arrivals) - expected

    def test_no_backend_is_a_rejection_reason(self, plugins: PluginManager) -> None:
        """Requests arriving after a scale-down to no instance are rejected as such."""
        arrivals = list(LongPrefix(**{**SMALL, "requests": 40}).arrivals())  # type: ignore[arg-type]
        config = SimulationConfig(instances=1, scale=(ScaleEvent(1.0, -1),))
        result = simulate(arrivals, "random", config=config, plugins=plugins)
        late = sum(1 for a in arrivals if a.time >= 1.0)
        assert late > 0
        assert result.rejected_reasons == {"no instance in the fleet": late}


JSON_FIELDS = {
    "workload",
    "workload_options",
    "seed",
    "instances",
    "engine",
    "scale",
    "requests",
    "rejected",
    "rejected_reasons",
    "prompt_tokens",
    "upper_bound_hit_rate",
    "pooled_hit_rate",
    "working_set",
    "slo",
    "load",
    "capacity",
    "warm_join",
    "baseline",
    "strategies",
    "wall_time",
}
STRATEGY_FIELDS = {
    "strategy",
    "options",
    "requests",
    "completed",
    "rejected",
    "rejected_reasons",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "ttft_mean",
    "hit_rate",
    "output_tokens",
    "makespan",
    "output_throughput",
    "share_min",
    "share_max",
    "spills",
    "route_cost_p50",
    "route_cost_p99",
    "preemptions",
    "wall_time",
    "instances",
    "decisions",
    "timeline",
    "joins",
    "tpot_p50",
    "tpot_p99",
    "slo_met",
    "goodput",
    "attainment",
    "prediction_error_p50",
    "predicted_within_25",
    "slo_moved",
    "vs_baseline",
}
SMALL_ARGS = [
    "-W",
    "groups=12",
    "-W",
    "prefix_tokens=1000",
    "-W",
    "question_tokens=20..60",
    "--requests",
    "120",
    "--rate",
    "15",
]


class TestSimulateCommand:
    def test_no_strategy_installed_says_what_to_install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """With no strategy plugin loaded, simulate exits 1 naming a pip command instead of printing an empty table."""
        from kvroute_simulator.cli import simulate as simulate_command

        names = {r.plugin.name for r in PluginManager().strategies.values()}
        monkeypatch.setenv("KVROUTE_BLOCK_PLUGINS", ",".join(sorted(names)))
        result = CliRunner().invoke(simulate_command, [*SMALL_ARGS, "--no-progress"])
        assert result.exit_code == 1, result.output
        assert "no strategy plugin is installed" in result.output and 'pip install "kvroute[' in result.output

    def test_runs_end_to_end_and_writes_every_json_field(self, tmp_path: Path) -> None:
        """The command prints the table and its JSON holds every documented field, for every strategy."""
        out = tmp_path / "results.json"
        result = CliRunner().invoke(
            main,
            ["simulate", *SMALL_ARGS, "-n", "3", "-s", "random,bounded-load", "--scale", "4s:+1", "--json", str(out)],
        )
        assert result.exit_code == 0, result.output
        assert "upper bound hit rate" in result.output and "bounded-load" in result.output
        data = json.loads(out.read_text())
        assert set(data) == JSON_FIELDS
        assert [s["strategy"] for s in data["strategies"]] == ["random", "bounded-load"]
        for strategy in data["strategies"]:
            assert set(strategy) == STRATEGY_FIELDS
            assert strategy["completed"] == 120
        assert data["strategies"][0]["vs_baseline"] is None
        assert set(data["strategies"][1]["vs_baseline"]) == {
            "ttft_p50",
            "ttft_p90",
            "ttft_p99",
            "hit_rate_points",
            "output_throughput",
        }
        assert data["scale"] == [{"time": 4.0, "delta": 1}]
        assert data["workload_options"]["question_tokens"] == [20, 60]

    def test_same_seed_same_table(self) -> None:
        """Two runs with the same seed print the same figures (wall-clock columns aside)."""
        args = ["simulate", *SMALL_ARGS, "-n", "3", "-s", "random,consistent-hash", "--seed", "4"]

        def rows(output: str) -> list[str]:
            return [line.rsplit("│", 3)[0] for line in output.splitlines() if line.startswith("│")]

        one = CliRunner().invoke(main, args)
        two = CliRunner().invoke(main, args)
        assert one.exit_code == two.exit_code == 0
        assert rows(one.output) == rows(two.output) and rows(one.output)

    def test_plot_writes_a_png(self, tmp_path: Path) -> None:
        """--plot writes a PNG with the TTFT CDF, the hit rate over time and the per-instance load."""
        pytest.importorskip("matplotlib")
        out = tmp_path / "run.png"
        result = CliRunner().invoke(main, ["simulate", *SMALL_ARGS, "-s", "random", "--plot", str(out)])
        assert result.exit_code == 0, result.output
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def test_trace_replay(self) -> None:
        """--trace replays a Mooncake file."""
        fixture = FIXTURES / "mooncake.jsonl"
        result = CliRunner().invoke(main, ["simulate", "--trace", str(fixture), "-s", "random", "-n", "2"])
        assert result.exit_code == 0, result.output
        assert "trace, 4 requests" in result.output
        assert "rejected" not in result.output

    def test_trace_with_an_oversized_request_completes_and_says_so(self, tmp_path: Path) -> None:
        """--trace FILE -n 8 with a request over max_model_len prints the table, the count and the reason."""
        out = tmp_path / "results.json"
        result = CliRunner().invoke(
            main,
            ["simulate", "--trace", str(SHARED_TRACE), "-n", "8", "-s", "random,consistent-hash", "--json", str(out)],
        )
        assert result.exit_code == 0, result.output
        assert result.exception is None
        assert "trace, 80 requests, 8 instances" in result.output
        assert "rejected: 1 of 80 requests" in result.output
        assert f"1: {OVER_MAX_MODEL_LEN}" in result.output
        data = json.loads(out.read_text())
        assert (data["rejected"], data["rejected_reasons"]) == (1, {OVER_MAX_MODEL_LEN: 1})
        for strategy in data["strategies"]:
            assert (strategy["rejected"], strategy["rejected_reasons"]) == (1, {OVER_MAX_MODEL_LEN: 1})
            assert strategy["completed"] == 79

    @pytest.mark.parametrize(
        ("content", "message"),
        [
            (
                b'{"timestamp": 0, "input_length": 100, "output_length": 4}\n{"timestamp": 1, "input_le',
                ":2: expected a JSON object (got invalid JSON",
            ),
            (
                b'{"timestamp": 0, "input_length": "12x", "output_length": 4}\n',
                ":1: 'input_length' must be an integer >= 1 (got '12x')",
            ),
            (
                b'{"timestamp": 0, "input_length": 100, "output_length": 4}\n\xff\xfe\n',
                ":2: expected UTF-8 text (got byte 0xff",
            ),
            (b"[1, 2]\n", ":1: expected a JSON object (got list)"),
        ],
        ids=["truncated-json", "bad-field", "not-utf8", "not-an-object"],
    )
    def test_malformed_trace_line_is_a_clean_error(self, tmp_path: Path, content: bytes, message: str) -> None:
        """A bad trace line exits with status 1 and a message naming the file and line, never a traceback."""
        trace = tmp_path / "bad.jsonl"
        trace.write_bytes(content)
        result = CliRunner().invoke(main, ["simulate", "--trace", str(trace), "-n", "8", "-s", "random"])
        assert result.exit_code == 1
        assert type(result.exception) is SystemExit, result.exception  # a ClickException, not a crash
        assert f"Error: {trace}{message}" in result.output

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["--scale", "soon"], "must look like TIME:+N"),
            (["-s", "nope"], "unknown strategy 'nope'"),
            (["-W", "groups"], "expected KEY=VALUE"),
            (["-W", "colour=blue"], "has no option 'colour'"),
            (["-o", "random.seed=1", "-s", "consistent-hash"], "options given for 'random', which does not run"),
            (["-E", "max_num_seqs=0"], "'max_num_seqs' must be a positive integer"),
            (["-w", "trace"], "needs --trace FILE"),
            (["-W", "rate=fast"], "'rate' must be a positive number (got 'fast')"),
            (["-W", "groups=1.5"], "'groups' must be a positive integer (got 1.5)"),
            (["-W", "question_tokens=many"], "'question_tokens' must be a number of tokens N or a range LO..HI"),
            (["-W", "question_tokens=9..3"], "with 1 <= LO <= HI (got (9, 3))"),
            (["-W", "seed=x"], "'seed' must be an integer (got 'x')"),
            (["-w", "hot-prefix", "-W", "hot_share=2"], "'hot_share' must be a number between 0 and 1 (got 2)"),
            (["-E", "block_size=big"], "'block_size' must be a positive integer (got 'big')"),
            (["-E", "enable_prefix_caching=maybe"], "'enable_prefix_caching' must be true or false (got 'maybe')"),
        ],
    )
    def test_bad_arguments_are_explained(self, args: list[str], message: str) -> None:
        """A wrong option exits with an error message saying what is wrong, never a traceback."""
        result = CliRunner().invoke(main, ["simulate", "--requests", "5", "-s", "random", *args])
        assert result.exit_code in (1, 2)
        assert type(result.exception) is SystemExit, result.exception
        assert message in result.output

    def test_help_has_examples(self) -> None:
        """--help shows the options and examples."""
        result = CliRunner().invoke(main, ["simulate", "--help"])
        assert result.exit_code == 0
        assert "Examples:" in result.output and "--scale" in result.output and "--json" in result.output
