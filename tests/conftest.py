"""Shared pytest configuration for every tox env."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# Deterministic by default: Hypothesis derandomizes in CI and whenever KVROUTE_HYPOTHESIS_SEEDED=1.
settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def anyio_backend() -> str:
    """Run async tests on asyncio (the proxy's event loop)."""
    return "asyncio"
