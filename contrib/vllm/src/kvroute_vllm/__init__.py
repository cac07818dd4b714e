"""kvroute's ``vllm`` backend kind: a vLLM server's health, models, load telemetry and KV cache events.

Public API:

* `VllmAdapter`: the adapter (registered as kind ``vllm``; options in its docstring).
* `parse_metrics`, `VllmMetrics`: vLLM's Prometheus ``/metrics`` as the router reads it.
* `decode_message`, `decode_batch` and the event types: vLLM's KV event messages.
* `KvEventFeed`: applies event batches to a `kvroute.adapters.KvEventSink` in sequence order.
* `ZmqSubscriber`, `ZmqSource`: the ZMQ subscriber with replay-based gap filling.
"""

from __future__ import annotations

from collections.abc import Callable

import kvroute
from kvroute_vllm.adapter import VllmAdapter
from kvroute_vllm.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventFormatError,
    decode_batch,
    decode_message,
)
from kvroute_vllm.feed import FeedStats, Gap, KvEventFeed
from kvroute_vllm.metrics import VllmMetrics, parse_metrics
from kvroute_vllm.subscriber import ZmqSource, ZmqSubscriber, engine_binds, resolve_endpoint

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventFormatError",
    "FeedStats",
    "Gap",
    "KvEventFeed",
    "VllmAdapter",
    "VllmMetrics",
    "ZmqSource",
    "ZmqSubscriber",
    "decode_batch",
    "decode_message",
    "engine_binds",
    "kvroute_register_backend_kinds",
    "parse_metrics",
    "resolve_endpoint",
]


@kvroute.hookimpl
def kvroute_register_backend_kinds(register: Callable[..., None]) -> None:
    register("vllm", VllmAdapter.create)
