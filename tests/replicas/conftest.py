"""Module-scoped event loop for the replica tests: the engine emulators are started once per module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """asyncio, shared by the module-scoped process fixtures."""
    return "asyncio"
