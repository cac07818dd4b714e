"""Module-scoped event loop for the monitoring tests: the monitored stack is started once per module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """asyncio, shared by the module-scoped process fixtures."""
    return "asyncio"
