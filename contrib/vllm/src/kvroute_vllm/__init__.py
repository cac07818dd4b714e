"""kvroute's ``vllm`` backend kind: a vLLM server's health, models, load telemetry and KV cache events.

Public API:

* `VllmAdapter`: the adapter (registered as kind ``vllm``; options in its docstring), a
  `kvroute.adapters.OpenAIAdapter`.
* `parse_prometheus`, `VllmMetrics`: vLLM's Prometheus ``/metrics`` as the router reads it.
* `decode_message`, `decode_batch`, `decode_replay_reply` and the event types: vLLM's KV event messages.
* `VllmEventFeed` (a `kvroute.adapters.KvEventFeed`): applies event batches to a
  `kvroute.adapters.KvEventSink` in sequence order; `VllmFeedStats`, its counters.
* `ZmqSubscriber`, `ZmqSource`: the ZMQ subscriber with replay-based gap filling;
  `locate_publisher`: bind or connect, from the endpoint a server reports.
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
    UnknownEvent,
    decode_batch,
    decode_message,
    decode_replay_reply,
)
from kvroute_vllm.feed import INDEXED_KINDS, WINDOW_KINDS, Gap, VllmEventFeed, VllmFeedStats
from kvroute_vllm.metrics import VllmMetrics, parse_prometheus
from kvroute_vllm.subscriber import (
    ZmqSource,
    ZmqSubscriber,
    engine_binds,
    locate_publisher,
    resolve_endpoint,
    split_tcp,
)

__all__ = [
    "INDEXED_KINDS",
    "WINDOW_KINDS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventFormatError",
    "Gap",
    "UnknownEvent",
    "VllmAdapter",
    "VllmEventFeed",
    "VllmFeedStats",
    "VllmMetrics",
    "ZmqSource",
    "ZmqSubscriber",
    "decode_batch",
    "decode_message",
    "decode_replay_reply",
    "engine_binds",
    "kvroute_register_backend_kinds",
    "locate_publisher",
    "parse_prometheus",
    "resolve_endpoint",
    "split_tcp",
]


@kvroute.hookimpl
def kvroute_register_backend_kinds(register: Callable[..., None]) -> None:
    register("vllm", VllmAdapter.create)
