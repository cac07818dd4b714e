"""The ``tensorrt-llm`` backend kind: ``trtllm-serve``'s health, models, JSON/Prometheus load and KV events.

Configure a backend with ``kind = "tensorrt-llm"``; options go in ``adapter_options`` (all optional):

========================  ========================  ======================================================
option                    default                   meaning
========================  ========================  ======================================================
``health_path``           ``/health``               200 when serving; 503 "LLM is unavailable" otherwise
``models_path``           ``/v1/models``            served model ids
``metrics_path``          ``/metrics``              JSON iteration stats (drained on each poll); ``""``: off
``prometheus_path``       ``/prometheus/metrics``   Prometheus gauges, read when the server has them; ``""``: off
``kv_events``             ``true``                  poll ``POST /kv_cache_events`` (needs
                                                    ``kv_cache_config.event_buffer_max_size > 0`` on the server)
``kv_events_path``        ``/kv_cache_events``
``kv_events_interval``    ``0.25``                  seconds between event polls
========================  ========================  ======================================================

Both JSON endpoints drain a server-side buffer: with several router replicas, each gets a share
of the iterations and events. Give each replica its own server-side consumer, or let one
replica read them.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import attrs
from anyio.abc import TaskStatus

from kvroute.adapters import HttpGetter, KvEventSink, parse_model_list
from kvroute.backend import Backend, EngineLoad
from kvroute.logs import get_logger
from kvroute_tensorrt_llm.events import EventFeed, EventFormatError, parse_events
from kvroute_tensorrt_llm.metrics import TrtllmStats, merge_iteration_stats, parse_prometheus

__all__ = ["TensorRTLLMAdapter"]

log = get_logger(__name__)

_RETRY_MAX_S = 30.0
#: Health rounds between two looks for a Prometheus endpoint that was missing.
_PROMETHEUS_RECHECK = 60


def _path(value: object, name: str, *, allow_empty: bool = False) -> str:
    if allow_empty and value in ("", None):
        return ""
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError(f"'{name}' must be a path starting with '/'{' or empty' if allow_empty else ''} (got {value!r}).")
    return value


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.strip().lower() in ("true", "1", "yes", "on")
    raise ValueError(f"'kv_events' must be true or false (got {value!r}).")


def _interval(value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = -1.0
    if isinstance(value, bool) or not 0.01 <= number <= 60:
        raise ValueError(f"'kv_events_interval' must be a number of seconds between 0.01 and 60 (got {value!r}).")
    return number


def _health_path(value: object) -> str:
    return _path(value, "health_path")


def _models_path(value: object) -> str:
    return _path(value, "models_path")


def _metrics_path(value: object) -> str:
    return _path(value, "metrics_path", allow_empty=True)


def _prometheus_path(value: object) -> str:
    return _path(value, "prometheus_path", allow_empty=True)


def _kv_events_path(value: object) -> str:
    return _path(value, "kv_events_path")


@attrs.define
class TensorRTLLMAdapter:
    """Everything engine-specific about one ``trtllm-serve`` server (options in the module docstring)."""

    backend: Backend
    health_path: str = attrs.field(default="/health", converter=_health_path)
    models_path: str = attrs.field(default="/v1/models", converter=_models_path)
    metrics_path: str = attrs.field(default="/metrics", converter=_metrics_path)
    prometheus_path: str = attrs.field(default="/prometheus/metrics", converter=_prometheus_path)
    kv_events: bool = attrs.field(default=True, converter=_bool)
    kv_events_path: str = attrs.field(default="/kv_cache_events", converter=_kv_events_path)
    kv_events_interval: float = attrs.field(default=0.25, converter=_interval)
    #: Load as last read (JSON stats folded together, Prometheus gauges on top).
    stats_seen: TrtllmStats | None = attrs.field(default=None, init=False)
    feed: EventFeed | None = attrs.field(default=None, init=False)
    _prometheus_missing: int = attrs.field(default=0, init=False)

    @classmethod
    def create(cls, backend: Backend, **options: Any) -> TensorRTLLMAdapter:
        """Factory registered for kind ``tensorrt-llm``."""
        known = {a.name for a in attrs.fields(cls) if a.init and a.name != "backend"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))} (expected some of: {', '.join(sorted(known))}).")
        return cls(backend, **options)

    async def probe(self, http: HttpGetter) -> bool:
        """True when ``health_path`` answers 200; otherwise ``ValueError`` carrying the engine's status and reason.

        (TensorRT-LLM: 503 "LLM is unavailable".) The health checker counts the error as a failed probe and logs its text
        when it ejects the backend.
        """
        reply = await http.get(self.health_path)
        if reply.status == 200:
            return True
        reason = reply.body[:200].decode("utf-8", "replace").strip()
        raise ValueError(f"{self.health_path} answered {reply.status}{': ' + reason if reason else ''}")

    async def list_models(self, http: HttpGetter) -> list[str]:
        """The served model ids; ``ValueError`` on a non-200 or a malformed body."""
        reply = await http.get(self.models_path)
        if reply.status != 200:
            raise ValueError(f"{self.models_path} answered {reply.status}, expected 200.")
        return parse_model_list(reply.json())

    async def _prometheus(self, http: HttpGetter) -> dict[str, float] | None:
        if not self.prometheus_path:
            return None
        if self._prometheus_missing:
            self._prometheus_missing -= 1
            return None
        reply = await http.get(self.prometheus_path)
        if reply.status == 404:
            self._prometheus_missing = _PROMETHEUS_RECHECK
            return None
        if reply.status != 200:
            raise ValueError(f"{self.prometheus_path} answered {reply.status}, expected 200.")
        return parse_prometheus(reply.body.decode("utf-8", "replace"))

    async def poll_load(self, http: HttpGetter) -> EngineLoad | None:
        """Drain the JSON iteration stats (and read Prometheus when present) into an `EngineLoad` stamped now.

        An empty list keeps the last values (no iteration ran since the previous poll); ``None``
        until the server has reported anything. ``ValueError`` when an answer cannot be read.
        """
        stats = self.stats_seen
        if self.metrics_path:
            reply = await http.get(self.metrics_path)
            if reply.status != 200:
                raise ValueError(f"{self.metrics_path} answered {reply.status}, expected 200.")
            stats = merge_iteration_stats(stats, reply.json())
        gauges = await self._prometheus(http)
        if gauges:
            changes: dict[str, Any] = {k: (round(v) if k in ("running", "waiting", "block_size") else v) for k, v in gauges.items()}
            stats = attrs.evolve(stats or TrtllmStats(), **changes)
        self.stats_seen = stats
        if stats is None or stats == TrtllmStats():
            return None
        if self.feed is not None and stats.block_size:
            self.feed.engine_block_size = stats.block_size
        return stats.to_load(time.monotonic())

    async def run_events(
        self, http: HttpGetter, sink: KvEventSink, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Poll ``kv_events_path`` into ``sink`` until cancelled (see `kvroute.adapters`)."""
        task_status.started()
        if not self.kv_events:
            return
        post = getattr(http, "post", None)
        if post is None:
            log.error("kv_events_need_post", backend=self.backend.id, hint="the proxy's HTTP client cannot POST")
            return
        backend = self.backend.id
        self.feed = feed = EventFeed(backend, sink)
        if self.stats_seen is not None and self.stats_seen.block_size:
            feed.engine_block_size = self.stats_seen.block_size
        exact = False
        delay = self.kv_events_interval
        try:
            while True:
                try:
                    reply = await post(self.kv_events_path, {})
                    if reply.status == 404:
                        log.warning("kv_events_unsupported", backend=backend, path=self.kv_events_path)
                        return
                    if reply.status != 200:
                        raise ValueError(f"{self.kv_events_path} answered {reply.status}, expected 200.")
                    items = parse_events(reply.json())
                except (OSError, TimeoutError, ValueError) as exc:
                    # The server buffers its events meanwhile: the index stays exact (a restart sends 'created').
                    kind = "kv_events_unreadable" if not isinstance(exc, EventFormatError) else "kv_events_malformed"
                    log.info(kind, backend=backend, error=f"{type(exc).__name__}: {exc}", retry_in_s=delay)
                    await anyio.sleep(delay)
                    delay = min(max(delay * 2, 1.0), _RETRY_MAX_S)
                    continue
                delay = self.kv_events_interval
                if not exact:
                    sink.set_exact(backend, True)
                    exact = True
                    max_blocks = self.stats_seen.max_blocks if self.stats_seen is not None else None
                    set_capacity = getattr(sink, "set_capacity", None)
                    if max_blocks and set_capacity is not None:
                        set_capacity(backend, max_blocks)
                try:
                    feed.receive(items)
                    if feed.holding:
                        feed.resume()
                except Exception:  # a bug must not take the proxy down; cancellation passes
                    log.exception("kv_events_failed", backend=backend)
                await anyio.sleep(self.kv_events_interval)
        finally:
            if exact:
                sink.set_exact(backend, False)

    def stats(self) -> dict[str, Any]:
        """Counters for operators: the last load and the event feed's counters."""
        return {
            "load": attrs.asdict(self.stats_seen) if self.stats_seen is not None else None,
            "kv_events": attrs.asdict(self.feed.stats) | {"holding": self.feed.holding} if self.feed is not None else None,
        }
