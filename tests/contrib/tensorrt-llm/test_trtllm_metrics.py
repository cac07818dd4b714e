"""TensorRT-LLM load telemetry: JSON iteration stats (drained, nulls, empty lists) and Prometheus gauges."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kvroute_tensorrt_llm import TrtllmStats, merge_iteration_stats, parse_prometheus

FIXTURES = Path(__file__).resolve().parent / "fixtures"

TRITON = """\
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 5
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 3
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 64
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.75
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 8000
"""


def _metrics() -> list[Any]:
    return json.loads((FIXTURES / "metrics_sequence.json").read_text())


class TestIterationStats:
    def test_documented_example(self) -> None:
        """engines.md's iteration stats give running, waiting, usage, block size and token counters; the latest wins."""
        stats = merge_iteration_stats(None, _metrics()[0])
        assert (stats.running, stats.waiting, stats.block_size, stats.iteration) == (1, 0, 32, 154)
        assert stats.kv_usage == pytest.approx(3 / 101256)
        assert (stats.prefix_cache_hits, stats.prefix_cache_queries) == (4 * 32, (4 + 3121) * 32)
        assert stats.max_blocks == 101256

    def test_empty_list_keeps_the_last_values(self) -> None:
        """No iteration since the last poll: the values stay what they were."""
        first = merge_iteration_stats(None, _metrics()[0])
        assert merge_iteration_stats(first, []) == first

    def test_null_fields_keep_earlier_values(self) -> None:
        """Fields serialized as null (missing optionals) do not erase what an earlier iteration said."""
        first = merge_iteration_stats(None, _metrics()[0])
        third = merge_iteration_stats(first, _metrics()[2])
        assert (third.running, third.waiting, third.kv_usage) == (3, first.waiting, first.kv_usage)
        assert third.prefix_cache_hits == 10 * 32 and third.prefix_cache_queries == first.prefix_cache_queries

    def test_null_kv_stats_keep_cache_values(self) -> None:
        """An iteration without kvCacheStats updates only the request counts."""
        first = merge_iteration_stats(None, _metrics()[0])
        fourth = merge_iteration_stats(first, _metrics()[3])
        assert (fourth.running, fourth.waiting, fourth.block_size, fourth.kv_usage) == (0, 0, 32, first.kv_usage)

    def test_used_blocks_from_free_blocks(self) -> None:
        """Without usedNumBlocks, usage is computed from maxNumBlocks - freeNumBlocks."""
        stats = merge_iteration_stats(None, [{"kvCacheStats": {"maxNumBlocks": 100, "freeNumBlocks": 75}}])
        assert stats.kv_usage == pytest.approx(0.25)

    def test_to_load(self) -> None:
        """The EngineLoad carries the values and the observation time."""
        load = TrtllmStats(running=1, waiting=2, block_size=32).to_load(observed_at=3.0)
        assert (load.running, load.waiting, load.block_size, load.observed_at) == (1, 2, 32, 3.0)

    @pytest.mark.parametrize(
        ("data", "message"),
        [
            ({"iter": 1}, "JSON list"),
            (["x"], "object of iteration stats"),
            ([{"numActiveRequests": "3"}], "number or null"),
            ([{"kvCacheStats": [1]}], "object or null"),
            ([{"numActiveRequests": True}], "number or null"),
        ],
    )
    def test_malformed_answers(self, data: object, message: str) -> None:
        """Anything but TensorRT-LLM's shape raises ValueError saying what was expected."""
        with pytest.raises(ValueError, match=message):
            merge_iteration_stats(None, data)


class TestPrometheus:
    def test_trtllm_names(self) -> None:
        """trtllm-serve's Prometheus gauges give running, waiting, utilization and tokens per block."""
        gauges = parse_prometheus((FIXTURES / "prometheus.txt").read_text())
        assert gauges == {"running": 4.0, "waiting": 2.0, "kv_usage": 0.125, "block_size": 32.0}

    def test_triton_backend_names(self) -> None:
        """Triton's TensorRT-LLM backend metrics are read by their type labels."""
        assert parse_prometheus(TRITON) == {"running": 5.0, "waiting": 3.0, "kv_usage": 0.75, "block_size": 64.0}

    def test_no_known_gauges(self) -> None:
        """A body without any known gauge is an error."""
        with pytest.raises(ValueError, match="found none"):
            parse_prometheus("# TYPE up gauge\nup 1\n")
