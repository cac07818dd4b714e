"""LiteLLM stays offline: a local model cost map, no telemetry, and every socket connection recorded.

The environment is set before anything imports ``litellm``. An audit hook records the
address of every ``socket.connect`` and every ``getaddrinfo`` lookup made by the process;
the autouse fixture fails a test that tried to reach anything but loopback.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no download of the model price list
os.environ.setdefault("LITELLM_TELEMETRY", "False")

#: (event, address) of every non-loopback connection or lookup attempted.
OUTBOUND: list[tuple[str, str]] = []
#: How many loopback connections were seen (proves the hook is live).
LOOPBACK_CONNECTS: list[str] = []


def is_loopback(host: object) -> bool:
    """Whether ``host`` names this machine (127.0.0.0/8, ::1, localhost) or is a Unix socket path."""
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    if not isinstance(host, str):
        return False
    if host == "localhost" or host.startswith("/") or host == "":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "socket.connect":
        address = args[1]
        host = address[0] if isinstance(address, tuple) else address
        if is_loopback(host):
            LOOPBACK_CONNECTS.append(str(host))
        else:
            OUTBOUND.append((event, str(host)))
    elif event == "socket.getaddrinfo" and args[0] is not None and not is_loopback(args[0]):
        OUTBOUND.append((event, str(args[0])))


sys.addaudithook(_audit)


@pytest.fixture(autouse=True)
def no_outbound_traffic() -> Iterator[None]:
    """Fail the test if it (or LiteLLM on its behalf) tried to reach a non-loopback address."""
    before = len(OUTBOUND)
    yield
    assert OUTBOUND[before:] == [], f"outbound network attempts: {OUTBOUND[before:]}"
