"""The ``vllm`` backend kind: health, models, load from ``/metrics``, KV events over ZMQ.

Configure a backend with ``kind = "vllm"``; options go in its ``adapter_options`` table
(all optional, see docs/adapters.md):

=====================  =============  ============================================================
option                 default        meaning
=====================  =============  ============================================================
``health_path``        ``/health``    200 when the engine can serve (vLLM answers 503 once its engine died)
``models_path``        ``/v1/models`` served model ids
``metrics_path``       ``/metrics``   Prometheus text (`kvroute_vllm.metrics`)
``kv_events``          ``auto``       ``auto``: read the publisher endpoints from ``GET /kv_event_sources``
                                      (vLLM 0.31+; who binds is worked out from what the server
                                      reports, see `kvroute_vllm.subscriber`); ``off``; or the
                                      endpoint exactly as in the engine's ``--kv-events-config``
                                      (``tcp://*:5557``: the engine binds, kvroute connects to the
                                      backend's host; ``tcp://10.0.0.2:5557``: the engine connects,
                                      kvroute binds that address)
``kv_replay``          none           the engine's ``replay_endpoint`` (with ``kv_events`` given)
``kv_topic``           ``""``         the engine's ``topic`` (with ``kv_events`` given)
``kv_bind``            none           bind this address instead, when the engine connects
``kv_ranks``           ``1``          data-parallel ranks (with ``kv_events`` given; ports offset by rank)
=====================  =============  ============================================================

Data-parallel ranks: the server's ranks are learnt from ``/kv_event_sources`` (one entry per
rank) and from ``/metrics`` (one ``engine`` per rank); `poll_load` reports them in the load's
``data_parallel_size`` and per-rank loads, and each rank's events go to that rank's slot of a
sink that keeps ranks apart. Any backend can also declare them (adapter option
``data_parallel_size``, read by the proxy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import anyio
import attrs
import zmq
from anyio.abc import TaskStatus

from kvroute.adapters import (
    Backoff,
    ExactFlag,
    HttpGetter,
    KeepAlive,
    KvEventSink,
    OpenAIAdapter,
    check_path,
    set_backend_capacity,
)
from kvroute.backend import EngineLoad
from kvroute.logs import get_logger
from kvroute_vllm.feed import VllmEventFeed
from kvroute_vllm.metrics import VllmMetrics, parse_prometheus
from kvroute_vllm.subscriber import (
    ZmqSource,
    ZmqSubscriber,
    engine_binds,
    locate_publisher,
    resolve_endpoint,
    split_tcp,
)

__all__ = ["VllmAdapter"]

log = get_logger(__name__)

#: How often a server whose KV events are off is asked again whether they are on (seconds).
_RECHECK_S = 60.0
#: Retries of the event tasks: from 1 s up to 30 s; a subscription that lasted 30 s starts the series over.
_BACKOFF = Backoff(initial=1.0, maximum=30.0, jitter=0.2, healthy_after=30.0)


def _endpoint(value: object, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"'{name}' must be a ZMQ endpoint such as 'tcp://*:5557' (got {value!r}).")
    return value


def _kv_events(value: object) -> str:
    if value in ("auto", "off"):
        return str(value)
    endpoint = _endpoint(value, "kv_events")
    assert endpoint is not None
    if endpoint.startswith("tcp://") and split_tcp(endpoint)[1] in ("0", "*"):
        raise ValueError(
            f"'kv_events' {endpoint!r} has no fixed port (the engine picks one when it starts): use kv_events = "
            "'auto' (vLLM 0.31+ reports the port it bound at /kv_event_sources) or configure a fixed port."
        )
    return endpoint


def _ranks(value: object) -> int:
    ranks = int(value) if isinstance(value, int | str) and not isinstance(value, bool) and str(value).isdigit() else 0
    if ranks < 1:
        raise ValueError(f"'kv_ranks' must be an integer >= 1 (got {value!r}).")
    return ranks


def _metrics_path(value: object) -> str:
    return check_path(value, "metrics_path")


def _kv_replay(value: object) -> str | None:
    return _endpoint(value, "kv_replay")


def _kv_bind(value: object) -> str | None:
    return _endpoint(value, "kv_bind")


def _offset_port(endpoint: str, rank: int) -> str:
    """vLLM's per-rank endpoint: the TCP port plus the rank (``inproc``: a ``_dp<rank>`` suffix)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    head, _, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and port.isdigit() and int(port):
        return f"{head}:{int(port) + rank}"
    return endpoint


def _source_entries(data: object) -> list[tuple[int, str, dict[str, Any]]]:
    """``(rank, where, entry)`` for each publisher in a ``/kv_event_sources`` answer, in rank order.

    Forms: an object keyed by data-parallel rank whose values are the publisher's config
    (vLLM 0.31 to 0.33); a list of ``{data_parallel_rank, endpoint, replay_endpoint, topic}``
    (newer builds), bare or as ``{"sources": [...]}``.
    """
    if isinstance(data, dict) and isinstance(data.get("sources"), list):
        data = data["sources"]
    out: list[tuple[int, str, dict[str, Any]]] = []
    if isinstance(data, list):
        for i, entry in enumerate(data):
            where = f"[{i}]"
            if not isinstance(entry, dict):
                raise ValueError(f"/kv_event_sources{where}: expected an object, got {type(entry).__name__}.")
            rank = entry.get("data_parallel_rank", i)
            if not isinstance(rank, int) or isinstance(rank, bool):
                raise ValueError(f"/kv_event_sources{where}: expected an integer 'data_parallel_rank', got {rank!r}.")
            out.append((rank, where, entry))
    elif isinstance(data, dict):
        for key, entry in data.items():
            where = f"[{key!r}]"
            try:
                rank = int(key)
            except ValueError:
                raise ValueError(f"/kv_event_sources: expected integer rank keys, got {key!r}.") from None
            if not isinstance(entry, dict):
                raise ValueError(f"/kv_event_sources{where}: expected an object, got {type(entry).__name__}.")
            out.append((rank, where, entry))
    else:
        raise ValueError(
            "/kv_event_sources: expected an object keyed by data-parallel rank or a list of sources, "
            f"got {type(data).__name__}."
        )
    return sorted(out, key=lambda t: t[0])


@attrs.define
class VllmAdapter(OpenAIAdapter):
    """Everything engine-specific about one vLLM server (see the module docstring for options).

    Health and models are `kvroute.adapters.OpenAIAdapter`'s (vLLM answers ``/health`` 503 once its
    engine died; the probe's error carries it).
    """

    metrics_path: str = attrs.field(default="/metrics", converter=_metrics_path)
    kv_events: str = attrs.field(default="auto", converter=_kv_events)
    kv_replay: str | None = attrs.field(default=None, converter=_kv_replay)
    kv_topic: str = attrs.field(default="", converter=str)
    kv_bind: str | None = attrs.field(default=None, converter=_kv_bind)
    kv_ranks: int = attrs.field(default=1, converter=_ranks)
    #: The last scrape of ``/metrics`` (``None`` until one succeeded).
    metrics: VllmMetrics | None = attrs.field(default=None, init=False)
    feeds: list[VllmEventFeed] = attrs.field(factory=list, init=False)
    subscribers: list[ZmqSubscriber] = attrs.field(factory=list, init=False)
    _epoch: int = attrs.field(default=0, init=False)

    # -- load ------------------------------------------------------------------------------

    async def poll_load(self, http: HttpGetter) -> EngineLoad:
        """Scrape ``metrics_path`` into an `EngineLoad` stamped now; ``ValueError`` when it cannot be read."""
        reply = (await http.get(self.metrics_path)).raise_for_status(self.metrics_path)
        try:
            text = reply.body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.metrics_path} is not UTF-8 text: {exc}.") from None
        metrics = parse_prometheus(text)
        previous = self.metrics
        if (
            previous is not None
            and metrics.started_at is not None
            and previous.started_at not in (None, metrics.started_at)
        ):
            self._epoch += 1
            log.warning("engine_restarted", backend=self.backend.id, started_at=metrics.started_at)
        self.metrics = metrics
        load = metrics.to_load()
        if len(self.feeds) > (load.data_parallel_size or 1):
            load = attrs.evolve(load, data_parallel_size=len(self.feeds))
        return load

    # -- KV events ---------------------------------------------------------------------

    async def sources(self, http: HttpGetter) -> list[ZmqSource] | None:
        """Where this server publishes KV events: ``[]`` when it does not, ``None`` when it cannot say."""
        if self.kv_events == "off":
            return []
        if self.kv_events != "auto":
            endpoint = self.kv_events
            out = []
            for rank in range(self.kv_ranks):
                configured = _offset_port(endpoint, rank)
                binds = engine_binds(configured)
                local = resolve_endpoint(configured, self.backend.url) if binds else (self.kv_bind or configured)
                replay = (
                    resolve_endpoint(_offset_port(self.kv_replay, rank), self.backend.url) if self.kv_replay else None
                )
                out.append(ZmqSource(local, self.kv_topic, replay, bind=not binds, rank=rank))
            return out
        reply = await http.get("/kv_event_sources")
        if reply.status == 404:
            return None
        out = []
        for rank, where, entry in _source_entries(reply.raise_for_status("/kv_event_sources").json()):
            if entry.get("enable_kv_cache_events", True) is False or entry.get("publisher", "zmq") != "zmq":
                continue
            published = entry.get("endpoint")
            if not isinstance(published, str) or not published:
                raise ValueError(f"/kv_event_sources{where}: expected an 'endpoint' string, got {published!r}.")
            try:
                address, bind = await locate_publisher(published, self.backend.url, kv_bind=self.kv_bind)
            except ValueError as exc:
                raise ValueError(f"/kv_event_sources{where}: {exc}") from None
            configured_replay = entry.get("replay_endpoint")
            replay = None
            if isinstance(configured_replay, str) and configured_replay:
                replay = resolve_endpoint(configured_replay, self.backend.url)
                if replay.startswith("tcp://") and split_tcp(replay)[1] in ("0", "*"):
                    log.warning("kv_replay_port_unknown", backend=self.backend.id, replay_endpoint=configured_replay)
                    replay = None
            topic = entry.get("topic") or ""
            log.info(
                "kv_event_source",
                backend=self.backend.id,
                rank=rank,
                reported=published,
                address=address,
                bind=bind,
                replay=replay,
            )
            out.append(ZmqSource(address, str(topic), replay, bind=bind, rank=rank))
        return out

    async def _discover(self, http: HttpGetter) -> list[ZmqSource]:
        keeper = KeepAlive(
            "vllm_kv_event_sources",
            _BACKOFF,
            retry_on=(OSError, ValueError),
            expected=(OSError, ValueError),
            backend=self.backend.id,
        )
        quiet = False
        while True:
            found = await keeper.run(self.sources, http)
            if found is None:
                log.warning(
                    "kv_event_sources_missing",
                    backend=self.backend.id,
                    hint="this vLLM has no /kv_event_sources; set adapter option kv_events to its KV events endpoint",
                )
                return []
            if found:
                return found
            if not quiet:
                log.info(
                    "kv_events_disabled",
                    backend=self.backend.id,
                    hint="start vLLM with --kv-events-config to feed the exact index",
                )
                quiet = True
            await anyio.sleep(_RECHECK_S)

    async def run_events(
        self, http: HttpGetter, sink: KvEventSink, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Feed this server's KV events into ``sink`` until cancelled (see `kvroute.adapters`)."""
        task_status.started()
        if self.kv_events == "off":
            return
        sources = await self._discover(http)
        if not sources:
            return
        backend = self.backend.id
        flag = ExactFlag(backend, sink)
        size = max(s.rank for s in sources) + 1 if len(sources) > 1 else None
        self.feeds = [VllmEventFeed(backend, sink, rank=s.rank, size=size, exact_flag=flag) for s in sources]
        self.subscribers = [ZmqSubscriber(s) for s in sources]
        try:
            async with anyio.create_task_group() as tg:
                for subscriber, feed in zip(self.subscribers, self.feeds, strict=True):
                    tg.start_soon(self._follow, subscriber, feed, sink)
        finally:
            flag.close()

    async def _follow(self, subscriber: ZmqSubscriber, feed: VllmEventFeed, sink: KvEventSink) -> None:
        backend = self.backend.id
        seen_epoch = self._epoch
        capacity: int | None = None

        def wake() -> None:
            nonlocal seen_epoch, capacity
            if self._epoch != seen_epoch:
                seen_epoch = self._epoch
                feed.restart()
            if feed.holding:
                feed.resume()
            blocks = self.metrics.num_gpu_blocks if self.metrics is not None else None
            if blocks != capacity and set_backend_capacity(sink, backend, blocks):
                capacity = blocks
            # Connecting proves nothing (ZMQ connects to anything): a subscription that lasted is the recovery.
            if keeper.failures and keeper.running_for >= _BACKOFF.healthy_after:
                keeper.healthy()

        keeper = KeepAlive(
            "vllm_kv_events",
            _BACKOFF,
            expected=(zmq.ZMQError,),
            backend=backend,
            endpoint=subscriber.source.endpoint,
            bind=subscriber.source.bind,
        )
        # Never lets one backend's events take the proxy down: any failure is retried (cancellation passes).
        await keeper.run(self._subscribe, subscriber, feed, wake)

    async def _subscribe(self, subscriber: ZmqSubscriber, feed: VllmEventFeed, wake: Callable[[], None]) -> None:
        """One subscription, until it fails; the backend stops being exact with it."""
        # A new subscription starts from the replay buffer: the index is rebuilt from what it holds.
        feed.reset()
        try:
            await subscriber.run(feed, on_wake=wake, on_connected=feed.subscribe)
        except Exception:
            with contextlib.suppress(Exception):
                feed.unsubscribe()
            raise

    def stats(self) -> dict[str, Any]:
        """Counters for operators: the last metrics and each event feed's counters."""
        return {
            "metrics": attrs.asdict(self.metrics) if self.metrics is not None else None,
            "kv_events": [
                {
                    "endpoint": sub.source.endpoint,
                    "rank": sub.source.rank,
                    "connected": sub.connected,
                    "expected_seq": feed.expected,
                    "replays": sub.replays,
                    "replay_failures": sub.replay_failures,
                    "decode_errors": sub.decode_errors,
                    **feed.report(),
                }
                for sub, feed in zip(self.subscribers, self.feeds, strict=True)
            ],
        }
