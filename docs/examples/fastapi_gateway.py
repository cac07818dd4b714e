"""A FastAPI gateway that sends each OpenAI-compatible request where kvroute decides.

kvroute's `RoutingMiddleware` picks the backend and counts the request in flight until the
response has been sent; the endpoint below only forwards the body to ``lease.backend.url``
and streams the answer back. Your own endpoints (auth, quotas, logging) stay as they are.

Run it (needs ``pip install kvroute kvroute-consistent-hash fastapi uvicorn httpx``)::

    python docs/examples/fastapi_gateway.py \\
        --backend gpu0=http://127.0.0.1:8001 --backend gpu1=http://127.0.0.1:8002 \\
        --strategy consistent-hash --port 8080

then point any OpenAI client at http://127.0.0.1:8080/v1. ``GET /kvroute/fleet`` shows the
backends and their requests in flight.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvroute import Backend, Fleet, Router
from kvroute.integrations.asgi import RoutingMiddleware, lease_from, upstream_headers

#: Request headers not passed to the backend (hop-by-hop, recomputed by the client library, or the gateway's own).
DROPPED_HEADERS = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "x-data-parallel-rank",
}


def create_app(router: Router, *, timeout: float = 600.0) -> FastAPI:
    """The gateway app over ``router``; one HTTP client with keep-alive for the app's lifetime."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0)) as client:
            app.state.client = client
            yield

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(RoutingMiddleware, router=router)

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def forward(request: Request) -> Response:
        lease = lease_from(request)  # placed by the middleware; released when this response ends
        client: httpx.AsyncClient = request.app.state.client
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS}
        headers.update(upstream_headers(lease))  # x-data-parallel-rank for a data-parallel engine
        upstream = client.build_request(
            "POST", lease.backend.url + request.url.path, content=await request.body(), headers=headers
        )
        try:
            reply = await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            # The middleware counts a 5xx as a failure of this backend.
            return JSONResponse(
                {"error": {"message": f"backend {lease.backend.id} failed: {exc}", "type": "server_error"}},
                status_code=502,
            )
        passed = {k: v for k, v in reply.headers.items() if k.lower() in ("content-type", "x-request-id")}
        return StreamingResponse(
            reply.aiter_bytes(), status_code=reply.status_code, headers=passed, background=BackgroundTask(reply.aclose)
        )

    @app.get("/kvroute/fleet")
    async def fleet() -> list[dict[str, Any]]:
        """The backends with the requests this gateway has in flight on each."""
        return [
            {"id": s.id, "url": s.backend.url, "in_flight": s.in_flight, "healthy": s.healthy, "draining": s.draining}
            for s in router.fleet
        ]

    return app


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A FastAPI gateway routing with kvroute.")
    parser.add_argument("--backend", action="append", required=True, metavar="ID=URL", help="a backend (repeat)")
    parser.add_argument("--strategy", default="consistent-hash", help="a kvroute strategy name (kvroute plugins)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a strategy option (repeat)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    for flag in ("backend", "option"):
        for item in getattr(args, flag):
            if "=" not in item:
                parser.error(f"--{flag} must look like {'ID=URL' if flag == 'backend' else 'KEY=VALUE'} (got {item!r})")
    return args


def build_router(args: argparse.Namespace) -> Router:
    """A kvroute router over the ``--backend`` flags with the ``--strategy`` and its ``--option`` flags."""
    backends = [Backend(id, url=url.rstrip("/")) for id, url in (b.split("=", 1) for b in args.backend)]
    options = dict(o.split("=", 1) for o in args.option)
    return Router.create(Fleet(backends), args.strategy, options)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    uvicorn.run(create_app(build_router(args)), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
