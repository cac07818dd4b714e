"""Helpers shared by every test directory (import as ``from tests.helpers import free_port``)."""

from __future__ import annotations

import socket

__all__ = ["free_port", "free_ports"]


def free_port(host: str = "127.0.0.1") -> int:
    """A loopback port nothing listened on a moment ago (bound, then released)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free on ``host`` a moment ago (all held open together, so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()
