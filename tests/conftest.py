"""Shared pytest configuration for every tox env."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# Deterministic by default: the "ci" profile (derandomize=True: the same examples on every run) is loaded
# unless HYPOTHESIS_PROFILE names another, e.g. HYPOTHESIS_PROFILE=dev for fresh random examples with plain
# pytest. tox passes only KVROUTE_* variables, so tox runs always use "ci".
settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def anyio_backend() -> str:
    """Run async tests on asyncio (the proxy's event loop)."""
    return "asyncio"
