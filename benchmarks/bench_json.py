"""Request-body parsing in the proxy: ``json`` or orjson, and whether a huge body stalls other requests.

1. Parse time of chat bodies of about 3 KB, 64 KB and 1 MiB (best of 5 repeats of an
   auto-ranged loop): ``json.loads`` of the decoded text (the standard library's parser),
   ``orjson.loads`` and ``msgspec.json.decode`` when installed, and ``loads_body`` (what the
   proxy calls: orjson when installed, with its error mapping).
2. Event-loop stall: a 33 MiB body of one million small messages is POSTed to a running
   proxy while another client polls ``/health`` (answered on the proxy's event loop); the
   slowest ``/health`` answer during that POST shows how long the loop was blocked. Run
   with the body parsed on the loop and in a worker thread (the proxy's choice above 1 MiB).

Run: ``python benchmarks/bench_json.py`` (about 30 s; ``--quick`` skips the stall part).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import timeit
from collections.abc import Callable
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvroute_server.http import asgi
from kvroute_server.proxy import app as app_module

_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "prefixes", "é", "ü", "日本"]


def chat_body(size: int, seed: int = 0) -> bytes:
    """A chat body of about ``size`` bytes: a system prompt, then turns of 60 words."""
    rng = random.Random(seed)
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
    length = 60
    while length < size:
        turn = {"role": "user" if len(messages) % 2 else "assistant", "content": " ".join(rng.choices(_WORDS, k=60))}
        messages.append(turn)
        length += len(json.dumps(turn, ensure_ascii=False).encode())
    return json.dumps(
        {"model": "m", "messages": messages, "max_tokens": 64, "stream": True}, ensure_ascii=False
    ).encode()


def best_us(function: Callable[[], Any]) -> float:
    timer = timeit.Timer(function)
    number, _ = timer.autorange()
    return min(timer.repeat(repeat=5, number=number)) / number * 1e6


def parse_times() -> None:
    parsers: dict[str, Callable[[bytes], Any]] = {"json": lambda raw: json.loads(raw.decode("utf-8"))}
    try:
        import orjson

        parsers["orjson"] = orjson.loads
    except ImportError:
        print("orjson is not installed: its column is missing and loads_body uses json")
    try:
        import msgspec

        parsers["msgspec"] = msgspec.json.decode
    except ImportError:
        pass
    parsers["loads_body"] = asgi.loads_body
    print(f"{'body':>10} " + " ".join(f"{name + ' µs':>14}" for name in parsers) + "   json / loads_body")
    for size in (3 * 1024, 64 * 1024, 1024 * 1024):
        raw = chat_body(size)
        times = {name: best_us(lambda p=parser, r=raw: p(r)) for name, parser in parsers.items()}  # type: ignore[misc]
        cells = " ".join(f"{t:>14.1f}" for t in times.values())
        print(f"{len(raw):>10,} {cells}   x{times['json'] / times['loads_body']:.2f}")


class _StubBackend:
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await asgi.read_body(receive, 1 << 30)
        await asgi.send_json(send, 200, {"object": "list", "data": []} if scope["path"] == "/v1/models" else {})


def stall(threaded: bool) -> tuple[float, float, float]:
    """(seconds the big POST took, slowest /health during it, median /health) in seconds."""
    from kvroute_server import BackendConfig, HealthConfig, ProxyApp, ServerConfig, ServerThread

    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * 1_000_000}).encode()
    saved = app_module._THREAD_PARSE_BYTES
    app_module._THREAD_PARSE_BYTES = saved if threaded else 1 << 62
    backend = ServerThread(_StubBackend()).start()
    config = ServerConfig(
        backends=(BackendConfig(id="b", url=backend.url, models=("m",)),),
        health=HealthConfig(interval=0),
        access_log=False,
        max_body_bytes=64 * 1024 * 1024,
    )
    proxy = ServerThread(ProxyApp(config)).start()
    try:
        latencies: list[float] = []
        done = threading.Event()

        def poll() -> None:
            conn = HTTPConnection("127.0.0.1", proxy.port, timeout=60)
            while not done.is_set():
                start = time.perf_counter()
                conn.request("GET", "/health")
                conn.getresponse().read()
                latencies.append(time.perf_counter() - start)
                time.sleep(0.005)
            conn.close()

        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(0.3)
        latencies.clear()
        conn = HTTPConnection("127.0.0.1", proxy.port, timeout=120)
        start = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=big, headers={"content-type": "application/json"})
        status = conn.getresponse().status
        took = time.perf_counter() - start
        conn.close()
        done.set()
        poller.join()
        assert status == 200, status
        latencies.sort()
        return took, latencies[-1], latencies[len(latencies) // 2]
    finally:
        app_module._THREAD_PARSE_BYTES = saved
        proxy.stop()
        backend.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="parse times only")
    args = parser.parse_args()
    parse_times()
    if args.quick:
        return
    print("\n33 MiB body of 1,000,000 messages; /health polled meanwhile")
    print(f"{'parsed':>10} {'POST s':>8} {'slowest /health ms':>20} {'median /health ms':>19}")
    for threaded in (False, True):
        took, worst, median = stall(threaded)
        print(f"{'thread' if threaded else 'loop':>10} {took:>8.2f} {worst * 1e3:>20.1f} {median * 1e3:>19.2f}")


if __name__ == "__main__":
    main()
