"""TensorRT-LLM load telemetry: JSON iteration stats (drained, nulls, empty lists, attention-DP ranks) and
Prometheus."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kvroute_tensorrt_llm import TrtllmMetrics, merge_iteration_stats, parse_prometheus

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


def _metrics(name: str = "metrics_sequence.json") -> list[Any]:
    return json.loads((FIXTURES / name).read_text())


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

    def test_attention_dp_ranks_are_added_up(self) -> None:
        """With attention DP each rank's latest row counts: requests and blocks are summed, usage is over all blocks."""
        first = merge_iteration_stats(None, _metrics("metrics_attention_dp.json")[0])
        assert (first.running, first.waiting, first.iteration, first.max_blocks) == (4 + 6, 0 + 2, 301, 2 * 50000)
        assert first.kv_usage == pytest.approx((1300 + 2100) / 100000)
        assert (first.prefix_cache_hits, first.prefix_cache_queries) == ((41 + 12) * 32, (41 + 420 + 12 + 640) * 32)
        later = merge_iteration_stats(first, _metrics("metrics_attention_dp.json")[1])  # only rank 1 reported
        assert (later.running, later.waiting, later.iteration) == (4 + 7, 0 + 1, 302)
        assert later.kv_usage == pytest.approx((1300 + 2200) / 100000)

    def test_rows_without_a_rank_are_rank_zero(self) -> None:
        """Rows of servers that do not tag attentionDpRank count as one rank: the latest row wins."""
        stats = merge_iteration_stats(None, [{"numActiveRequests": 2}, {"numActiveRequests": 5, "attentionDpRank": 0}])
        assert stats.running == 5

    def test_to_load(self) -> None:
        """The EngineLoad carries the values and the observation time."""
        load = TrtllmMetrics(running=1, waiting=2, block_size=32).to_load(observed_at=3.0)
        assert (load.running, load.waiting, load.block_size, load.observed_at) == (1, 2, 32, 3.0)

    def test_to_load_carries_the_cache_size(self) -> None:
        """The EngineLoad's kv_blocks is maxNumBlocks (all ranks), in blocks of tokensPerBlock."""
        load = merge_iteration_stats(None, _metrics()[0]).to_load()
        assert (load.kv_blocks, load.block_size, load.kv_tokens) == (101256, 32, 101256 * 32)
        assert TrtllmMetrics(running=1).to_load().kv_blocks is None

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
        """trtllm-serve's collector gives running, waiting, utilization, blocks and the reuse counters in tokens."""
        metrics = parse_prometheus((FIXTURES / "prometheus.txt").read_text())
        assert metrics == TrtllmMetrics(
            running=4,
            waiting=2,
            kv_usage=0.125,
            block_size=32,
            max_blocks=8192,
            used_blocks=1024,
            prefix_cache_hits=128 * 32.0,
            prefix_cache_queries=(128 + 384) * 32.0,
        )
        assert all(
            type(getattr(metrics, count)) is int
            for count in ("running", "waiting", "block_size", "max_blocks", "used_blocks")
        )

    def test_triton_backend_names(self) -> None:
        """Triton's TensorRT-LLM backend metrics are read by their type labels."""
        assert parse_prometheus(TRITON) == TrtllmMetrics(
            running=5, waiting=3, kv_usage=0.75, block_size=64, max_blocks=8000
        )

    def test_no_known_gauges(self) -> None:
        """A body without any known gauge (a server that has not logged iteration stats yet) gives nothing."""
        assert parse_prometheus("# TYPE up gauge\nup 1\n") == TrtllmMetrics()

    def test_unparsable(self) -> None:
        """Text that is not Prometheus' format is an error saying so."""
        with pytest.raises(ValueError, match="does not parse"):
            parse_prometheus("trtllm_num_requests_running{model_name= 3\n")
