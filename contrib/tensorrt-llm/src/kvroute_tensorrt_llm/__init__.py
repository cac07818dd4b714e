"""kvroute's ``tensorrt-llm`` backend kind: a ``trtllm-serve`` server's health, models, load and KV cache events.

Public API:

* `TensorRTLLMAdapter`: the adapter (registered as kind ``tensorrt-llm``; options in its module),
  a `kvroute.adapters.OpenAIAdapter`; `LoadStats`: how its load polling went.
* `merge_iteration_stats`, `parse_prometheus`, `TrtllmMetrics`: the load telemetry as the router reads it.
* `parse_events`, `TrtllmEventFeed` (a `kvroute.adapters.KvEventFeed`), `TrtllmFeedStats`:
  ``/kv_cache_events`` answers and applying them to a `kvroute.adapters.KvEventSink`, with an
  honest exact flag.
* `v1_block_hash`: the engine's ``v1_block_key`` block hash (to tell what a block is keyed on).
"""

from __future__ import annotations

from collections.abc import Callable

import kvroute
from kvroute_tensorrt_llm.adapter import LoadStats, TensorRTLLMAdapter
from kvroute_tensorrt_llm.events import (
    Created,
    EventFormatError,
    KvCacheEvent,
    Malformed,
    Removed,
    Stored,
    StoredBlock,
    TrtllmEventFeed,
    TrtllmFeedStats,
    UnknownEvent,
    Updated,
    parse_events,
)
from kvroute_tensorrt_llm.hashing import v1_block_hash
from kvroute_tensorrt_llm.metrics import TrtllmMetrics, merge_iteration_stats, parse_prometheus

__all__ = [
    "Created",
    "EventFormatError",
    "KvCacheEvent",
    "LoadStats",
    "Malformed",
    "Removed",
    "Stored",
    "StoredBlock",
    "TensorRTLLMAdapter",
    "TrtllmEventFeed",
    "TrtllmFeedStats",
    "TrtllmMetrics",
    "UnknownEvent",
    "Updated",
    "kvroute_register_backend_kinds",
    "merge_iteration_stats",
    "parse_events",
    "parse_prometheus",
    "v1_block_hash",
]


@kvroute.hookimpl
def kvroute_register_backend_kinds(register: Callable[..., None]) -> None:
    register("tensorrt-llm", TensorRTLLMAdapter.create)
