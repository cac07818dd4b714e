"""`ProcessServer`: the uvicorn server of a whole ``kvroute serve`` process."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from kvroute_server.http.runner import GC_THRESHOLDS, ProcessServer, make_uvicorn_config


async def _app(scope: Any, receive: Any, send: Any) -> None:
    """A minimal ASGI app with a lifespan that leaves an object graph behind at startup."""
    if scope["type"] == "lifespan":
        await receive()
        scope.setdefault("state", {})["tables"] = [{"block": i} for i in range(1000)]
        await send({"type": "lifespan.startup.complete"})
        await receive()
        await send({"type": "lifespan.shutdown.complete"})


class TestProcessServer:
    @pytest.mark.anyio
    async def test_objects_alive_after_startup_are_frozen(self) -> None:
        """Once the app has started, the objects then alive are out of the collector's walks (gc.freeze) and the
        young generation is larger."""
        assert gc.get_freeze_count() == 0
        defaults = gc.get_threshold()
        server = ProcessServer(make_uvicorn_config(_app, "127.0.0.1", 0, loop="asyncio"))
        task = asyncio.create_task(server.serve())
        try:
            for _ in range(500):
                if server.started:
                    break
                await asyncio.sleep(0.01)
            assert server.started
            assert gc.get_freeze_count() > 1000
            assert gc.get_threshold() == GC_THRESHOLDS
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 10)
            gc.unfreeze()
            gc.set_threshold(*defaults)
