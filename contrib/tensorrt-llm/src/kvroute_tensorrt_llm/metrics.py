"""TensorRT-LLM's load telemetry: ``trtllm-serve``'s JSON ``/metrics``, and Prometheus when present.

JSON ``GET /metrics`` answers a list of iteration-stat objects and drains it: each poll gets
the iterations since the previous one, an empty list when none ran (then the last values
still hold). Fields read (``null`` or missing = not reported, the earlier value is kept):

=============================  =================================================================
`TrtllmStats` field            JSON field
=============================  =================================================================
``running``                    ``numActiveRequests``
``waiting``                    ``numQueuedRequests``
``kv_usage``                   ``kvCacheStats.usedNumBlocks / kvCacheStats.maxNumBlocks``
``block_size``                 ``kvCacheStats.tokensPerBlock``
``prefix_cache_hits``          ``kvCacheStats.reusedBlocks`` x tokens per block (cumulative)
``prefix_cache_queries``       ``(reusedBlocks + missedBlocks)`` x tokens per block (cumulative)
``max_blocks``                 ``kvCacheStats.maxNumBlocks``
=============================  =================================================================

Prometheus (newer servers mount it at ``/prometheus/metrics``): ``trtllm_num_requests_running``,
``trtllm_num_requests_waiting``, ``trtllm_kv_cache_utilization``, ``trtllm_kv_cache_tokens_per_block``;
Triton's TensorRT-LLM backend: ``nv_trt_llm_request_metrics{request_type="active"|"waiting"}`` and
``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"|"used"|"tokens_per"|"fraction"}``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

import attrs
from prometheus_client.parser import text_string_to_metric_families

from kvroute.backend import EngineLoad

__all__ = ["TrtllmStats", "merge_iteration_stats", "parse_prometheus"]


@attrs.frozen
class TrtllmStats:
    """What the router knows of one TensorRT-LLM server's load; ``None`` = never reported."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    block_size: int | None = None
    prefix_cache_hits: float | None = None
    prefix_cache_queries: float | None = None
    max_blocks: int | None = None
    iteration: int | None = None

    def to_load(self, observed_at: float | None = None) -> EngineLoad:
        """The core's `EngineLoad` (``observed_at``: a ``time.monotonic()`` reading, default now)."""
        return EngineLoad(
            running=self.running,
            waiting=self.waiting,
            kv_usage=self.kv_usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            block_size=self.block_size,
            observed_at=time.monotonic() if observed_at is None else observed_at,
        )


def _number(data: Mapping[str, Any], key: str, where: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}.{key}: expected a number or null, got {value!r}.")
    return float(value)


def _count(value: float | None) -> int | None:
    return None if value is None else round(value)


def merge_iteration_stats(previous: TrtllmStats | None, data: object) -> TrtllmStats:
    """Fold a ``/metrics`` JSON answer into the previous stats (an empty list changes nothing)."""
    if not isinstance(data, list):
        raise ValueError(f"expected TensorRT-LLM's /metrics to be a JSON list of iteration stats, got {type(data).__name__}.")
    stats = previous or TrtllmStats()
    for i, item in enumerate(data):
        where = f"/metrics[{i}]"
        if not isinstance(item, Mapping):
            raise ValueError(f"{where}: expected an object of iteration stats, got {type(item).__name__}.")
        changes: dict[str, Any] = {}
        running = _count(_number(item, "numActiveRequests", where))
        waiting = _count(_number(item, "numQueuedRequests", where))
        iteration = _count(_number(item, "iter", where))
        for name, value in (("running", running), ("waiting", waiting), ("iteration", iteration)):
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
            if used is not None and max_blocks:
                changes["kv_usage"] = min(1.0, max(0.0, used / max_blocks))
            if per_block:
                changes["block_size"] = per_block
            tokens = per_block or stats.block_size
            if tokens and reused is not None:
                changes["prefix_cache_hits"] = reused * tokens
                if missed is not None:
                    changes["prefix_cache_queries"] = (reused + missed) * tokens
        stats = attrs.evolve(stats, **changes)
    return stats


_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_WANTED = frozenset(
    {
        "trtllm_num_requests_running",
        "trtllm_num_requests_waiting",
        "trtllm_kv_cache_utilization",
        "trtllm_kv_cache_tokens_per_block",
        "nv_trt_llm_request_metrics",
        "nv_trt_llm_kv_cache_block_metrics",
    }
)


def parse_prometheus(text: str) -> dict[str, float]:
    """The load gauges of a TensorRT-LLM (or Triton TensorRT-LLM backend) Prometheus exposition.

    Returns some of ``running``, ``waiting``, ``kv_usage``, ``block_size``; ``ValueError`` when the
    text does not parse or holds none of them.
    """
    lines = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[2] in _WANTED:
                lines.append(line)
        elif (m := _NAME.match(line)) is not None and m.group(0) in _WANTED:
            lines.append(line)
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except (ValueError, TypeError, IndexError) as exc:
        raise ValueError(f"expected Prometheus text format, but it does not parse: {exc}") from None
    sums: dict[str, float] = {}
    seen: dict[str, int] = {}

    def add(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value
        seen[key] = seen.get(key, 0) + 1

    for family in families:
        for s in family.samples:
            if s.name == "trtllm_num_requests_running":
                add("running", s.value)
            elif s.name == "trtllm_num_requests_waiting":
                add("waiting", s.value)
            elif s.name == "trtllm_kv_cache_utilization":
                add("kv_usage", s.value)
            elif s.name == "trtllm_kv_cache_tokens_per_block":
                add("block_size", s.value)
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
    if not sums:
        raise ValueError("expected TensorRT-LLM Prometheus gauges (trtllm_num_requests_running...), found none.")
    out = {k: v for k, v in sums.items() if k in ("running", "waiting")}
    for key in ("kv_usage", "block_size"):
        if key in sums:
            out[key] = sums[key] / seen[key]  # a fraction and a size: the mean over engines
    return out
