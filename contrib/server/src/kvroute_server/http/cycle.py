"""One request and its answer on a connection (`Cycle`), and how the app learns that its client left."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["DISCONNECT_EXTENSION", "Cycle", "DisconnectNotice"]

#: The ASGI extension (a key of ``scope["extensions"]``) through which an app learns of a client
#: that went away: its value is the request's `DisconnectNotice`.
DISCONNECT_EXTENSION = "kvroute.disconnect"


class DisconnectNotice:
    """One request's view of its client connection, given to the app as the ``kvroute.disconnect`` extension.

    ``callback`` (set by the app, cleared when it no longer cares) is called once, from the event
    loop, if the client disconnects before the response is complete. ``gone`` says whether it has.
    """

    __slots__ = ("callback", "gone")

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None
        self.gone = False

    def forget(self) -> None:
        """Drop the callback (the app no longer needs to know)."""
        self.callback = None


class Cycle:
    """One request and its response on a connection: the body as it arrives, the answer's framing and progress."""

    __slots__ = (
        "body",
        "body_read",
        "chunked",
        "continue_100",
        "head",
        "is_head",
        "keep_alive",
        "length_left",
        "message_done",
        "notice",
        "response_done",
        "response_started",
        "scope",
        "task",
        "waiter",
    )

    def __init__(self, scope: dict[str, Any], keep_alive: bool, continue_100: bool) -> None:
        self.scope = scope
        self.keep_alive = keep_alive
        self.continue_100 = continue_100
        self.is_head = scope["method"] == "HEAD"
        self.body = bytearray()
        self.body_read = False  # the app has received the body's last message
        self.message_done = False
        self.response_started = False
        self.response_done = False
        self.head: bytes | None = None  # a response head not yet written (waits for the first body bytes)
        self.chunked = False
        self.length_left: int | None = None
        self.notice = DisconnectNotice()
        self.waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    def wake(self) -> None:
        """Wake the app if it waits in ``receive()`` (body bytes came, the request ended, or the client left)."""
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def client_gone(self) -> None:
        """The connection was lost before the answer was complete: tell the app, once."""
        notice = self.notice
        notice.gone = True
        self.wake()
        callback, notice.callback = notice.callback, None
        if callback is not None:
            callback()
