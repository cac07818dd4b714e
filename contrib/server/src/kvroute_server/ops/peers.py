"""Router-replica sync: the proxy's replicas share where they sent conversations, sessions and keys.

Several ``kvroute serve`` replicas in front of one fleet each remember where they sent a key (the
session table's bindings, the strategy's holds): a replica that never saw a conversation's first
turn would place its later turns by its own state, often on another backend than the one holding
the history. With ``--peer URL`` (repeatable) and a shared ``--peer-token``, each replica sends the
holds its router made (`kvroute.holds.HoldLog`) to every peer, in batches every ``--peer-interval``
seconds, and adopts the holds its peers send (`kvroute.Router.adopt_holds`).

``POST /kvroute/peer/holds`` with ``Authorization: Bearer <peer token>`` and a JSON body
``{"from": SENDER, "holds": [[KIND, KEY, BACKEND, AGE_S], ...]}``: KIND ``key``, ``conversation`` or
``session``, KEY 16 hex digits, BACKEND a backend id, AGE_S seconds since the hold was made. Answers:
200 ``{"adopted": {...}}``; 401 without the token, 403 with a wrong one, 400 for a malformed body,
413 for a body over `MAX_BODY`, 409 when SENDER is this replica (a peer list that names every
replica, itself included: the sender then stops sending there). The route exists only when peers are
configured.

Sending never touches the request path: the router appends to its bounded log under its lock; one
task per peer takes at most ``--peer-batch`` holds every interval. A peer that is down or slow loses
its batch (``peer_down``, ``peer_error``) or the oldest waiting holds past ``--peer-queue``
(``queue_full``), counted in ``kvroute_peer_holds_dropped_total``.

With ``--peer-discovery`` (`kvroute_server.ops.peer_discovery`) the peer set also follows a discovery
source: `PeerSync.add_peer` starts a sender for a peer found, `PeerSync.remove_peer` stops a gone
peer's sender (its waiting holds are dropped as ``peer_gone``).
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import os
import re
from collections.abc import Sequence
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvroute.holds import HoldLog
from kvroute.plugins import PluginManager
from kvroute.router import Router
from kvroute.strategy import Hold
from kvroute_server.config import MAX_PEER_BATCH, PeerConfig, ServerConfig
from kvroute_server.http.asgi import (
    BodyTooLarge,
    ClientGone,
    InvalidBody,
    Receive,
    RouteTable,
    Scope,
    Send,
    dumps,
    loads_body,
    read_body,
    send_error_draining,
    send_json,
)
from kvroute_server.http.client import UpstreamPool
from kvroute_server.ops.metrics import ProxyMetrics
from kvroute_server.ops.peer_discovery import PeerDiscovery
from kvroute_server.proxy.forwarding import count_reject, reject

__all__ = ["PATH", "NoPeers", "PeerMetrics", "PeerSync", "parse_holds"]

log = structlog.get_logger(__name__)

#: The sync endpoint, on the proxy's own port.
PATH = "/kvroute/peer/holds"
#: Largest sync body accepted (a full batch of 4,096 holds is about 300 KB).
MAX_BODY = 1024 * 1024
_KINDS = frozenset({"key", "conversation", "session", "group"})
_HEX16 = re.compile(r"[0-9a-f]{16}")
_MAX_ID = 256
_MAX_AGE_S = 86400.0


class PeerMetrics:
    """The sync's counters, in the proxy's registry (docs/serve.md, "Several replicas")."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.sent = Counter("kvroute_peer_holds_sent", "Holds sent to a peer, by peer.", ["peer"], registry=r)
        self.received = Counter("kvroute_peer_holds_received", "Holds received from peers.", registry=r)
        self.adopted = Counter(
            "kvroute_peer_holds_adopted",
            "Peers' holds by what this replica did with them (new, newer, same, older, unknown_backend...).",
            ["result"],
            registry=r,
        )
        self.dropped = Counter(
            "kvroute_peer_holds_dropped",
            "Holds not delivered to a peer, by peer and reason (queue_full, peer_down, peer_error, peer_gone).",
            ["peer", "reason"],
            registry=r,
        )
        self.up = Gauge(
            "kvroute_peer_up",
            "1 when the peer's last sync request succeeded, 0 when it failed, -1 when the peer is this replica.",
            ["peer"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.discovered = Gauge(
            "kvroute_peer_discovered",
            "1 while peer discovery names the peer, -1 when what it names is this replica itself.",
            ["peer"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.changes = Counter(
            "kvroute_peer_discovery_changes",
            "Changes peer discovery made to the peer set (added, removed, self: this replica's own address skipped).",
            ["change"],
            registry=r,
        )
        self.failures = Counter(
            "kvroute_peer_discovery_failures",
            "Peer discovery lookups that failed or found nothing (the last good peers are kept), by source.",
            ["source"],
            registry=r,
        )
        self.stale = Gauge(
            "kvroute_peer_discovery_stale",
            "1 while a peer discovery source's last lookup failed (its last good peers are kept), else 0.",
            ["source"],
            multiprocess_mode="livemax",
            registry=r,
        )


def parse_holds(raw: bytes) -> tuple[str, list[Hold]]:
    """The sender and holds of a sync body; any fault is an `InvalidBody` naming the field."""
    body = loads_body(raw)
    if not isinstance(body, dict):
        raise InvalidBody(f"The sync body must be a JSON object (got {type(body).__name__}).", code="invalid_value")
    sender = body.get("from")
    if not isinstance(sender, str) or not 0 < len(sender) <= _MAX_ID:
        raise InvalidBody("'from' must be a string of 1 to 256 characters.", code="invalid_value", param="from")
    items = body.get("holds")
    if not isinstance(items, list) or len(items) > MAX_PEER_BATCH:
        raise InvalidBody(
            f"'holds' must be a list of at most {MAX_PEER_BATCH} holds.", code="invalid_value", param="holds"
        )
    holds = []
    for i, item in enumerate(items):
        where = f"holds[{i}]"
        if not (isinstance(item, list) and len(item) == 4):
            raise InvalidBody(f"'{where}' must be [kind, key, backend, age_s].", code="invalid_value", param=where)
        kind, key, backend, age = item
        if kind not in _KINDS:
            raise InvalidBody(
                f"'{where}' kind must be key, conversation, session or group (got {kind!r}).",
                code="invalid_value",
                param=where,
            )
        if not (isinstance(key, str) and _HEX16.fullmatch(key)):
            raise InvalidBody(f"'{where}' key must be 16 lower-case hex digits.", code="invalid_value", param=where)
        if not isinstance(backend, str) or not 0 < len(backend) <= _MAX_ID:
            raise InvalidBody(f"'{where}' backend must be a backend id.", code="invalid_value", param=where)
        if isinstance(age, bool) or not isinstance(age, int | float) or not 0 <= age <= _MAX_AGE_S:
            raise InvalidBody(f"'{where}' age_s must be a number from 0 to 86400.", code="invalid_value", param=where)
        holds.append(Hold(kind, int(key, 16), backend, float(age)))
    return sender, holds


def _encode(sender: str, holds: Sequence[Hold]) -> bytes:
    return dumps({"from": sender, "holds": [[h.kind, f"{h.key:016x}", h.backend_id, round(h.age_s, 4)] for h in holds]})


class _Peer:
    """One peer: its URL, the holds waiting for it, and the scope its sender runs in (cancelled when it goes)."""

    __slots__ = ("queue", "scope", "url")

    def __init__(self, url: str, size: int) -> None:
        self.url = url
        self.queue: collections.deque[Hold] = collections.deque(maxlen=size)
        self.scope: anyio.CancelScope | None = None


class NoPeers:
    """Sync off: no route, no task."""

    enabled = False

    def add_routes(self, routes: RouteTable[Any]) -> None:
        return None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()


class PeerSync:
    """Sends this replica's holds to its peers and adopts theirs (see the module docstring)."""

    enabled = True

    def __init__(
        self,
        config: PeerConfig,
        router: Router,
        metrics: ProxyMetrics,
        *,
        plugins: PluginManager | None = None,
        listen: tuple[str, int] | None = None,
    ) -> None:
        config.check()
        assert config.token is not None
        self.config = config
        self.router = router
        # The router logs its holds from now on, and new sessions are placed under the share bound.
        self.log = router.holds = HoldLog(config.queue)
        if router.sessions is not None:
            router.sessions.shared = True
        self.metrics = metrics
        self.peer_metrics = PeerMetrics(metrics.registry)
        #: This replica's id in the bodies it sends: random per process, so that it knows itself in a peer list.
        self.id = os.urandom(8).hex()
        self._token = config.token.encode()
        self.peers = {url: _Peer(url, config.queue) for url in config.urls}
        self._self_peers: set[str] = set()
        self._client = UpstreamPool(config.timeout)
        self._tg: TaskGroup | None = None
        #: The peers found by ``--peer-discovery`` (raises `ConfigError` for a source it cannot build).
        self.discovery = PeerDiscovery.create(self, plugins or PluginManager(), listen)
        for url in config.urls:  # a listed URL that is this replica's listen address: no sender (the 409 needs one)
            if self.discovery.listen is not None and self.discovery.listen.matches(url):
                self._self_peers.add(url)
                self.peer_metrics.up.labels(url).set(-1)
                log.info("peer_is_self", peer=url, by="listen_address")

    @classmethod
    def create(
        cls, config: ServerConfig, router: Router, metrics: ProxyMetrics, plugins: PluginManager | None = None
    ) -> PeerSync | NoPeers:
        """Sync with ``config.peers``' URLs and discovered peers, set up in ``router``; `NoPeers` when none are
        configured. The listen address (``config.host``, ``config.port``) tells this replica among its peers."""
        if not config.peers.enabled:
            return NoPeers()
        return cls(config.peers, router, metrics, plugins=plugins, listen=(config.host, config.port))

    # -- the peer set ---------------------------------------------------------------------

    def add_peer(self, url: str) -> bool:
        """Start sending to ``url`` (from the next batch on); False when it is a peer already."""
        if url in self.peers:
            return False
        peer = self.peers[url] = _Peer(url, self.config.queue)
        if self._tg is not None:
            self._tg.start_soon(self._run_peer, peer, name=f"peer {url}")
        return True

    def remove_peer(self, url: str) -> bool:
        """Stop sending to ``url``; its waiting holds are dropped (``peer_gone``). False when it was no peer."""
        peer = self.peers.pop(url, None)
        if peer is None:
            return False
        if peer.scope is not None:
            peer.scope.cancel()
        if peer.queue:
            self.peer_metrics.dropped.labels(url, "peer_gone").inc(len(peer.queue))
            peer.queue.clear()
        self._self_peers.discard(url)
        with contextlib.suppress(KeyError):  # a peer that never answered has no series
            self.peer_metrics.up.remove(url)
        return True

    async def _run_peer(self, peer: _Peer) -> None:
        if self.peers.get(peer.url) is not peer or peer.url in self._self_peers:  # removed before it started, or self
            return
        with anyio.CancelScope() as peer.scope:
            await self._send_loop(peer)

    def add_routes(self, routes: RouteTable[Any]) -> None:
        routes.add("POST", PATH, self.receive)

    # -- receiving ------------------------------------------------------------------------

    def _authorized(self, scope: Scope) -> int:
        """0 when the request carries the peer token, 401 when it carries none, 403 when a wrong one."""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._token)
                return 0 if ok else 403
        return 401

    async def receive(self, scope: Scope, receive: Receive, send: Send) -> None:
        denied = self._authorized(scope)
        if denied:
            text = "The peer sync endpoint needs 'Authorization: Bearer <peer token>'."
            await reject(
                self.metrics, send, denied, text if denied == 401 else "Wrong peer token.", code="invalid_peer_token"
            )
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        try:
            raw = await read_body(receive, MAX_BODY, int(declared) if declared and declared.isdigit() else None)
            sender, holds = parse_holds(raw)
        except ClientGone:
            return
        except BodyTooLarge as exc:
            count_reject(self.metrics, 413, None, str(exc))
            await send_error_draining(
                receive,
                send,
                413,
                str(exc),
                code="request_too_large",
                max_bytes=8 * MAX_BODY,
                max_seconds=5.0,
                idle_seconds=1.0,
            )
            return
        except InvalidBody as exc:
            await reject(self.metrics, send, 400, str(exc), code=exc.code, param=exc.param)
            return
        if sender == self.id:
            await reject(self.metrics, send, 409, "This body comes from this replica itself.", code="peer_is_self")
            return
        self.peer_metrics.received.inc(len(holds))
        results = self.router.adopt_holds(holds)
        for word, count in results.items():
            if count:
                self.peer_metrics.adopted.labels(word).inc(count)
        await send_json(send, 200, {"adopted": dict(results)})

    # -- sending --------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Every interval: take the router's new holds, queue them per peer, send each peer a batch."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for peer in self.peers.values():
                    tg.start_soon(self._run_peer, peer, name=f"peer {peer.url}")
                tg.start_soon(self.discovery.run, name="peer discovery")
                task_status.started()
                while True:
                    await anyio.sleep(self.config.interval)
                    self._distribute()
        finally:
            self._tg = None
            self._client.close()

    def _distribute(self) -> None:
        holds = self.log.drain()
        if self.log.dropped:
            self.peer_metrics.dropped.labels("*", "log_full").inc(self.log.dropped)
            self.log.dropped = 0
        if not holds:
            return
        for peer in self.peers.values():
            if peer.url in self._self_peers:
                continue
            room = peer.queue.maxlen or 0
            over = len(peer.queue) + len(holds) - room
            if over > 0:
                self.peer_metrics.dropped.labels(peer.url, "queue_full").inc(over)
            peer.queue.extend(holds)

    async def _send_loop(self, peer: _Peer) -> None:
        sent = self.peer_metrics.sent.labels(peer.url)
        # The gauge's series starts at the first answer: until then the status page says "unknown", not "down".
        up = self.peer_metrics.up
        headers = {"content-type": "application/json", "authorization": f"Bearer {self.config.token}"}
        batch_size = self.config.batch
        while True:
            await anyio.sleep(self.config.interval)
            while peer.queue:
                batch = [peer.queue.popleft() for _ in range(min(batch_size, len(peer.queue)))]
                status = await self._post(peer, _encode(self.id, batch), headers)
                if status == 200:
                    sent.inc(len(batch))
                    up.labels(peer.url).set(1)
                    continue
                if status == 409:
                    self._self_peers.add(peer.url)
                    peer.queue.clear()
                    up.labels(peer.url).set(-1)
                    log.info("peer_is_self", peer=peer.url)
                    return
                up.labels(peer.url).set(0)
                reason = "peer_down" if status == 0 else "peer_error"
                self.peer_metrics.dropped.labels(peer.url, reason).inc(len(batch))
                break

    async def _post(self, peer: _Peer, body: bytes, headers: dict[str, str]) -> int:
        """The peer's answer status, 0 when it could not be reached in time."""
        deadline = anyio.current_time() + self.config.timeout
        try:
            with anyio.fail_after(self.config.timeout):
                response = await self._client.post(peer.url, PATH, body, headers, deadline=deadline)
                try:
                    while not response.at_eof():
                        await response.readany()
                finally:
                    response.close()
                return response.status
        except (OSError, TimeoutError) as exc:
            log.debug("peer_unreachable", peer=peer.url, error=f"{type(exc).__name__}: {exc}")
            return 0
