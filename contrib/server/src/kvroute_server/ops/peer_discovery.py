"""Peer discovery: router replicas find each other through the backends' discovery kinds (docs/serve.md).

``--peer-discovery KIND:TARGET`` (repeatable) or ``[peers] discovery`` names sources exactly as
``--discovery`` / ``[[discovery]]`` do for backends (``dns:NAME:PORT``, ``dns:_svc._tcp.NAME``,
``kubernetes:NS/SVC:PORT``, ``file:PATH``). The providers are built by the same registered kinds
(`kvroute_server.fleet.discovery.build_providers`) and run, restarted and re-resolved on the same
schedule (`kvroute_server.fleet.discovery.run_provider`); what they find is the set of peers
`kvroute_server.ops.peers.PeerSync` sends its holds to, each endpoint's URL one peer.

`PeerDiscovery` is the `kvroute.discovery.DiscoverySink` of those providers. Per source it keeps the
last good answer; the discovered peers are the union of the sources' answers. Each change is applied
live: a new peer gets a sender, a gone peer's sender stops (counted in
``kvroute_peer_discovery_changes_total``). This replica's own address is recognised and skipped
(`SelfAddress`; the sync endpoint's 409 for a body from itself stays the safety net for what the
address cannot tell, such as a host name or a NAT). A failed lookup or an empty answer keeps the last
good peers: counted in ``kvroute_peer_discovery_failures_total``, ``kvroute_peer_discovery_stale``
set, logged once per reason (``peer_discovery_failed``).
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from typing import Any, Protocol
from urllib.parse import urlsplit

import anyio
import attrs
import structlog
from anyio.abc import TaskStatus

from kvroute.discovery import Snapshot
from kvroute.errors import ConfigError
from kvroute.plugins import PluginManager
from kvroute_server.config import PeerConfig
from kvroute_server.fleet.discovery import SourceStatus, build_providers, run_provider


class PeerSet(Protocol):
    """What peer discovery changes (`kvroute_server.ops.peers.PeerSync`): its settings, counters and peers."""

    config: PeerConfig
    peer_metrics: Any

    def add_peer(self, url: str) -> bool:
        """Start sending to ``url``; False when it is a peer already."""
        ...

    def remove_peer(self, url: str) -> bool:
        """Stop sending to ``url``; False when it was no peer."""
        ...


__all__ = ["PeerDiscovery", "SelfAddress"]

log = structlog.get_logger(__name__)

_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


@functools.lru_cache(maxsize=256)
def _is_local(address: str) -> bool:
    """Whether ``address`` is one of this host's own (a socket can bind to it)."""
    ip = ipaddress.ip_address(address)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))
    except OSError:
        return False
    return True


@attrs.frozen
class SelfAddress:
    """This replica's listen address: tells whether a discovered peer URL is this replica itself.

    A URL is this replica when its port is the listen port and its host is the listen address, or,
    when listening on every address (``0.0.0.0``, ``::``, as in a pod), one of this host's own
    addresses. A host name is compared as written; anything else the 409 self-check catches.
    """

    host: str
    port: int

    def matches(self, url: str) -> bool:
        parts = _host_port(url)
        if parts is None:
            return False
        hostname, port = parts
        if port != self.port:
            return False
        try:
            address = ipaddress.ip_address(hostname)
        except ValueError:
            return hostname == self.host.lower()
        if self.host in _WILDCARDS:
            return _is_local(address.compressed)
        try:
            return address == ipaddress.ip_address(self.host)
        except ValueError:
            return False


def _host_port(url: str) -> tuple[str, int] | None:
    """The host (lower case, IPv6 without brackets) and port (scheme default) of ``url``; None when malformed."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return parts.hostname.lower(), port if port is not None else (443 if parts.scheme == "https" else 80)


class PeerDiscovery:
    """The sink of the peer discovery providers; applies their answers to a `PeerSync`'s peer set."""

    def __init__(self, sync: PeerSet, providers: list[Any], listen: SelfAddress | None) -> None:
        self.sync = sync
        self.providers = providers
        self.listen = listen
        self.status = {p.source: SourceStatus(p.source) for p in providers}
        #: Each source's last good answer: the peer URLs it names.
        self._answers: dict[str, tuple[str, ...]] = {}
        #: Peers this object added (static ``--peer`` URLs are never removed), and URLs found to be this replica.
        self.found: set[str] = set()
        self.itself: set[str] = set()

    @classmethod
    def create(cls, sync: PeerSet, plugins: PluginManager, listen: tuple[str, int] | None) -> PeerDiscovery:
        """The sink for ``sync.config.discovery``'s sources; raises `ConfigError` for a source that cannot be built."""
        try:
            providers = build_providers(sync.config.discovery, plugins)
        except ConfigError as exc:
            raise ConfigError(f"peer discovery: {exc}") from None
        return cls(sync, providers, None if listen is None else SelfAddress(*listen))

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every provider until cancelled (no source: return at once)."""
        async with anyio.create_task_group() as tg:
            for provider in self.providers:
                tg.start_soon(run_provider, provider, self, name=f"peer discovery {provider.source}")
            task_status.started()

    def describe(self) -> list[dict[str, Any]]:
        """Each source's state (last error, peers in its last good answer)."""
        return [
            {"source": st.source, "stale": st.failing, "peers": st.backends, "last_error": st.last_error}
            for st in self.status.values()
        ]

    # -- the sink -------------------------------------------------------------------------

    def publish(self, snapshot: Snapshot) -> None:
        """A source's whole answer; an empty one keeps the last good peers (as for backends)."""
        status = self._status(snapshot.source)
        if not snapshot.backends:
            self.failed(snapshot.source, "the answer names no peers; the last good peers are kept")
            return
        if status.failing:
            log.info("peer_discovery_recovered", source=snapshot.source, peers=len(snapshot.backends))
        status.succeeded(len(snapshot.backends))
        self.sync.peer_metrics.stale.labels(snapshot.source).set(0)
        self._answers[snapshot.source] = tuple(b.url.rstrip("/") for b in snapshot.backends)
        self.apply()

    def failed(self, source: str, reason: str) -> None:
        """A source could not look: keep its last good peers, count it, log it once per reason."""
        status = self._status(source)
        metrics = self.sync.peer_metrics
        metrics.failures.labels(source).inc()
        metrics.stale.labels(source).set(1)
        if status.fail(reason):
            kept = len(self._answers.get(source, ()))
            log.warning("peer_discovery_failed", source=source, reason=reason, kept_peers=kept)

    def _status(self, source: str) -> SourceStatus:
        status = self.status.get(source)
        if status is None:  # a provider publishing under another name than its ``source``
            status = self.status[source] = SourceStatus(source)
        return status

    # -- applying -------------------------------------------------------------------------

    def apply(self) -> None:
        """Bring the peer set in line with the union of the sources' last good answers."""
        wanted: set[str] = set()
        for urls in self._answers.values():
            wanted.update(urls)
        metrics = self.sync.peer_metrics
        for url in sorted(wanted - self.found - self.itself):
            if self.listen is not None and self.listen.matches(url):
                self.itself.add(url)
                metrics.changes.labels("self").inc()
                metrics.discovered.labels(url).set(-1)
                log.info("peer_is_self", peer=url, by="listen_address")
                continue
            self.found.add(url)
            if self.sync.add_peer(url):
                metrics.changes.labels("added").inc()
                metrics.discovered.labels(url).set(1)
                log.info("peer_discovered", peer=url)
        for url in sorted(self.found - wanted):
            self.found.discard(url)
            if url in self.sync.config.urls:  # also a static peer: it stays
                continue
            self.sync.remove_peer(url)
            metrics.changes.labels("removed").inc()
            metrics.discovered.remove(url)
            log.info("peer_gone", peer=url)
        for url in sorted(self.itself - wanted):
            self.itself.discard(url)
            metrics.discovered.remove(url)

    @property
    def peers(self) -> list[str]:
        """The discovered peers sent to now, sorted."""
        return sorted(self.found)
