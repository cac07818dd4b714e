"""vLLM's Prometheus ``/metrics``: the few families a router reads, parsed with prometheus-client's parser.

Read (current name, then the older name accepted in its place):

=================================  ==========================================  ==============================
field                              metric                                      older name
=================================  ==========================================  ==============================
``running``                        ``vllm:num_requests_running``
``waiting``                        ``vllm:num_requests_waiting``
``kv_usage`` (0..1)                ``vllm:kv_cache_usage_perc``                ``vllm:gpu_cache_usage_perc``
``prefix_cache_queries`` (tokens)  ``vllm:prefix_cache_queries_total``          ``vllm:gpu_prefix_cache_queries``
``prefix_cache_hits`` (tokens)     ``vllm:prefix_cache_hits_total``            ``vllm:gpu_prefix_cache_hits``
``block_size``, ``num_gpu_blocks`` labels of ``vllm:cache_config_info`` (``num_gpu_blocks`` is the
                                   load's ``kv_blocks``)
``started_at``                     ``process_start_time_seconds``
=================================  ==========================================  ==============================

A data-parallel server reports one sample per engine (label ``engine``, the data-parallel
rank); counts and blocks are summed over engines, KV usage is their mean, and each engine's
running, waiting and KV usage are also kept per rank (`kvroute.backend.RankLoad`, in the load's
``ranks``; the load's ``data_parallel_size`` is the number of engines when more than one reports).
The oldest servers have no ``engine`` label:
every sample of a name is one engine then. ``_created`` series are ignored.

Only the lines of these families go through the parser (a whole vLLM exposition is ~600
lines and ~10 ms to parse; the filtered one well under 1 ms).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
from prometheus_client.parser import text_string_to_metric_families

from kvroute.adapters import EngineMetrics, prometheus_subset
from kvroute.backend import EngineLoad, RankLoad

__all__ = ["VllmMetrics", "parse_prometheus"]

_RUNNING = ("vllm:num_requests_running",)
_WAITING = ("vllm:num_requests_waiting",)
_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
_INFO = "vllm:cache_config_info"
_START = "process_start_time_seconds"

#: Samples kept per rank too, and the `RankLoad` field each fills.
_PER_RANK = {_RUNNING[0]: "running", _WAITING[0]: "waiting", **dict.fromkeys(_USAGE, "kv_usage")}

#: Sample names we keep: counters may be exposed with or without ``_total``.
_WANTED = frozenset(
    [*_RUNNING, *_WAITING, *_USAGE, _INFO, _START]
    + [name + suffix for name in (*_QUERIES, *_HITS) for suffix in ("", "_total")]
)


@attrs.frozen
class VllmMetrics(EngineMetrics):
    """What one scrape of a vLLM server's ``/metrics`` says, summed over its engines; ``None`` = not reported.

    The `EngineMetrics` fields (``to_load``), plus the KV cache's size in blocks, whether prefix caching
    is on, the process start time (a new one: the server restarted) and how many engines reported.
    """

    num_gpu_blocks: int | None = None
    prefix_caching: bool | None = None
    started_at: float | None = None
    engines: int = 0

    def to_load(self, observed_at: float | None = None) -> EngineLoad:
        """`EngineMetrics.to_load`, with the cache's size: ``kv_blocks`` is ``num_gpu_blocks``."""
        return attrs.evolve(super().to_load(observed_at), kv_blocks=self.num_gpu_blocks)


def _values(samples: dict[str, list[float]], names: Iterable[str], *, counter: bool = False) -> list[float] | None:
    """The samples of the first of ``names`` that is present (counters: ``_total`` first)."""
    for name in names:
        for candidate in (name + "_total", name) if counter else (name,):
            found = samples.get(candidate)
            if found:
                return found
    return None


def _int_label(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def parse_prometheus(text: str) -> VllmMetrics:
    """Parse a vLLM ``/metrics`` body; ``ValueError`` when it is not Prometheus text or not vLLM's."""
    samples: dict[str, list[float]] = {}
    per_rank: dict[int, dict[str, float]] = {}
    infos: list[dict[str, str]] = []
    try:
        families = list(text_string_to_metric_families(prometheus_subset(text, _WANTED)))
    except (ValueError, TypeError, IndexError) as exc:
        raise ValueError(
            f"expected Prometheus text format from vLLM's /metrics, but it does not parse: {exc}"
        ) from None
    for family in families:
        for sample in family.samples:
            if sample.name == _INFO:
                infos.append(dict(sample.labels))
            elif sample.name in _WANTED:
                samples.setdefault(sample.name, []).append(float(sample.value))
                rank = _int_label(sample.labels.get("engine"))
                if rank is not None and 0 <= rank < 1 << 16 and sample.name in _PER_RANK:
                    per_rank.setdefault(rank, {})[_PER_RANK[sample.name]] = float(sample.value)
    running = _values(samples, _RUNNING)
    waiting = _values(samples, _WAITING)
    usage = _values(samples, _USAGE)
    queries = _values(samples, _QUERIES, counter=True)
    hits = _values(samples, _HITS, counter=True)
    if running is None and waiting is None and usage is None and queries is None and not infos:
        head = text.strip().splitlines()[:1]
        raise ValueError(
            "expected vLLM's Prometheus metrics (vllm:num_requests_running, vllm:kv_cache_usage_perc...) "
            f"but found none of them (first line: {head[0][:120] if head else 'empty body'!r})."
        )
    block_sizes = [b for b in (_int_label(i.get("block_size")) for i in infos) if b]
    gpu_blocks = [b for b in (_int_label(i.get("num_gpu_blocks")) for i in infos) if b is not None]
    caching = [i["enable_prefix_caching"] == "True" for i in infos if "enable_prefix_caching" in i]
    start = samples.get(_START)
    return VllmMetrics(
        running=round(sum(running)) if running is not None else None,
        waiting=round(sum(waiting)) if waiting is not None else None,
        kv_usage=sum(usage) / len(usage) if usage else None,
        prefix_cache_queries=sum(queries) if queries is not None else None,
        prefix_cache_hits=sum(hits) if hits is not None else None,
        block_size=block_sizes[0] if block_sizes else None,
        num_gpu_blocks=sum(gpu_blocks) if gpu_blocks else None,
        prefix_caching=all(caching) if caching else None,
        started_at=min(start) if start else None,
        engines=max(len(running or ()), len(usage or ()), len(infos)),
        ranks=tuple(_rank_load(rank, values) for rank, values in sorted(per_rank.items())),
        data_parallel_size=len(per_rank) if len(per_rank) > 1 else None,
    )


def _rank_load(rank: int, values: dict[str, float]) -> RankLoad:
    running, waiting = values.get("running"), values.get("waiting")
    return RankLoad(
        rank,
        running=round(running) if running is not None else None,
        waiting=round(waiting) if waiting is not None else None,
        kv_usage=values.get("kv_usage"),
    )
