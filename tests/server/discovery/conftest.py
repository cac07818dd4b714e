"""Fixtures for the discovery tests: a real dnsmasq per test and a sink that records what providers report."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import anyio
import attrs
import pytest

from kvroute.discovery import Snapshot
from tests.server.discovery.dnsmasq import Dnsmasq, Srv, dnsmasq_binary


@pytest.fixture
def anyio_backend() -> str:
    """asyncio, the proxy's event loop."""
    return "asyncio"


@attrs.define
class RecordingSink:
    """A `DiscoverySink` that keeps every report in order: ``("publish", Snapshot)`` or ``("failed", reason)``."""

    events: list[tuple[str, object]] = attrs.field(factory=list)

    def publish(self, snapshot: Snapshot) -> None:
        self.events.append(("publish", snapshot))

    def failed(self, source: str, reason: str) -> None:
        self.events.append(("failed", f"{source}: {reason}"))

    @property
    def published(self) -> list[Snapshot]:
        return [e for kind, e in self.events if kind == "publish" and isinstance(e, Snapshot)]

    @property
    def failures(self) -> list[str]:
        return [str(e) for kind, e in self.events if kind == "failed"]

    def ids(self) -> list[str] | None:
        """The ids of the last published snapshot (None before any)."""
        return [b.id for b in self.published[-1].backends] if self.published else None

    async def until(self, condition: Callable[[RecordingSink], bool], seconds: float, what: str) -> None:
        """Wait at most ``seconds`` for ``condition(self)``; else fail saying what was awaited and what was seen."""
        try:
            with anyio.fail_after(seconds):
                while not condition(self):  # noqa: ASYNC110 - the provider under test fills the sink
                    await anyio.sleep(0.02)
        except TimeoutError:
            pytest.fail(f"expected {what} within {seconds} s; got events {self.events[-6:]!r}", pytrace=False)


@pytest.fixture
def sink() -> RecordingSink:
    """A fresh recording sink."""
    return RecordingSink()


@pytest.fixture
def dnsmasq_factory(tmp_path: Path) -> Iterator[Callable[..., Dnsmasq]]:
    """Start dnsmasq servers (``factory(ttl=..., hosts={...}, srv=[...])``); every one is stopped at teardown."""
    dnsmasq_binary()  # fails, saying how to install it, before any test body runs
    started: list[Dnsmasq] = []

    def factory(*, ttl: int = 0, hosts: dict[str, list[str]] | None = None, srv: Sequence[Srv] = ()) -> Dnsmasq:
        workdir = tmp_path / f"dnsmasq{len(started)}"
        workdir.mkdir()
        server = Dnsmasq(workdir, ttl=ttl, srv=tuple(srv))
        server.write_hosts(hosts or {})
        started.append(server)
        server.start()
        return server

    yield factory
    for server in started:
        server.stop()
