"""The ZMQ side of vLLM's KV events: a SUB socket for the live stream, a DEALER for replays.

Who binds. vLLM decides from its *configured* endpoint: it binds one with a wildcard (``*``,
``::``) or an ``ipc://``/``inproc://`` one, and connects to any other (`engine_binds`, used
when the endpoint is given as an adapter option). What ``GET /kv_event_sources`` *reports* is
not always the configured string: vLLM 0.31+ binds ``tcp://*:0`` on its node IP and reports the
resolved ``tcp://<node-ip>:<port>``, which looks like a connect address. `locate_publisher`
works out, for every form reported, which side binds:

* ``ipc://``/``inproc://``, or a wildcard host (``*``, ``0.0.0.0``, ``::``, ``[::]``): the
  engine bound it; kvroute connects (a wildcard is reached at the backend's host);
* a concrete address of this machine: kvroute connects when something listens there (the
  engine bound it: a resolved ``*:0``, or a router on the engine's host), and binds it
  otherwise (the engine connects to the router);
* a concrete address elsewhere: the engine's (a resolved ``*:0``) when it is the backend's
  host or no ``kv_bind`` is set: kvroute connects (binding an address that is not this
  machine's can only fail); with ``kv_bind`` the engine connects to it and kvroute binds it;
* a port of 0 (a server that reports the configured ``*:0`` without the port it got) cannot
  be reached: an error that says so.

The replay endpoint is always bound by the engine (a ROUTER): a DEALER sends ``[b"", start seq
(8 bytes BE)]`` and receives every buffered batch from ``start`` on, then an end marker with seq
-1 (`decode_replay_reply`: with the topic frame from vLLM 0.26 on, without it before).

Sockets are pyzmq's asyncio sockets, so the subscriber runs on the proxy's event loop (asyncio
or uvloop) inside its anyio task group and stops when cancelled, closing its sockets.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

import anyio
import attrs
import zmq
import zmq.asyncio

from kvroute.logs import get_logger
from kvroute_vllm.events import EventBatch, EventFormatError, decode_message, decode_replay_reply
from kvroute_vllm.feed import VllmEventFeed

__all__ = ["ZmqSource", "ZmqSubscriber", "engine_binds", "locate_publisher", "resolve_endpoint", "split_tcp"]

log = get_logger(__name__)


_WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "::0", "0:0:0:0:0:0:0:0"})


def engine_binds(endpoint: str) -> bool:
    """Whether vLLM binds the *configured* ``endpoint`` (wildcard, IPv6 any, ipc, inproc) rather than connecting to
    it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def split_tcp(endpoint: str) -> tuple[str, str]:
    """``(host, port)`` of a ``tcp://host:port`` endpoint (IPv6 hosts without brackets); ``ValueError`` otherwise."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"expected a tcp:// endpoint, got {endpoint!r}.")
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"expected a ZMQ endpoint 'tcp://host:port', got {endpoint!r}.")
    return host.removeprefix("[").removesuffix("]"), port


def _host_for_zmq(url: str) -> str:
    host = urlsplit(url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def resolve_endpoint(endpoint: str, backend_url: str) -> str:
    """The address to connect to for an endpoint the engine binds: a wildcard host replaced by the backend's host."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    try:
        host, port = split_tcp(endpoint)
    except ValueError:
        return endpoint
    if host in _WILDCARD_HOSTS:
        return f"tcp://{_host_for_zmq(backend_url)}:{port}"
    return endpoint


def _is_local(host: str) -> bool:
    """Whether ``host`` is an address of this machine (a socket can be bound to it)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0, *address[2:]))
            return True
        except OSError:
            continue
    return False


async def _listening(host: str, port: int) -> bool:
    """Whether a TCP listener answers at ``host:port`` (only ever asked for this machine's addresses)."""
    try:
        stream = await anyio.connect_tcp(host, port)
    except OSError:
        return False
    await stream.aclose()
    return True


async def locate_publisher(
    reported: str, backend_url: str, *, kv_bind: str | None = None, probe_timeout: float = 1.0
) -> tuple[str, bool]:
    """``(address, bind)``: where kvroute subscribes to an endpoint a server *reported*, and whether it binds it.

    See the module docstring for the rules; ``ValueError`` for an endpoint that cannot be used.
    """
    if reported.startswith(("ipc://", "inproc://")):
        return reported, False
    host, port = split_tcp(reported)
    if port in ("*", "0"):
        raise ValueError(
            f"the engine reports KV events endpoint {reported!r} without the port it bound (a server that "
            "does not resolve 'tcp://*:0'); configure a fixed port, or give the adapter option kv_events."
        )
    if not port.isdigit():
        raise ValueError(f"expected a numeric port in KV events endpoint {reported!r}.")
    if host in _WILDCARD_HOSTS:
        return resolve_endpoint(reported, backend_url), False
    if await anyio.to_thread.run_sync(_is_local, host):
        listening = False
        with anyio.move_on_after(probe_timeout):
            listening = await _listening(host, int(port))
        if listening:
            return reported, False
        return kv_bind or reported, True
    if host == (urlsplit(backend_url).hostname or "") or kv_bind is None:
        return reported, False
    return kv_bind, True


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
    """Receive one source's batches into a `VllmEventFeed`, filling gaps from the replay socket."""

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
                if len(frames) not in (3, 4) or frames[0] != b"":
                    self.replay_failures += 1
                    log.warning("kv_replay_bad_reply", endpoint=self.source.replay, frames=len(frames))
                    return out, False
                try:
                    batch = decode_replay_reply(frames, self.topic)
                except EventFormatError as exc:
                    self.decode_errors += 1
                    log.warning("kv_event_undecodable", endpoint=self.source.replay, error=str(exc))
                    continue
                if batch is None:
                    return out, True
                out.append(batch)
        finally:
            dealer.close(linger=0)

    async def _fill(self, feed: VllmEventFeed, start: int) -> None:
        batches, complete = await self.replay(start)
        feed.replayed(batches, complete=complete)

    async def run(
        self,
        feed: VllmEventFeed,
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
            log.info(
                "kv_events_subscribed", endpoint=self.source.endpoint, bind=self.source.bind, replay=self.source.replay
            )
            if on_connected is not None:
                on_connected()
            # What the engine published before we came (as far as its replay buffer reaches).
            feed.needs_resync = False
            await self._fill(feed, 0)
            while True:
                frames: list[bytes] = []
                with anyio.move_on_after(self.wake_every):
                    frames = await sub.recv_multipart()
                if on_wake is not None:
                    on_wake()
                if feed.needs_resync:
                    # The sink forgot this backend's blocks (it went back to exact): rebuild from the replay buffer.
                    feed.needs_resync = False
                    feed.reset()
                    await self._fill(feed, 0)
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
