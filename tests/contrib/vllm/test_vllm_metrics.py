"""vLLM's Prometheus /metrics as the adapter reads it: captured real bodies and formats from engines.md."""

from __future__ import annotations

import pytest
from kvroute_vllm import parse_prometheus

from tests.contrib.vllm.vllm_fakes import fixture_text

CURRENT = (
    """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
# HELP vllm:num_requests_waiting_by_reason Waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 100.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.4375
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.0625
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 20480.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 1000.0
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 12288.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 512.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
"""
    'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="2730",'
    'prefix_caching_hash_algo="sha256",engine="0"} 1.0\n'
    'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="2730",'
    'prefix_caching_hash_algo="sha256",engine="1"} 1.0\n'
)

# vLLM before 0.9.2: gpu_-prefixed cache names, counters without _total in their TYPE line, no engine label.
OLD = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
# HELP vllm:gpu_prefix_cache_queries GPU prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 4096.0
# HELP vllm:gpu_prefix_cache_hits GPU prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{model_name="m"} 1024.0
# HELP vllm:cache_config_info information of cache_config
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",num_gpu_blocks="500"} 1.0
"""


class TestParseMetrics:
    def test_captured_busy_server(self) -> None:
        """A real vLLM 0.32 body under load gives its running, waiting, usage, counters, block size and cache size."""
        m = parse_prometheus(fixture_text("metrics_busy.txt"))
        assert (m.running, m.waiting) == (2, 1)
        assert m.kv_usage == pytest.approx(0.46478873239436624)
        assert (m.prefix_cache_queries, m.prefix_cache_hits) == (11955.0, 3200.0)
        assert (m.block_size, m.num_gpu_blocks, m.prefix_caching, m.engines) == (128, 72, True, 1)

    def test_captured_idle_and_after(self) -> None:
        """Idle and after-load bodies of the same server: zero load, counters that only grow."""
        idle = parse_prometheus(fixture_text("metrics_idle.txt"))
        after = parse_prometheus(fixture_text("metrics_after.txt"))
        assert (idle.running, idle.waiting, idle.kv_usage, idle.prefix_cache_queries) == (0, 0, 0.0, 0.0)
        assert after.prefix_cache_queries == 14599.0 and after.prefix_cache_hits == 3200.0
        assert idle.started_at == after.started_at is not None

    def test_waiting_by_reason_is_not_waiting(self) -> None:
        """vllm:num_requests_waiting_by_reason shares a prefix with num_requests_waiting but is not summed into it."""
        assert parse_prometheus(CURRENT).waiting == 5

    def test_data_parallel_engines_are_summed_and_usage_averaged(self) -> None:
        """Two engines: counts and counters add up, KV usage is their mean, cache blocks add up."""
        m = parse_prometheus(CURRENT)
        assert (m.running, m.prefix_cache_queries, m.prefix_cache_hits) == (5, 21480.0, 12800.0)
        assert m.kv_usage == pytest.approx(0.25)
        assert (m.block_size, m.num_gpu_blocks, m.engines) == (16, 5460, 2)

    def test_data_parallel_engines_kept_per_rank(self) -> None:
        """Each engine's running, waiting and KV usage are kept as its rank's load, and the load names 2 ranks."""
        from kvroute.backend import RankLoad

        m = parse_prometheus(CURRENT)
        assert m.ranks == (
            RankLoad(0, running=3, waiting=1, kv_usage=0.4375),
            RankLoad(1, running=2, waiting=4, kv_usage=0.0625),
        )
        load = m.to_load()
        assert load.data_parallel_size == 2 and load.ranks[1].requests == 6

    def test_one_engine_names_no_data_parallelism(self) -> None:
        """A server with one engine (or no engine label) reports no data-parallel size."""
        assert parse_prometheus(OLD).to_load().data_parallel_size is None

    def test_old_gpu_prefixed_names_without_engine_label(self) -> None:
        """Servers before 0.9.2 (gpu_ names, no engine label) are read the same way."""
        m = parse_prometheus(OLD)
        assert (m.running, m.waiting, m.kv_usage) == (7, 2, 0.25)
        assert (m.prefix_cache_queries, m.prefix_cache_hits, m.block_size, m.num_gpu_blocks) == (
            4096.0,
            1024.0,
            32,
            500,
        )

    def test_current_names_win_over_old_ones(self) -> None:
        """A server exposing both generations is read from the current names."""
        both = CURRENT + OLD.replace("vllm:num_requests_", "vllm:ignored_").replace("} 0.25", "} 0.9")
        m = parse_prometheus(both)
        assert m.kv_usage == pytest.approx(0.25)
        assert (m.prefix_cache_queries, m.prefix_cache_hits) == (21480.0, 12800.0)

    def test_to_load_stamps_observation_time(self) -> None:
        """The EngineLoad carries the values and the given observation time, so it can go stale."""
        load = parse_prometheus(CURRENT).to_load(observed_at=12.5)
        assert (load.running, load.waiting, load.block_size, load.observed_at) == (5, 5, 16, 12.5)
        assert load.age(now=20.0) == 7.5

    def test_to_load_carries_the_cache_size(self) -> None:
        """The EngineLoad's kv_blocks is num_gpu_blocks (summed over engines), so placement can see capacity."""
        assert parse_prometheus(CURRENT).to_load().kv_blocks == 5460
        load = parse_prometheus(fixture_text("metrics_busy.txt")).to_load()
        assert (load.kv_blocks, load.block_size, load.kv_tokens) == (72, 128, 72 * 128)
        assert parse_prometheus("vllm:num_requests_running 1.0\n").to_load().kv_blocks is None

    def test_not_vllm(self) -> None:
        """A Prometheus body without vLLM's families is an error naming what was expected."""
        with pytest.raises(ValueError, match="expected vLLM's Prometheus metrics"):
            parse_prometheus("# TYPE up gauge\nup 1.0\n")

    def test_not_prometheus(self) -> None:
        """A body that does not parse as Prometheus text is an error."""
        with pytest.raises(ValueError, match="Prometheus text"):
            parse_prometheus('vllm:num_requests_running{engine="0" 3.0\n')
