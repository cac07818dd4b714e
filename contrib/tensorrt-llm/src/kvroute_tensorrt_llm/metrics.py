"""TensorRT-LLM's load telemetry: ``trtllm-serve``'s JSON ``/metrics``, or its Prometheus endpoint.

JSON ``GET /metrics`` answers a list of iteration-stat objects and drains it: each answer holds
the iterations since the previous one, an empty list when none ran (then the last values
still hold). With attention data parallelism every iteration gives one row per rank, tagged
``attentionDpRank`` (recent servers tag every row, 0 without attention DP): the router keeps
each rank's latest row and adds the ranks up. Fields read (``null`` or missing = not reported,
the rank's earlier value is kept):

=============================  =================================================================
`TrtllmMetrics` field          JSON field (summed over ranks)
=============================  =================================================================
``running``                    ``numActiveRequests``
``waiting``                    ``numQueuedRequests``
``kv_usage``                   ``kvCacheStats.usedNumBlocks / kvCacheStats.maxNumBlocks``
                               (``maxNumBlocks - freeNumBlocks`` when ``usedNumBlocks`` is missing)
``block_size``                 ``kvCacheStats.tokensPerBlock``
``prefix_cache_hits``          ``kvCacheStats.reusedBlocks`` x tokens per block (cumulative)
``prefix_cache_queries``       ``(reusedBlocks + missedBlocks)`` x tokens per block (cumulative)
``max_blocks``                 ``kvCacheStats.maxNumBlocks`` (the load's ``kv_blocks``)
=============================  =================================================================

Prometheus: a server started with ``return_perf_metrics`` mounts ``/prometheus/metrics``
(``trtllm_`` names, from ``tensorrt_llm/metrics/collector.py``); Triton's TensorRT-LLM backend
has ``nv_trt_llm_request_metrics{request_type="active"|"waiting"}`` and
``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"|"used"|"tokens_per"|"fraction"}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from prometheus_client.parser import text_string_to_metric_families

from kvroute.adapters import EngineMetrics, prometheus_subset
from kvroute.backend import EngineLoad

__all__ = ["ITERATION_GAUGES", "TrtllmMetrics", "merge_iteration_stats", "parse_prometheus"]

#: Fields of `parse_prometheus` that only iteration stats fill (their presence means the server logs them).
ITERATION_GAUGES = frozenset({"running", "waiting", "kv_usage"})
#: Fields that count (requests, blocks, tokens per block): whole numbers.
_COUNTS = ("running", "waiting", "block_size", "max_blocks", "used_blocks")

_SUMMED = ("running", "waiting", "max_blocks", "used_blocks", "prefix_cache_hits", "prefix_cache_queries")


@attrs.frozen
class TrtllmMetrics(EngineMetrics):
    """What the router knows of one TensorRT-LLM server's load; ``None`` = never reported.

    The `EngineMetrics` fields (``to_load``), plus the KV cache's size and use in blocks and the last
    iteration. ``ranks`` holds each attention-DP rank's own latest values (empty when the values did
    not come from JSON rows); the other fields are their total.
    """

    max_blocks: int | None = None
    iteration: int | None = None
    used_blocks: int | None = None
    ranks: tuple[tuple[int, TrtllmMetrics], ...] = ()

    def to_load(self, observed_at: float | None = None) -> EngineLoad:
        """`EngineMetrics.to_load`, with the cache's size: ``kv_blocks`` is ``max_blocks`` (all ranks)."""
        return attrs.evolve(super().to_load(observed_at), kv_blocks=self.max_blocks)

    def reported(self) -> dict[str, Any]:
        """The fields the server reported (not ``None``), ``ranks`` aside."""
        return {k: v for k, v in attrs.asdict(self, recurse=False).items() if v is not None and k != "ranks"}


def _number(data: Mapping[str, Any], key: str, where: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}.{key}: expected a number or null, got {value!r}.")
    return float(value)


def _count(value: float | None) -> int | None:
    return None if value is None else round(value)


def _row(stats: TrtllmMetrics, item: Mapping[str, Any], where: str) -> TrtllmMetrics:
    """One rank's values after one of its iteration rows."""
    changes: dict[str, Any] = {}
    for name, key in (("running", "numActiveRequests"), ("waiting", "numQueuedRequests"), ("iteration", "iter")):
        value = _count(_number(item, key, where))
        if value is not None:
            changes[name] = value
    kv = item.get("kvCacheStats")
    if kv is not None:
        if not isinstance(kv, Mapping):
            raise ValueError(f"{where}.kvCacheStats: expected an object or null, got {type(kv).__name__}.")
        kwhere = f"{where}.kvCacheStats"
        max_blocks = _number(kv, "maxNumBlocks", kwhere)
        used = _number(kv, "usedNumBlocks", kwhere)
        if used is None and max_blocks is not None:
            free = _number(kv, "freeNumBlocks", kwhere)
            used = max_blocks - free if free is not None else None
        per_block = _count(_number(kv, "tokensPerBlock", kwhere))
        reused = _number(kv, "reusedBlocks", kwhere)
        missed = _number(kv, "missedBlocks", kwhere)
        if max_blocks is not None:
            changes["max_blocks"] = round(max_blocks)
        if used is not None:
            changes["used_blocks"] = round(used)
            if max_blocks:
                changes["kv_usage"] = min(1.0, max(0.0, used / max_blocks))
        if per_block:
            changes["block_size"] = per_block
        tokens = per_block or stats.block_size
        if tokens and reused is not None:
            changes["prefix_cache_hits"] = reused * tokens
            if missed is not None:
                changes["prefix_cache_queries"] = (reused + missed) * tokens
    return attrs.evolve(stats, **changes)


def _total(ranks: dict[int, TrtllmMetrics]) -> TrtllmMetrics:
    """The server's values: the ranks' counts added up, usage over all their blocks."""
    rows = list(ranks.values())
    changes: dict[str, Any] = {}
    for name in _SUMMED:
        values = [getattr(r, name) for r in rows if getattr(r, name) is not None]
        changes[name] = sum(values) if values else None
    both = [r for r in rows if r.used_blocks is not None and r.max_blocks]
    if both and len(both) == len([r for r in rows if r.max_blocks]):
        changes["kv_usage"] = min(
            1.0, max(0.0, sum(r.used_blocks or 0 for r in both) / sum(r.max_blocks or 0 for r in both))
        )
    else:
        usages = [r.kv_usage for r in rows if r.kv_usage is not None]
        changes["kv_usage"] = sum(usages) / len(usages) if usages else None
    sizes = [r.block_size for r in rows if r.block_size]
    changes["block_size"] = sizes[0] if sizes else None
    iterations = [r.iteration for r in rows if r.iteration is not None]
    changes["iteration"] = max(iterations) if iterations else None
    return TrtllmMetrics(**changes, ranks=tuple(sorted(ranks.items())))


def merge_iteration_stats(previous: TrtllmMetrics | None, data: object) -> TrtllmMetrics:
    """Fold a ``/metrics`` JSON answer into the previous stats (an empty list changes nothing)."""
    if not isinstance(data, list):
        raise ValueError(
            f"expected TensorRT-LLM's /metrics to be a JSON list of iteration stats, got {type(data).__name__}."
        )
    if not data and previous is not None:
        return previous
    ranks = dict(previous.ranks) if previous is not None else {}
    if previous is not None and not ranks and previous != TrtllmMetrics():
        ranks[0] = previous  # values from before per-rank tracking (e.g. another source): rank 0's
    for i, item in enumerate(data):
        where = f"/metrics[{i}]"
        if not isinstance(item, Mapping):
            raise ValueError(f"{where}: expected an object of iteration stats, got {type(item).__name__}.")
        rank = _count(_number(item, "attentionDpRank", where)) or 0
        ranks[rank] = _row(ranks.get(rank, TrtllmMetrics()), item, where)
    return _total(ranks) if ranks else TrtllmMetrics()


#: Sample name -> field of `parse_prometheus` (trtllm-serve's collector).
_TRTLLM = {
    "trtllm_num_requests_running": "running",
    "trtllm_num_requests_waiting": "waiting",
    "trtllm_kv_cache_utilization": "kv_usage",
    "trtllm_kv_cache_tokens_per_block": "block_size",
    "trtllm_kv_cache_max_blocks": "max_blocks",
    "trtllm_kv_cache_used_blocks": "used_blocks",
    "trtllm_kv_cache_reused_blocks_total": "reused_blocks",
    "trtllm_kv_cache_missed_blocks_total": "missed_blocks",
}
_TRITON = ("nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics")
_FAMILIES = frozenset({*(n.removesuffix("_total") for n in _TRTLLM), *_TRITON})
_SAMPLES = frozenset({*_TRTLLM, *_TRITON})
#: Fields that are one value per engine, not a count to add up: the mean over samples.
_MEANS = ("kv_usage", "block_size")


def parse_prometheus(text: str) -> TrtllmMetrics:
    """The load values of a TensorRT-LLM (or Triton TensorRT-LLM backend) Prometheus exposition.

    Fills some of ``running``, ``waiting``, ``kv_usage``, ``block_size``, ``max_blocks``,
    ``used_blocks``, ``prefix_cache_hits`` and ``prefix_cache_queries`` (tokens, from the reused
    and missed block counters); none when the server has none of them (yet): trtllm-serve sets
    its gauges once it has logged iteration stats. ``ValueError`` when the text does not parse.
    """
    try:
        families = list(text_string_to_metric_families(prometheus_subset(text, _FAMILIES | _SAMPLES)))
    except (ValueError, TypeError, IndexError) as exc:
        raise ValueError(f"expected Prometheus text format, but it does not parse: {exc}") from None
    sums: dict[str, float] = {}
    seen: dict[str, int] = {}

    def add(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value
        seen[key] = seen.get(key, 0) + 1

    for family in families:
        for s in family.samples:
            if s.name in _TRTLLM:
                add(_TRTLLM[s.name], s.value)
            elif s.name == "nv_trt_llm_request_metrics":
                kind = s.labels.get("request_type")
                if kind == "active":
                    add("running", s.value)
                elif kind in ("waiting", "queued"):
                    add("waiting", s.value)
            elif s.name == "nv_trt_llm_kv_cache_block_metrics":
                kind = s.labels.get("kv_cache_block_type")
                if kind == "fraction":
                    add("kv_usage", s.value)
                elif kind == "tokens_per":
                    add("block_size", s.value)
                elif kind == "max":
                    add("max_blocks", s.value)
                elif kind == "used":
                    add("used_blocks", s.value)
    out = {k: v / seen[k] if k in _MEANS else v for k, v in sums.items()}
    reused = out.pop("reused_blocks", None)
    missed = out.pop("missed_blocks", None)
    per_block = out.get("block_size")
    if per_block and reused is not None:
        out["prefix_cache_hits"] = reused * per_block
        if missed is not None:
            out["prefix_cache_queries"] = (reused + missed) * per_block
    return TrtllmMetrics(**{k: round(v) if k in _COUNTS else v for k, v in out.items()})
