"""Fixtures for the emulator tests: one emulator on loopback per test, stopped at teardown."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvroute_server import ServerThread
from kvroute_simulator.emulator import EmulatorApp, EmulatorConfig


@pytest.fixture
def anyio_backend() -> str:
    """The emulator runs on asyncio."""
    return "asyncio"


@pytest.fixture
def emulator() -> Iterator[ServerThread]:
    """A fast emulator serving model 'm' with block size 16."""
    server = ServerThread(EmulatorApp(EmulatorConfig(model="m", time_scale=0.01, num_gpu_blocks=1024))).start()
    try:
        yield server
    finally:
        server.stop()
