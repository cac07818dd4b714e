"""Goodput under latency objectives in the simulator: --slo, --load, NAME+slo strategies."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

from kvroute import ConfigError, Objectives, Priority
from kvroute.cli import main
from kvroute_simulator.driver import SHED, SimulationConfig, simulate
from kvroute_simulator.load import arrival_rate, measure_capacity, parse_loads, parse_slo, sized_for_load
from kvroute_simulator.workloads import make_workload

SMALL = ["-n", "3", "--requests", "60", "-W", "groups=6", "-W", "prefix_tokens=2000", "-j", "1"]


def _arrivals(requests: int = 80, rate: float = 6.0) -> list:  # type: ignore[type-arg]
    workload = make_workload("long-prefix", requests=requests, groups=6, prefix_tokens=2000, rate=rate, seed=1)
    return list(workload.arrivals())


class TestParsing:
    def test_slo(self) -> None:
        """Objectives read in ms, s or bare milliseconds, either one alone."""
        assert parse_slo("ttft=500ms,tpot=50ms") == Objectives(ttft_s=0.5, tpot_s=0.05)
        assert parse_slo("ttft=1.5s") == Objectives(ttft_s=1.5)
        assert parse_slo("tpot=40") == Objectives(tpot_s=0.04)

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["--slo", "ttft=-1"], "expected KEY=DURATION pairs"),
            (["--slo", "ttft=0ms"], "expected ttft between 1 ms and 1 h (got 'ttft=0ms')"),
            (["--slo", "latency=5ms"], "(got 'latency=5ms')"),
            (["--slo", "ttft=5ms,ttft=6ms"], "expected ttft once"),
            (["--load", "x"], "expected multiples of the fleet's capacity"),
            (["--load", "0.5,-1"], "(got '-1')"),
            (["--load", "1", "--working-set", "0.5"], "give one of them (got both)"),
            (["-s", "nope+slo"], "unknown strategy 'nope+slo'"),
            (["-s", "random+slo", "-o", "random+slo.slo_unmet=never"], "'unmet' must be one of"),
            (["-s", "random+slo", "-o", "random+slo.slo_bogus=1"], "has no option 'slo_bogus'"),
        ],
    )
    def test_bad_values_one_line(self, args: list[str], message: str) -> None:
        """A bad --slo, --load or SLO option exits 2 (usage) or 1 with a one-line error naming what was expected."""
        result = CliRunner().invoke(main, ["simulate", *SMALL, *args])
        assert result.exit_code in (1, 2), result.output
        assert message in result.output.replace("\n", " ")
        assert "Traceback" not in result.output

    def test_loads(self) -> None:
        """Loads are positive multiples, in order."""
        assert parse_loads("0.5, 1,1.5") == [0.5, 1.0, 1.5]


class TestGoodput:
    def test_attainment_matches_the_samples(self) -> None:
        """With a TTFT objective only, attainment is the share of requests whose TTFT is within it."""
        arrivals = _arrivals()
        baseline = simulate(arrivals, "least-outstanding", None, SimulationConfig(instances=2))
        objective = sorted(baseline.ttfts)[len(baseline.ttfts) // 2]
        result = simulate(
            arrivals, "least-outstanding", None, SimulationConfig(instances=2, slo=Objectives(ttft_s=objective))
        )
        within = sum(t <= objective for t in result.ttfts)
        assert result.slo_met == within
        assert result.attainment == pytest.approx(within / len(arrivals))
        window = arrivals[-1].time - arrivals[0].time
        assert result.goodput == pytest.approx(within / (window * len(arrivals) / (len(arrivals) - 1)))
        assert 0 < result.attainment < 1

    def test_tpot_objective_counts(self) -> None:
        """A TPOT objective below every request's TPOT leaves no request meeting it; a lax one keeps them all."""
        arrivals = _arrivals(40)
        tight = simulate(arrivals, "random", None, SimulationConfig(instances=2, slo=Objectives(tpot_s=0.001)))
        lax = simulate(arrivals, "random", None, SimulationConfig(instances=2, slo=Objectives(tpot_s=60.0)))
        assert tight.slo_met == 0 and tight.goodput == 0
        assert lax.slo_met == len(arrivals) and lax.attainment == 1.0
        assert tight.tpot_p99 > 0.001

    def test_slo_aware_run_predicts(self) -> None:
        """A NAME+slo run routes with the SLO-aware choice, learns from the simulated TTFTs and reports its error."""
        arrivals = _arrivals(150, rate=60.0)
        config = SimulationConfig(instances=3, slo=Objectives(ttft_s=0.2))
        result = simulate(arrivals, "bounded-load+slo", {"slo_unmet": "sink"}, config)
        assert result.completed == len(arrivals)
        assert result.prediction_error_p50 == result.prediction_error_p50  # not NaN: TTFTs were observed
        assert 0 <= result.predicted_within_25 <= 1
        assert result.slo_moved > 0
        plain = simulate(arrivals, "bounded-load", None, config)
        assert plain.slo_moved == 0 and plain.prediction_error_p50 != plain.prediction_error_p50

    def test_shedding(self) -> None:
        """NAME+slo+shed answers at once what no instance is predicted to serve in time, except critical requests."""
        arrivals = _arrivals(30)
        hopeless = SimulationConfig(instances=2, slo=Objectives(ttft_s=0.001))
        shed = simulate(arrivals, "random+slo+shed", None, hopeless)
        assert shed.rejected_reasons == {SHED: 30} and shed.completed == 0 and shed.goodput == 0
        critical = attrs.evolve(hopeless, slo=Objectives(ttft_s=0.001, priority=Priority.CRITICAL))
        kept = simulate(arrivals, "random+slo+shed", None, critical)
        assert kept.rejected == 0 and kept.completed == 30
        lax = attrs.evolve(hopeless, slo=Objectives(ttft_s=600.0))
        assert simulate(arrivals, "random+slo+shed", None, lax).rejected == 0

    def test_table_columns(self, tmp_path: Path) -> None:
        """--slo adds TPOT p99, goodput and attainment to the table and to the JSON."""
        out = tmp_path / "r.json"
        result = CliRunner().invoke(
            main, ["simulate", *SMALL, "-s", "random,random+slo", "--slo", "ttft=2s,tpot=100ms", "--json", str(out)]
        )
        assert result.exit_code == 0, result.output
        assert "goodput req/s" in result.output and "SLO attained" in result.output and "random+slo" in result.output
        data = json.loads(out.read_text())
        assert data["slo"] == {"ttft_s": 2.0, "tpot_s": 0.1}
        assert all(s["goodput"] is not None for s in data["strategies"])


class TestLoad:
    def test_capacity_and_scaling(self) -> None:
        """The capacity is positive and each load scales arrival times to load x capacity requests/s."""
        arrivals = _arrivals()
        from kvroute.plugins import PluginManager

        config = SimulationConfig(instances=2)
        capacity = measure_capacity(arrivals, config, PluginManager())
        assert capacity > 0
        scaled = sized_for_load(config, arrivals, 1.5, capacity)
        assert arrival_rate(arrivals) / scaled.time_scale == pytest.approx(1.5 * capacity)
        assert scaled.load == 1.5 and scaled.capacity == capacity

    def test_closed_loop_refused(self) -> None:
        """A workload whose requests all arrive at once cannot be scaled to a load."""
        workload = make_workload("long-prefix", requests=10, concurrency=2)
        with pytest.raises(ConfigError, match="all arrive at once"):
            sized_for_load(SimulationConfig(), list(workload.arrivals()), 1.0, 10.0)

    def test_sweep_cli(self, tmp_path: Path) -> None:
        """--load prints a column per load, writes each run with its load and the capacity, and plots."""
        pytest.importorskip("matplotlib")
        out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
        args = ["simulate", *SMALL, "-s", "least-outstanding,bounded-load+slo", "--slo", "ttft=1s,tpot=100ms"]
        result = CliRunner().invoke(main, [*args, "--load", "0.8,1.5", "--json", str(out), "--plot", str(png)])
        assert result.exit_code == 0, result.output
        assert "load 0.8x" in result.output and "load 1.5x" in result.output
        data = json.loads(out.read_text())
        assert data["capacity"] > 0
        assert [run["load"] for run in data["sweep"]] == [0.8, 1.5]
        assert png.stat().st_size > 0

    def test_time_scale_zero_sends_all_at_once(self) -> None:
        """A time scale of 0 brings every request at time 0 (how the capacity is measured)."""
        arrivals = _arrivals(30)
        config = attrs.evolve(SimulationConfig(instances=2), time_scale=0.0)
        result = simulate(arrivals, "random", None, config)
        assert result.timeline[0][0] == 0.0 and result.completed == 30
