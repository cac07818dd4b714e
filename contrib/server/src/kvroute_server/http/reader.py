"""Reading requests: the parser's callbacks gather and check a request head, build its scope and pass its body on.

httptools (llhttp, the C parser uvicorn uses too) calls `RequestReader` while the connection
feeds it bytes. A complete head becomes a `Cycle` with the ASGI 3 HTTP scope uvicorn builds
(``type``, ``asgi``, ``http_version``, ``server``, ``client``, ``scheme``, ``root_path``,
``headers`` with lower-case names, ``state``, ``method``, ``path`` percent-decoded,
``raw_path``, ``query_string``, plus the ``kvroute.disconnect`` extension), handed to the
connection at once, so that the app can start before the body has arrived.
"""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import Callable
from typing import Any

import httptools

from kvroute_server.http.cycle import DISCONNECT_EXTENSION, Cycle

__all__ = ["HIGH_WATER", "MAX_HEAD_BYTES", "HeadTooLarge", "RequestReader"]

#: Body bytes buffered for the app before reading from the socket pauses.
HIGH_WATER = 64 * 1024
#: Request head (request line and headers) size limit; larger heads get a 431.
MAX_HEAD_BYTES = 64 * 1024


class HeadTooLarge(Exception):
    """Raised from a parser callback: the request head exceeds `MAX_HEAD_BYTES`."""


class RequestReader:
    """One connection's request parser and its callbacks; ``parser`` is None once nothing more is to be read.

    ``on_request(cycle)`` is called when a request head is complete; ``pause()`` when more than
    `HIGH_WATER` body bytes wait for the app. ``current`` is the request being parsed.
    """

    def __init__(
        self, root_path: str, app_state: dict[str, Any], on_request: Callable[[Cycle], None], pause: Callable[[], None]
    ) -> None:
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.root_path = root_path
        self.app_state = app_state
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.current: Cycle | None = None
        self._on_request = on_request
        self._pause = pause
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._expect_100 = False

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._expect_100 = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise HeadTooLarge

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_100 = True
        self._headers.append((name, value))
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise HeadTooLarge

    def on_headers_complete(self) -> None:
        parser = self.parser
        assert parser is not None
        url = self._url
        if url[:1] == b"/" and b"?" not in url and b"#" not in url:
            raw_path, query = url, b""
        else:
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path or b"/", parsed.query or b""
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        version = parser.get_http_version()
        root = self.root_path
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version,
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": root,
            "headers": self._headers,
            "state": self.app_state.copy(),
            "method": parser.get_method().decode("ascii"),
            "path": root + path if root else path,
            "raw_path": root.encode("ascii") + raw_path if root else raw_path,
            "query_string": query,
        }
        cycle = Cycle(scope, version != "1.0" and parser.should_keep_alive(), self._expect_100)
        scope["extensions"] = {DISCONNECT_EXTENSION: cycle.notice}
        self.current = cycle
        self._on_request(cycle)

    def on_body(self, body: bytes) -> None:
        cycle = self.current
        if cycle is None or cycle.response_done:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER:
            self._pause()
        cycle.wake()

    def on_message_complete(self) -> None:
        cycle = self.current
        self.current = None
        if cycle is None:
            return
        cycle.message_done = True
        cycle.wake()
