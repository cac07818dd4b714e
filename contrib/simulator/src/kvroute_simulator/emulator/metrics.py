"""vLLM's Prometheus metrics, with vLLM's names, labels and types (see shared engines.md).

Counters are created with prometheus-client under vLLM's base names (``vllm:prefix_cache_queries``),
which exposes ``..._total`` and ``..._created`` series exactly as a single-process vLLM server does.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvroute_simulator.engine import Engine

__all__ = ["CONTENT_TYPE", "EmulatedMetrics"]

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

#: vLLM's TTFT buckets.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class EmulatedMetrics:
    """The metric families a router reads from vLLM, fed by the emulator's engine model and rendered for ``/metrics``.

    Not to be confused with what kvroute-vllm parses these back into on the router side.
    """

    def __init__(self, model: str, engine: Engine, *, engine_index: str = "0") -> None:
        self.engine = engine
        self.registry = r = CollectorRegistry()
        labels = ["model_name", "engine"]
        values = (model, engine_index)
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r
        ).labels(*values)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r
        ).labels(*values)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r
        ).labels(*values)
        self.queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        ).labels(*values)
        self.hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels, registry=r
        ).labels(*values)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(*values)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(*values)
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(*values)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(*values)
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "enable_prefix_caching", "num_gpu_blocks", "prefix_caching_hash_algo", "engine"],
            registry=r,
        )
        cfg = engine.config
        info.labels(
            str(cfg.block_size), str(cfg.enable_prefix_caching), str(cfg.capacity_blocks), "sha256", engine_index
        ).set(1)
        self._model = model
        self._engine_index = engine_index
        self._seen_queries = 0
        self._seen_hits = 0

    def finished(self, reason: str) -> None:
        self.success.labels(self._model, self._engine_index, reason).inc()

    def render(self) -> bytes:
        """The exposition text, with gauges read from the engine now."""
        engine = self.engine
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.kv_usage.set(engine.kv_usage)
        stats = engine.stats
        self.queries.inc(stats.prompt_tokens - self._seen_queries)
        self.hits.inc(stats.hit_tokens - self._seen_hits)
        self._seen_queries, self._seen_hits = stats.prompt_tokens, stats.hit_tokens
        return generate_latest(self.registry)
