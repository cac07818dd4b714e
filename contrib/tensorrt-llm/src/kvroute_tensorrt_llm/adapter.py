"""The ``tensorrt-llm`` backend kind: ``trtllm-serve``'s health, models, JSON/Prometheus load and KV events.

Configure a backend with ``kind = "tensorrt-llm"``; options go in ``adapter_options`` (all optional):

========================  ========================  ======================================================
option                    default                   meaning
========================  ========================  ======================================================
``health_path``           ``/health``               200 when serving; 503 "LLM is unavailable" otherwise
``models_path``           ``/v1/models``            served model ids
``metrics_path``          ``/metrics``              JSON iteration stats (drained on each answer); ``""``: off
``metrics_timeout``       ``120``                   seconds one ``/metrics`` call may take (the server holds it
                                                    while iterations keep coming)
``prometheus_path``       ``/prometheus/metrics``   Prometheus gauges; when they are there, they are the load
                                                    and JSON ``/metrics`` is not read; ``""``: off
``kv_events``             ``true``                  poll ``POST /kv_cache_events`` (needs
                                                    ``kv_cache_config.event_buffer_max_size > 0`` on the server)
``kv_events_path``        ``/kv_cache_events``
``kv_events_interval``    ``0.25``                  seconds between event polls
``kv_events_timeout``     ``120``                   seconds one ``/kv_cache_events`` call may take
``kv_events_resync``      ``60``                    seconds after events were lost before the backend's
                                                    blocks are cleared and trusted again; ``0``: never
========================  ========================  ======================================================

TensorRT-LLM's JSON endpoints answer only after two seconds without a new item (each new
iteration or event re-arms the wait, TensorRT-LLM issue #4926), and they drain the server's
buffer as they go: a client that gives up early loses what was drained. So both get their own,
long timeouts, and ``/metrics`` runs in the background: a load poll waits for it briefly and
otherwise answers with the last values, stamped with the time they were read (strategies
ignore stale load). Both endpoints drain a server-side buffer: with several router replicas,
each gets a share of the iterations and events; give each replica its own server, or let one
replica read them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio
import attrs
from anyio.abc import TaskStatus

from kvroute.adapters import (
    Backoff,
    HttpGetter,
    KeepAlive,
    KvEventSink,
    OpenAIAdapter,
    check_path,
    set_backend_capacity,
)
from kvroute.backend import EngineLoad
from kvroute.logs import get_logger
from kvroute_tensorrt_llm.events import TrtllmEventFeed, parse_events
from kvroute_tensorrt_llm.metrics import ITERATION_GAUGES, TrtllmMetrics, merge_iteration_stats, parse_prometheus

__all__ = ["LoadStats", "TensorRTLLMAdapter"]

log = get_logger(__name__)

#: Health rounds between two looks for a Prometheus endpoint that was missing.
_PROMETHEUS_RECHECK = 60
#: How long a load poll waits for a ``/metrics`` answer before answering with the last values.
_METRICS_WAIT_S = 0.5


class _StatusError(ValueError):
    """An endpoint answered another status than 200."""


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.strip().lower() in ("true", "1", "yes", "on")
    raise ValueError(f"'kv_events' must be true or false (got {value!r}).")


def _seconds(value: object, name: str, low: float, high: float, *, zero: bool = False) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = -1.0
    if isinstance(value, bool) or not (low <= number <= high or (zero and number == 0)):
        extra = " (0: never)" if zero else ""
        raise ValueError(f"'{name}' must be a number of seconds between {low:g} and {high:g}{extra} (got {value!r}).")
    return number


def _metrics_timeout(value: object) -> float:
    return _seconds(value, "metrics_timeout", 0.05, 3600)


def _events_interval(value: object) -> float:
    return _seconds(value, "kv_events_interval", 0.01, 60)


def _events_timeout(value: object) -> float:
    return _seconds(value, "kv_events_timeout", 0.05, 3600)


def _events_resync(value: object) -> float:
    return _seconds(value, "kv_events_resync", 0.05, 86400, zero=True)


def _metrics_path(value: object) -> str:
    return check_path(value, "metrics_path", allow_empty=True)


def _prometheus_path(value: object) -> str:
    return check_path(value, "prometheus_path", allow_empty=True)


def _kv_events_path(value: object) -> str:
    return check_path(value, "kv_events_path")


def _loss_reason(exc: Exception) -> str:
    """Why a failed ``/kv_cache_events`` call may have cost events (the ``kv_index_inexact`` reason)."""
    if isinstance(exc, TimeoutError):
        return "poll_timeout"  # the server held the call; what it drained went with the answer
    if isinstance(exc, _StatusError):
        return "poll_status"  # an error answer: the server may have drained before failing
    if isinstance(exc, ValueError):
        return "unreadable_answer"  # drained, but not JSON or not a list
    return "poll_failed"  # the connection broke; a drained answer may have been on its way


def _with_timeout(http: Any, seconds: float) -> Any:
    """``http`` with its own timeout set to ``seconds``, when the client lets us set it.

    A client offering ``with_timeout(seconds)`` is asked; an attrs client with a ``timeout``
    field (the proxy's) is copied with it; any other keeps its own timeout.
    """
    method = getattr(http, "with_timeout", None)
    if callable(method):
        return method(seconds)
    cls = type(http)
    if attrs.has(cls) and any(f.name == "timeout" for f in attrs.fields(cls)):
        return attrs.evolve(http, timeout=seconds)
    return http


@attrs.define
class LoadStats:
    """Counters of the load polling (``adapter.stats()["load_polling"]``)."""

    #: ``/metrics`` answers read; polls that answered with older values because a call was held.
    answers: int = 0
    held_polls: int = 0
    #: ``/metrics`` calls given up after ``metrics_timeout``: the stats the server drained were lost.
    timeouts: int = 0
    #: Where the load comes from now: ``"json"``, ``"prometheus"`` or ``None`` (nothing yet).
    source: str | None = None


@attrs.define
class TensorRTLLMAdapter(OpenAIAdapter):
    """Everything engine-specific about one ``trtllm-serve`` server (options in the module docstring).

    Health and models are `kvroute.adapters.OpenAIAdapter`'s (TensorRT-LLM answers ``/health`` 503
    "LLM is unavailable" when it cannot serve; the probe's error carries it).
    """

    metrics_path: str = attrs.field(default="/metrics", converter=_metrics_path)
    metrics_timeout: float = attrs.field(default=120.0, converter=_metrics_timeout)
    prometheus_path: str = attrs.field(default="/prometheus/metrics", converter=_prometheus_path)
    kv_events: bool = attrs.field(default=True, converter=_bool)
    kv_events_path: str = attrs.field(default="/kv_cache_events", converter=_kv_events_path)
    kv_events_interval: float = attrs.field(default=0.25, converter=_events_interval)
    kv_events_timeout: float = attrs.field(default=120.0, converter=_events_timeout)
    kv_events_resync: float = attrs.field(default=60.0, converter=_events_resync)
    #: Load as last read (JSON stats folded together, or Prometheus gauges).
    metrics: TrtllmMetrics | None = attrs.field(default=None, init=False)
    feed: TrtllmEventFeed | None = attrs.field(default=None, init=False)
    load_stats: LoadStats = attrs.field(factory=LoadStats, init=False)
    _prometheus_missing: int = attrs.field(default=0, init=False)
    _json: TrtllmMetrics | None = attrs.field(default=None, init=False)
    _json_at: float | None = attrs.field(default=None, init=False)
    _fetch: asyncio.Task[None] | None = attrs.field(default=None, init=False)
    _fetch_error: Exception | None = attrs.field(default=None, init=False)

    # -- load -----------------------------------------------------------------------------

    async def _prometheus(self, http: HttpGetter) -> TrtllmMetrics | None:
        if not self.prometheus_path:
            return None
        if self._prometheus_missing:
            self._prometheus_missing -= 1
            return None
        reply = await http.get(self.prometheus_path)
        if reply.status == 404:
            self._prometheus_missing = _PROMETHEUS_RECHECK
            return None
        return parse_prometheus(reply.raise_for_status(self.prometheus_path).body.decode("utf-8", "replace"))

    def _source(self, source: str, reason: str) -> None:
        if self.load_stats.source != source:
            self.load_stats.source = source
            log.info("trtllm_load_source", backend=self.backend.id, source=source, reason=reason)

    def _seen(self, stats: TrtllmMetrics | None, observed_at: float | None) -> EngineLoad | None:
        self.metrics = stats
        if stats is None or stats == TrtllmMetrics() or observed_at is None:
            return None
        if self.feed is not None and stats.block_size:
            self.feed.engine_block_size = stats.block_size
        return stats.to_load(observed_at)

    async def poll_load(self, http: HttpGetter) -> EngineLoad | None:
        """The server's load as an `EngineLoad` stamped with when it was read; ``None`` until it reported any.

        Prometheus first: a server started with ``return_perf_metrics`` mounts it, and its own
        collector then drains the iteration stats that JSON ``/metrics`` would return (that one
        mostly answers ``[]``), so once its iteration gauges are there they are the load and
        ``/metrics`` is not asked. Otherwise ``/metrics`` is read in the background (see the
        module docstring). ``ValueError`` when an answer cannot be read.
        """
        prometheus = await self._prometheus(http)
        gauges = prometheus.reported() if prometheus is not None else None
        if prometheus is not None and gauges is not None and ITERATION_GAUGES & gauges.keys():
            self._source(
                "prometheus", "the server's Prometheus collector reads the iteration stats (return_perf_metrics)"
            )
            return self._seen(prometheus, time.monotonic())
        stats = self._json
        observed_at = self._json_at
        if self.metrics_path:
            await self._poll_json(http)
            stats, observed_at = self._json, self._json_at
            if stats is not None:
                self._source(
                    "json", "no Prometheus endpoint" if gauges is None else "no iteration gauges in Prometheus yet"
                )
        if gauges:  # some gauges but no iteration ones (e.g. tokens per block): on top of the JSON values
            stats = attrs.evolve(stats or TrtllmMetrics(), **gauges)
            observed_at = observed_at if observed_at is not None else time.monotonic()
        return self._seen(stats, observed_at)

    async def _poll_json(self, http: HttpGetter) -> None:
        """Start a ``/metrics`` call unless one is held by the server; wait for it a little."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # not on asyncio (the proxy is): read it inline
            await self._read_json(http)
            self._raise_fetch_error()
            return
        task = self._fetch
        if task is None or task.done():
            self._raise_fetch_error()  # the previous call's failure, once; the next poll starts a new one
            client = _with_timeout(http, self.metrics_timeout)
            task = self._fetch = asyncio.get_running_loop().create_task(
                self._read_json(client), name=f"trtllm-metrics {self.backend.id}"
            )
        if not task.done():
            # Never cancels the call: only this poll stops waiting for it.
            await asyncio.wait({task}, timeout=_METRICS_WAIT_S)
        if task.done():
            self._raise_fetch_error()
        else:  # held by the server (iterations keep coming): answer with what was read last
            self.load_stats.held_polls += 1

    def _raise_fetch_error(self) -> None:
        error, self._fetch_error = self._fetch_error, None
        if error is not None:
            raise error

    async def _read_json(self, http: HttpGetter) -> None:
        """One ``/metrics`` call, folded in as soon as it answers (whoever waits for it)."""
        try:
            with anyio.fail_after(self.metrics_timeout):
                reply = await http.get(self.metrics_path)
            self._json = merge_iteration_stats(self._json, reply.raise_for_status(self.metrics_path).json())
            self._json_at = time.monotonic()
            self.load_stats.answers += 1
        except TimeoutError as exc:
            self.load_stats.timeouts += 1
            log.warning(
                "trtllm_metrics_timeout",
                backend=self.backend.id,
                timeout_s=self.metrics_timeout,
                hint="the server held /metrics while iterations kept coming; the stats it drained meanwhile are lost",
            )
            self._fetch_error = exc
        except Exception as exc:  # kept for the next poll to raise; cancellation passes
            self._fetch_error = exc

    async def aclose(self) -> None:
        """Stop a ``/metrics`` call the server still holds (when the backend goes away; tests)."""
        task, self._fetch = self._fetch, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})

    # -- KV events ------------------------------------------------------------------------

    async def run_events(
        self, http: HttpGetter, sink: KvEventSink, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Poll ``kv_events_path`` into ``sink`` until cancelled (see `kvroute.adapters` and
        `kvroute_tensorrt_llm.events`)."""
        task_status.started()
        if not self.kv_events:
            return
        if getattr(http, "post", None) is None:
            log.error("kv_events_need_post", backend=self.backend.id, hint="the proxy's HTTP client cannot POST")
            return
        backend = self.backend.id
        post = _with_timeout(http, self.kv_events_timeout).post
        self.feed = feed = TrtllmEventFeed(backend, sink)
        if self.metrics is not None and self.metrics.block_size:
            feed.engine_block_size = self.metrics.block_size
        started = False
        # A failed poll is retried from one interval on, doubling up to 30 s; an answer starts the series over.
        keeper = KeepAlive(
            "trtllm_kv_events",
            Backoff(initial=self.kv_events_interval, maximum=max(30.0, self.kv_events_interval)),
            retry_on=(OSError, ValueError),  # TimeoutError is an OSError
            expected=(OSError, ValueError),
            backend=backend,
        )

        async def poll() -> None:
            """Poll until the server says it has no events (404); raises when a poll fails."""
            nonlocal started
            while True:
                try:
                    with anyio.fail_after(self.kv_events_timeout):
                        reply = await post(self.kv_events_path, {})
                    if reply.status == 404:
                        log.warning("kv_events_unsupported", backend=backend, path=self.kv_events_path)
                        return
                    if reply.status != 200:
                        raise _StatusError(f"{self.kv_events_path} answered {reply.status}, expected 200.")
                    items = parse_events(reply.json())
                except (OSError, ValueError) as exc:
                    if started:
                        # The server may have drained its buffer into the answer that did not arrive.
                        feed.lose(_loss_reason(exc), error=f"{type(exc).__name__}: {exc}")
                    raise
                keeper.healthy()
                if not started:
                    started = True
                    feed.start()
                    set_backend_capacity(sink, backend, self.metrics.max_blocks if self.metrics is not None else None)
                try:
                    feed.receive(items)
                    if feed.holding:
                        feed.resume()
                except Exception as exc:  # a bug must not take the proxy down; cancellation passes
                    log.exception("kv_events_failed", backend=backend)
                    feed.lose("feed_error", error=f"{type(exc).__name__}: {exc}")
                waited = feed.inexact_for
                if self.kv_events_resync and waited is not None and waited >= self.kv_events_resync:
                    feed.resync("resync")
                await anyio.sleep(self.kv_events_interval)

        try:
            await keeper.run(poll)
        finally:
            feed.stop()

    def stats(self) -> dict[str, Any]:
        """Counters for operators: the last load, how it was polled, and the event feed's counters."""
        return {
            "metrics": attrs.asdict(self.metrics) if self.metrics is not None else None,
            "load_polling": attrs.asdict(self.load_stats),
            "kv_events": self.feed.report() if self.feed is not None else None,
        }
