"""The uvicorn glue: the thread runner (the HTTP protocol itself: test_http1.py)."""

from __future__ import annotations

import pytest

from kvroute_server.http.runner import ServerThread
from tests.server.harness import http


class TestServerThread:
    def test_start_serve_stop(self) -> None:
        """A ServerThread serves an ASGI app on a free port and stops on exit."""

        async def app(scope: dict[str, object], receive: object, send: object) -> None:
            if scope["type"] != "http":
                return
            await send({"type": "http.response.start", "status": 204, "headers": []})  # type: ignore[operator]
            await send({"type": "http.response.body", "body": b""})  # type: ignore[operator]

        with ServerThread(app) as server:
            assert server.port > 0
            assert http("GET", server.url + "/")[0] == 204
        with pytest.raises(OSError):
            http("GET", server.url + "/", timeout=2)
