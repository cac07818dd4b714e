"""vLLM's Prometheus metrics, with vLLM's names, labels and types (see shared engines.md).

Counters are created with prometheus-client under vLLM's base names (``vllm:prefix_cache_queries``),
which exposes ``..._total`` and ``..._created`` series exactly as a single-process vLLM server does.
"""

from __future__ import annotations

from collections.abc import Sequence

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


class _RankMetrics:
    """One data-parallel rank's series (label ``engine``): what the generation handler records per request."""

    def __init__(self, families: EmulatedMetrics, engine: Engine, model: str) -> None:
        values = (model, str(engine.rank))
        self.engine = engine
        self.running = families.running.labels(*values)
        self.waiting = families.waiting.labels(*values)
        self.kv_usage = families.kv_usage.labels(*values)
        self.queries = families.queries.labels(*values)
        self.hits = families.hits.labels(*values)
        self.external = (
            None
            if families.external_queries is None or families.external_hits is None
            else (families.external_queries.labels(*values), families.external_hits.labels(*values))
        )
        self.prompt_tokens = families.prompt_tokens.labels(*values)
        self.generation_tokens = families.generation_tokens.labels(*values)
        self.ttft = families.ttft.labels(*values)
        self.e2e = families.e2e.labels(*values)
        self._success = families.success
        self._values = values
        self._seen = (0, 0, 0, 0)

    def finished(self, reason: str) -> None:
        self._success.labels(*self._values, reason).inc()

    def update(self) -> None:
        engine = self.engine
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.kv_usage.set(engine.kv_usage)
        stats = engine.stats
        # vLLM's prefix cache counters are the GPU's; a CPU tier (an offloading connector) is "external".
        gpu_hits = stats.hit_tokens - stats.cpu_hit_tokens
        now = (stats.prompt_tokens, gpu_hits, stats.prompt_tokens - gpu_hits, stats.cpu_hit_tokens)
        seen = self._seen
        self.queries.inc(now[0] - seen[0])
        self.hits.inc(now[1] - seen[1])
        if self.external is not None:
            self.external[0].inc(now[2] - seen[2])
            self.external[1].inc(now[3] - seen[3])
        self._seen = now


class EmulatedMetrics:
    """The metric families a router reads from vLLM, fed by the emulator's engine model and rendered for ``/metrics``.

    One set of series per data-parallel rank, labelled ``engine="<rank>"`` as vLLM labels them.
    Not to be confused with what kvroute-vllm parses these back into on the router side.
    """

    def __init__(self, model: str, ranks: Sequence[Engine]) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r
        )
        self.queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        )
        self.hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels, registry=r
        )
        # Only with a CPU tier, as vLLM only has them with a KV connector.
        offloads = any(engine.config.cpu_capacity_blocks for engine in ranks)
        self.external_queries = (
            None
            if not offloads
            else Counter(
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
                "queried tokens.",
                labels,
                registry=r,
            )
        )
        self.external_hits = (
            None
            if not offloads
            else Counter(
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
                "cached tokens.",
                labels,
                registry=r,
            )
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        )
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
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "enable_prefix_caching", "num_gpu_blocks", "prefix_caching_hash_algo", "engine"],
            registry=r,
        )
        self.ranks = [_RankMetrics(self, engine, model) for engine in ranks]
        for engine in ranks:
            cfg = engine.config
            info.labels(
                str(cfg.block_size),
                str(cfg.enable_prefix_caching),
                str(cfg.capacity_blocks),
                "sha256",
                str(engine.rank),
            ).set(1)

    def rank(self, rank: int) -> _RankMetrics:
        """The series of data-parallel rank ``rank``."""
        return self.ranks[rank]

    def render(self) -> bytes:
        """The exposition text, with gauges and counters read from the engines now."""
        for rank in self.ranks:
            rank.update()
        return generate_latest(self.registry)
