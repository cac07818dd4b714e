"""The ZMQ side of vLLM's KV events: a SUB socket for the live stream, a DEALER for replays.

vLLM's publisher binds its PUB socket when the configured endpoint has a wildcard (``*``,
``::``) or is ``ipc://``/``inproc://``, and connects to it otherwise; the subscriber does the
opposite (`resolve_endpoint`). The replay endpoint is always bound by the engine (a ROUTER):
a DEALER sends ``[b"", start seq (8 bytes BE)]`` and receives ``[b"", topic, seq, payload]`` for
every buffered batch from ``start`` on, then ``[b"", b"", -1 (8 bytes), b""]``.

Sockets are pyzmq's asyncio sockets, so the subscriber runs on the proxy's event loop (asyncio
or uvloop) inside its anyio task group and stops when cancelled, closing its sockets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from urllib.parse import urlsplit

import anyio
import attrs
import zmq
import zmq.asyncio

from kvroute.logs import get_logger
from kvroute_vllm.events import END_SEQ, EventBatch, EventFormatError, decode_batch, decode_message
from kvroute_vllm.feed import KvEventFeed

__all__ = ["ZmqSource", "ZmqSubscriber", "engine_binds", "resolve_endpoint"]

log = get_logger(__name__)


def engine_binds(endpoint: str) -> bool:
    """Whether vLLM binds ``endpoint`` (wildcard, IPv6 any, ipc, inproc) rather than connecting to it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _host_for_zmq(url: str) -> str:
    host = urlsplit(url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def resolve_endpoint(endpoint: str, backend_url: str) -> str:
    """The address to connect to for an endpoint the engine binds: its wildcard replaced by the backend's host."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint
    host = _host_for_zmq(backend_url)
    for wildcard in ("[::]", "*"):
        if wildcard in endpoint:
            return endpoint.replace(wildcard, host, 1)
    return endpoint


@attrs.frozen
class ZmqSource:
    """Where one engine rank publishes, as the subscriber must use it.

    ``endpoint`` is connected to when ``bind`` is false (the engine binds), bound otherwise;
    ``replay`` (optional) is always connected to.
    """

    endpoint: str
    topic: str = ""
    replay: str | None = None
    bind: bool = False
    rank: int = 0


class ZmqSubscriber:
    """Receive one source's batches into a `KvEventFeed`, filling gaps from the replay socket."""

    def __init__(self, source: ZmqSource, *, replay_timeout: float = 5.0, wake_every: float = 0.5) -> None:
        self.source = source
        self.replay_timeout = replay_timeout
        self.wake_every = wake_every
        self.topic = source.topic.encode()
        self.decode_errors = 0
        self.replays = 0
        self.replay_failures = 0
        self.connected = False
        #: The address actually bound (bind mode, after `run` started; resolves ``tcp://host:*``).
        self.bound_endpoint: str | None = None
        self._ctx: zmq.asyncio.Context | None = None

    async def replay(self, start: int) -> tuple[list[EventBatch], bool]:
        """Batches from ``start`` on, and whether the end marker arrived (``False``: timed out or unusable)."""
        if self.source.replay is None or self._ctx is None:
            return [], False
        self.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[EventBatch] = []
        try:
            dealer.connect(self.source.replay)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames: list[bytes] = []
                with anyio.move_on_after(self.replay_timeout):
                    frames = await dealer.recv_multipart()
                if not frames:
                    self.replay_failures += 1
                    log.warning("kv_replay_timeout", endpoint=self.source.replay, start=start, received=len(out))
                    return out, False
                if len(frames) != 4 or frames[0] != b"":
                    self.replay_failures += 1
                    log.warning("kv_replay_bad_reply", endpoint=self.source.replay, frames=len(frames))
                    return out, False
                _, topic, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    return out, True
                try:
                    if topic != self.topic:
                        raise EventFormatError(f"expected topic {self.topic!r}, got {bytes(topic)!r}")
                    out.append(decode_batch(int.from_bytes(seq_bytes, "big"), payload))
                except EventFormatError as exc:
                    self.decode_errors += 1
                    log.warning("kv_event_undecodable", endpoint=self.source.replay, error=str(exc))
        finally:
            dealer.close(linger=0)

    async def _fill(self, feed: KvEventFeed, start: int) -> None:
        batches, complete = await self.replay(start)
        feed.replayed(batches, complete=complete)

    async def run(
        self,
        feed: KvEventFeed,
        *,
        on_wake: Callable[[], None] | None = None,
        on_connected: Callable[[], None] | None = None,
    ) -> None:
        """Subscribe and apply batches until cancelled; ``on_wake`` runs at least every ``wake_every`` s."""
        self._ctx = ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side; vLLM's own hwm bounds the queue
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            if self.source.bind:
                sub.bind(self.source.endpoint)
                self.bound_endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                sub.connect(self.source.endpoint)
            self.connected = True
            log.info("kv_events_subscribed", endpoint=self.source.endpoint, bind=self.source.bind, replay=self.source.replay)
            if on_connected is not None:
                on_connected()
            # What the engine published before we came (as far as its replay buffer reaches).
            await self._fill(feed, 0)
            while True:
                frames: list[bytes] = []
                with anyio.move_on_after(self.wake_every):
                    frames = await sub.recv_multipart()
                if on_wake is not None:
                    on_wake()
                if not frames:
                    continue
                try:
                    batch = decode_message(frames, self.topic)
                except EventFormatError as exc:
                    self.decode_errors += 1
                    log.warning("kv_event_undecodable", endpoint=self.source.endpoint, error=str(exc))
                    continue
                if feed.expected is None and batch.seq > 0 and self.source.replay is not None:
                    await self._fill(feed, 0)  # the first replay failed (engine not up yet): catch up now
                gap = feed.receive(batch)
                if gap is None:
                    continue
                await self._fill(feed, gap.start)
                gap = feed.receive(batch)
                if gap is not None:
                    feed.skip_gap(gap)
                    feed.receive(batch)
        finally:
            self.connected = False
            with contextlib.suppress(zmq.ZMQError):
                sub.close(linger=0)
            ctx.destroy(linger=0)
            self._ctx = None
