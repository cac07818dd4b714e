"""httpx or aiohttp for the proxy's upstream client? Streaming pass-through, measured.

Each candidate is the smallest possible pass-through proxy: a raw ASGI app under uvicorn
(uvloop, httptools) that forwards the request body to one emulator and streams the answer
back chunk by chunk, with one shared keep-alive client. A third row, ``kvroute``, is the
real proxy (``kvroute serve --no-access-log``) on the same setup, so its own cost over the
bare pass-through shows. Same client and method as bench_proxy.py (added latency over
direct, concurrency 1 and 32, streaming and not). Results in docs/performance.md.

Run: ``python benchmarks/bench_http_clients.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_proxy as bp


def aiohttp_app(upstream: str) -> Any:
    import aiohttp

    session: aiohttp.ClientSession | None = None

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            await receive()
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await session.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        assert session is not None
        async with session.post(
            upstream + scope["path"], data=b"".join(chunks), headers={"content-type": "application/json"}
        ) as response:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": [(b"content-type", response.headers["content-type"].encode())],
                }
            )
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def httpx_app(upstream: str) -> Any:
    import httpx

    client: httpx.AsyncClient | None = None

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal client
        if scope["type"] == "lifespan":
            await receive()
            client = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=1000), timeout=None
            )
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await client.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        assert client is not None
        request = client.build_request(
            "POST", upstream + scope["path"], content=b"".join(chunks), headers={"content-type": "application/json"}
        )
        response = await client.send(request, stream=True)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [(b"content-type", response.headers["content-type"].encode())],
                }
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await response.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def serve_candidate(kind: str, port: int, upstream: str) -> None:
    from kvroute_server.http.runner import run_server

    app = aiohttp_app(upstream) if kind == "aiohttp" else httpx_app(upstream)
    run_server(app, "127.0.0.1", port)


@contextlib.contextmanager
def candidate(kind: str, upstream: str) -> Iterator[tuple[str, int]]:
    port = bp.free_port()
    url = f"http://127.0.0.1:{port}"
    if kind == "kvroute":
        args = [
            bp.PYTHON,
            "-m",
            "kvroute",
            "serve",
            "--port",
            str(port),
            "--backend",
            f"e0={upstream}",
            "--no-access-log",
        ]
    else:
        args = [bp.PYTHON, __file__, "--serve", kind, "--port", str(port), "--upstream", upstream]
    with bp.process(args, url + "/health") as proc:
        yield url, proc.pid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", choices=["aiohttp", "httpx"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.serve:
        serve_candidate(args.serve, args.port, args.upstream)
        return
    import uvloop

    uvloop.install()
    count = 200 if args.quick else args.requests
    e_port = bp.free_port()
    direct = f"http://127.0.0.1:{e_port}"
    emulator = [
        bp.PYTHON,
        "-m",
        "kvroute",
        "emulate",
        "--port",
        str(e_port),
        "--model",
        "m",
        "--time-scale",
        "0.0001",
        "--num-gpu-blocks",
        "4096",
    ]
    print(
        f"{'client':<8} {'case':<11} {'added p50':>10} {'added p99':>10} {'1st chunk +p50':>15} "
        f"{'direct rps':>11} {'via rps':>8} {'CPU/req':>9}"
    )
    with bp.process(emulator, direct + "/health"):
        for kind in ("aiohttp", "httpx", "kvroute"):
            with candidate(kind, direct) as (via, pid):
                for stream in (True, False):
                    for concurrency in (1, 32):
                        r = asyncio.run(bp.compare(direct, via, count, concurrency, stream, args.rounds, pid))
                        first = f"{r['added_first_chunk_p50_ms']:.3f} ms" if stream else "-"
                        case = f"{'stream' if stream else 'whole'} c{concurrency}"
                        print(
                            f"{kind:<8} {case:<11} {r['added_p50_ms']:>7.3f} ms {r['added_p99_ms']:>7.3f} ms "
                            f"{first:>15} "
                            f"{r['direct_rps']:>11.0f} {r['proxy_rps']:>8.0f} {r['proxy_cpu_us_per_request']:>6.0f} us",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
