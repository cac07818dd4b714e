"""Watching the client while a request is forwarded: its leaving cancels the request's task.

Under kvroute's own HTTP protocol the server calls back (the ``kvroute.disconnect`` extension,
`kvroute_server.http.protocol`); under any other ASGI server a task waits in ``receive()`` for
``http.disconnect``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from kvroute_server.http.asgi import Receive, Scope
from kvroute_server.http.protocol import DISCONNECT_EXTENSION, DisconnectNotice


class Exchange(Protocol):
    """What the watch reads and marks of a request (`kvroute_server.proxy.forwarding.Exchange`)."""

    complete: bool
    client_gone: bool


__all__ = ["watch_client"]


def watch_client(scope: Scope, receive: Receive, ex: Exchange, task: asyncio.Task[Any]) -> Callable[[], object]:
    """Have ``task`` cancelled if the client leaves before the response is complete; returns the undo.

    Under kvroute's own HTTP protocol the server calls back (the ``kvroute.disconnect`` extension,
    `kvroute_server.http.protocol`); under any other ASGI server a task waits in ``receive()`` for
    ``http.disconnect``.
    """
    extensions = scope.get("extensions")
    notice: DisconnectNotice | None = extensions.get(DISCONNECT_EXTENSION) if extensions else None
    if notice is not None:
        notice.callback = lambda: _client_gone(ex, task)
        return notice.forget
    return asyncio.create_task(_watch_disconnect(receive, ex, task)).cancel


def _client_gone(ex: Exchange, task: asyncio.Task[Any]) -> None:
    """Cancel the request's task: its client went away before the response was complete."""
    if not ex.complete:
        ex.client_gone = True
        task.cancel()


async def _watch_disconnect(receive: Receive, ex: Exchange, task: asyncio.Task[Any]) -> None:
    """Wait in ``receive()`` for ``http.disconnect`` (ASGI servers without the disconnect extension)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            _client_gone(ex, task)
            return
