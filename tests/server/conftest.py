"""Fixtures for the proxy tests: emulators and proxies on loopback, each stopped at teardown."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.harness import Servers


@pytest.fixture
def anyio_backend() -> str:
    """The proxy runs on asyncio (aiohttp), so async tests do too."""
    return "asyncio"


@pytest.fixture
def servers() -> Iterator[Servers]:
    """A registry of loopback servers, all stopped when the test ends."""
    registry = Servers()
    try:
        yield registry
    finally:
        registry.stop_all()
