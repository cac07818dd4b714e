"""Validation of the simulator's settings: attrs validators with messages saying what was expected and what was got."""

from __future__ import annotations

import builtins
import collections.abc
import importlib
import math
import pkgutil
import re
import typing
from pathlib import Path
from typing import Any

import attrs
import pytest
from click.testing import CliRunner

import kvroute_simulator
from kvroute import ConfigError
from kvroute.cli import main
from kvroute_simulator.driver import SimulationConfig
from kvroute_simulator.engine import CostModel, EngineConfig, EngineRequest, HardwareSpec, ModelSpec
from kvroute_simulator.tokens import TokenSeq
from kvroute_simulator.workloads import LongPrefix, Rag, Trace

FIXTURES = Path(__file__).parent / "fixtures"


class TestSettings:
    """What the attrs classes of the engine model, the workloads and the driver refuse, and how they say it."""

    @pytest.mark.parametrize(
        ("build", "message"),
        [
            (lambda: EngineConfig(max_num_seqs=0), "'max_num_seqs' must be a positive integer (got 0)."),
            (lambda: EngineConfig(block_size=True), "'block_size' must be a positive integer (got True)."),
            (
                lambda: EngineConfig(enable_prefix_caching="no"),
                "'enable_prefix_caching' must be true or false (got 'no').",
            ),
            (lambda: CostModel(prefill_base_ms=-1), "'prefill_base_ms' must be a number >= 0 (got -1)."),
            (lambda: CostModel(decode_base_ms=math.inf), "'decode_base_ms' must be a number >= 0 (got inf)."),
            (
                lambda: HardwareSpec(memory_utilization=1.5),
                "'memory_utilization' must be a number above 0 and at most 1 (got 1.5).",
            ),
            (lambda: HardwareSpec(num_gpus=0), "'num_gpus' must be a positive integer (got 0)."),
            (
                lambda: ModelSpec("m", num_layers=2.5, num_kv_heads=8, head_dim=128, weight_bytes=1),
                "'num_layers' must be a positive integer (got 2.5).",
            ),
            (lambda: EngineRequest("r", TokenSeq.of((1, 2)), 0), "'output_len' must be a positive integer (got 0)."),
            (lambda: SimulationConfig(instances=0), "'instances' must be a positive integer (got 0)."),
            (lambda: SimulationConfig(instances="3"), "'instances' must be a positive integer (got '3')."),
            (
                lambda: SimulationConfig(sample_interval=math.nan),
                "'sample_interval' must be a positive number (got nan).",
            ),
            (lambda: LongPrefix(rate=-2.0), "'rate' must be a positive number (got -2.0)."),
            (lambda: LongPrefix(concurrency=0), "'concurrency' must be a positive integer (got 0)."),
            (lambda: LongPrefix(groups=None), "'groups' must be a positive integer (got None)."),
            (lambda: Rag(zipf_s=-0.5), "'zipf_s' must be a number >= 0 (got -0.5)."),
            (
                lambda: Trace(path=FIXTURES / "simple.jsonl", format="xml"),
                "'format' must be auto, mooncake or simple (got 'xml').",
            ),
        ],
    )
    def test_refused_with_a_config_error(self, build: Any, message: str) -> None:
        """A setting out of its range or of the wrong type is a ConfigError (a ValueError) naming the field, what it
        must be and the value."""
        with pytest.raises(ConfigError) as info:
            build()
        assert str(info.value) == message

    def test_optional_settings_take_none(self) -> None:
        """Cut-offs that may be absent accept None."""
        assert LongPrefix(requests=None, duration=10.0).requests is None
        assert LongPrefix(concurrency=None).concurrency is None

    def test_wrong_trace_format_is_an_error_line(self) -> None:
        """`kvroute simulate --trace F -W format=xml` exits 1 with the message, not a traceback."""
        args = ["simulate", "--trace", str(FIXTURES / "simple.jsonl"), "-s", "random", "-W", "format=xml"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and type(result.exception) is SystemExit, result.exception
        assert "Error: 'format' must be auto, mooncake or simple (got 'xml')." in result.output


def _public_names() -> dict[str, set[str]]:
    found = {"kvroute_simulator": set(kvroute_simulator.__all__)}
    for info in pkgutil.walk_packages(kvroute_simulator.__path__, "kvroute_simulator."):
        module = importlib.import_module(info.name)
        found[info.name] = set(getattr(module, "__all__", ()))
    return found


class TestNames:
    def test_no_public_name_shadows_a_standard_one(self) -> None:
        """No public name of kvroute_simulator reuses a name of collections.abc, typing or builtins (the engine's
        sequence is EngineSequence)."""
        standard = set(collections.abc.__all__) | set(typing.__all__) | set(dir(builtins))
        clashes = {module: sorted(names & standard) for module, names in _public_names().items() if names & standard}
        assert clashes == {}
        assert "EngineSequence" in kvroute_simulator.__all__

    def test_emulator_metrics_are_named_for_the_emulator(self) -> None:
        """The emulator's metrics renderer is EmulatedMetrics, not a second VllmMetrics beside kvroute-vllm's parser."""
        names = set().union(*_public_names().values())
        assert "EmulatedMetrics" in names and "VllmMetrics" not in names


_SETTINGS = [f for f in attrs.fields(SimulationConfig) if "setting" in f.metadata]


class TestSimulateDocs:
    @pytest.mark.parametrize("field", _SETTINGS, ids=[f.name for f in _SETTINGS])
    def test_every_option_setting_in_the_table(self, field: Any) -> None:
        """Each SimulationConfig setting with a flag is a row of docs/simulation.md's options table."""
        text = (Path(__file__).resolve().parents[2] / "docs" / "simulation.md").read_text(encoding="utf-8")
        table = text.split("| option | meaning |", 1)[1].split("\n\n", 1)[0]
        flag = field.metadata["setting"].flag
        rows = [row for row in table.splitlines() if re.search(rf"`{flag}[ `]", row)]
        assert rows, f"{flag} is not in docs/simulation.md's options table"
        shown = re.search(r"\((\d+)\) \|$", rows[0])
        if shown:  # a row that states the default states the field's
            assert int(shown[1]) == field.default
