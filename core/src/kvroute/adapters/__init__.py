"""Backend adapters: everything engine-specific about talking to one backend. Public plugin API.

A backend kind (``openai``, ``vllm``, ``tensorrt-llm``...) is registered through the
``kvroute_register_backend_kinds`` hook with a factory ``factory(backend, **options)``
returning an object that follows `BackendAdapter`. The core ships ``openai``: any
OpenAI-compatible server, probed on ``/health``, with no engine telemetry (`OpenAIAdapter`).

Optional capabilities, each declared as a `runtime_checkable` protocol (`Probes`, `ListsModels`,
`PollsLoad`, `StreamsEvents`, `Closes`): a host (the proxy, an embedding gateway) calls them when an
adapter has them, and falls back to plain HTTP on the paths otherwise. Each is given an `HttpGetter`
bound to the backend's base URL, its credentials and the probe timeout (a client may also offer
``with_timeout(seconds)`` for engine endpoints that hold their answer):

* ``probe(http) -> bool``: is the engine able to serve? (default: ``GET health_path`` is 200)
* ``list_models(http) -> list[str]``: served model ids (default: parse ``GET models_path``)
* ``poll_load(http) -> EngineLoad | None``: the engine's load telemetry, stored with
  ``Fleet.update_load`` so strategies can read it (default: none)
* ``run_events(http, sink, *, task_status)``: a long-running task that feeds the engine's KV
  cache events into ``sink`` (a `KvEventSink`, see `kv_event_sink`) until cancelled. The
  proxy starts it in its task group, once per backend, when the strategy offers a sink;
  ``http`` may also have ``post`` (`HttpClient`). It handles its own reconnects and never
  raises except on cancellation.
* ``aclose()``: release what the adapter holds when its backend goes away.

Transport errors raised from these methods count as a failed probe / a skipped poll.

What engine adapters share, to build on rather than write again:

* `OpenAIAdapter`: the base class (``create`` checking option names, ``probe`` carrying the engine's
  reason, ``list_models``), with `check_path` for path options and `parse_model_list`;
  `EngineMetrics` (an engine's telemetry, ``to_load``) and `prometheus_subset`.
* `KvEventFeed`: the base of an engine's KV event feed (holding while block sizes differ,
  ``resume``, losses by reason, ``engine_cleared``/``resync``, counters in `FeedStats`), the
  backend's `ExactFlag` and `rank_key`; `set_backend_exact` and `set_backend_capacity` to talk to a
  sink whatever optional parts it has.
* `KeepAlive`, `keep_alive` and their policy `Backoff` (from `kvroute.loops`): run an event task's
  work again after each failure, with capped, jittered back-off that a healthy run resets, and the
  log lines every background loop shares.

docs/adapters.md ("The adapter protocol") shows a third-party adapter built on them.
"""

from __future__ import annotations

from kvroute.adapters.kv_events import RANKS, ExactFlag, FeedStats, KvEventFeed, rank_key
from kvroute.adapters.openai import EngineMetrics, OpenAIAdapter, check_path, parse_model_list, prometheus_subset
from kvroute.adapters.protocol import (
    BackendAdapter,
    Closes,
    HttpClient,
    HttpGetter,
    HttpReply,
    KvEventSink,
    ListsModels,
    PollsLoad,
    Probes,
    StreamsEvents,
    kv_event_sink,
    set_backend_capacity,
    set_backend_exact,
)
from kvroute.loops import Backoff, KeepAlive, keep_alive

__all__ = [
    "RANKS",
    "BackendAdapter",
    "Backoff",
    "Closes",
    "EngineMetrics",
    "ExactFlag",
    "FeedStats",
    "HttpClient",
    "HttpGetter",
    "HttpReply",
    "KeepAlive",
    "KvEventFeed",
    "KvEventSink",
    "ListsModels",
    "OpenAIAdapter",
    "PollsLoad",
    "Probes",
    "StreamsEvents",
    "check_path",
    "keep_alive",
    "kv_event_sink",
    "parse_model_list",
    "prometheus_subset",
    "rank_key",
    "set_backend_capacity",
    "set_backend_exact",
]
