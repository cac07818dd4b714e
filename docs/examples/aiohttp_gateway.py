"""An aiohttp gateway that routes OpenAI-compatible requests with kvroute's library API.

No middleware here: the handler builds the `RouteRequest`, holds a lease with
``async with router.route(...)`` while it forwards and streams the answer, and on a
connection failure routes again excluding the backend that failed. This is the whole
contract between a host and kvroute: route, forward, let the block end.

Run it (needs ``pip install kvroute kvroute-consistent-hash aiohttp``)::

    python docs/examples/aiohttp_gateway.py \\
        --backend gpu0=http://127.0.0.1:8001 --backend gpu1=http://127.0.0.1:8002 \\
        --strategy consistent-hash --port 8080
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator, Sequence

import aiohttp
from aiohttp import web

from kvroute import Backend, Fleet, InvalidRequest, NoBackendAvailable, Router, RouteRequest

ROUTER = web.AppKey("router", Router)
SESSION = web.AppKey("session", aiohttp.ClientSession)
#: How many backends one request may try when connecting fails.
ATTEMPTS = 2
PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
DROPPED_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade"}


def error(status: int, message: str, param: str | None = None) -> web.Response:
    """An OpenAI-shaped error body."""
    kind = {400: "invalid_request_error", 502: "server_error", 503: "service_unavailable_error"}[status]
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}}, status=status)


async def forward(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER]
    raw = await request.read()
    try:
        lowered = {k.lower(): v for k, v in request.headers.items()}
        route = RouteRequest.from_openai(json.loads(raw), endpoint=PATHS[request.path], headers=lowered)  # type: ignore[arg-type]
    except InvalidRequest as exc:
        return error(400, str(exc), exc.param)
    except ValueError as exc:
        return error(400, f"The request body must be JSON ({exc}).")
    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS}
    failed: set[str] = set()
    for _ in range(ATTEMPTS):
        try:
            async with router.route(route, exclude=failed) as lease:
                try:
                    upstream = await request.app[SESSION].post(
                        lease.backend.url + request.path, data=raw, headers=headers
                    )
                except aiohttp.ClientConnectionError as exc:
                    lease.fail(str(exc))  # counted as an error on this backend; try another one
                    failed.add(lease.backend.id)
                    continue
                async with upstream:
                    if upstream.status >= 500:
                        lease.fail(f"HTTP {upstream.status}")
                    response = web.StreamResponse(
                        status=upstream.status,
                        headers={
                            "content-type": upstream.headers.get("content-type", "application/json"),
                            "x-kvroute-backend": lease.backend.id,
                        },
                    )
                    await response.prepare(request)
                    async for chunk in upstream.content.iter_any():
                        await response.write(chunk)
                    await response.write_eof()
                    return response  # the lease ends here, after the last byte
        except NoBackendAvailable as exc:
            return error(503, str(exc))
    return error(502, f"no backend answered after {ATTEMPTS} attempts (failed: {', '.join(sorted(failed))}).")


async def fleet(request: web.Request) -> web.Response:
    """The backends with the requests this gateway has in flight on each."""
    return web.json_response(
        [
            {"id": s.id, "url": s.backend.url, "in_flight": s.in_flight, "healthy": s.healthy}
            for s in request.app[ROUTER].fleet
        ]
    )


def create_app(router: Router) -> web.Application:
    """The gateway app over ``router``; one client session with keep-alive for the app's lifetime."""

    async def session(app: web.Application) -> AsyncIterator[None]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)) as client:
            app[SESSION] = client
            yield

    app = web.Application()
    app[ROUTER] = router
    app.cleanup_ctx.append(session)
    for path in PATHS:
        app.router.add_post(path, forward)
    app.router.add_get("/kvroute/fleet", fleet)
    return app


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="An aiohttp gateway routing with kvroute.")
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
    web.run_app(create_app(build_router(args)), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
