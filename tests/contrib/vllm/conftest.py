"""Shared settings for the vLLM adapter tests: async tests run on asyncio (pyzmq's asyncio sockets)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    """The proxy's event loop: asyncio."""
    return "asyncio"
