"""CPU per call of the upstream client's parts, without a network.

The proxy's own HTTP/1.1 client runs once per proxied request; this measures its Python parts
one by one on the inputs of the throughput benchmark (benchmarks/bench_vs_sglang.py): a 3.5 KB
chat body, the client headers wrk and the openai SDK send, nginx's response headers and its
fixed 350-byte chat completion (with usage), and its 18-event SSE stream.

* ``filter_request_headers`` / ``filter_response_headers``: the header rules.
* ``UsageSniffer``: a new sniffer fed the whole 350-byte answer (the non-streaming path), and
  the SSE stream fed in 512-byte chunks (the streaming path; chunk cuts are fixed).
* ``cycle``: one whole client round trip through ``UpstreamPool.post`` on a pooled connection
  whose fake transport answers at once from memory: head building, the write call, httptools
  parsing with our callbacks, ``readany``, ``release`` back to the pool. Everything the client
  does per request except the socket's system calls.

Each figure is the best of 7 runs of N calls, in CPU time (``time.process_time``), in µs per
call. ``--baseline REV`` loads the parts' modules (kvroute_server.http.client, .proxy.headers,
.proxy.usage; or the one module that held them, http/upstream.py) as of git revision REV as well and
prints both columns, so that a change is judged within one run (the machine may be shared).

Run: ``python benchmarks/throughput/bench_upstream_parts.py [--baseline REV] [-n N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import kvroute_server.http.client
import kvroute_server.proxy.headers
import kvroute_server.proxy.usage

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_vs_sglang as vs  # noqa: E402  (the engines' bodies, defined once)

#: The modules the measured parts live in, and the one module that held them all before.
SOURCES = tuple(
    f"contrib/server/src/kvroute_server/{name}.py" for name in ("http/client", "proxy/headers", "proxy/usage")
)
OLD_SOURCE = "contrib/server/src/kvroute_server/http/upstream.py"

#: Header lists as uvicorn hands them over (names lower-cased), from wrk and from the openai SDK.
WRK_HEADERS = [(b"host", b"127.0.0.1:8000"), (b"content-length", b"3512"), (b"content-type", b"application/json")]
SDK_HEADERS = [
    (b"host", b"127.0.0.1:8000"),
    (b"accept-encoding", b"gzip, deflate"),
    (b"connection", b"keep-alive"),
    (b"accept", b"application/json"),
    (b"content-type", b"application/json"),
    (b"user-agent", b"OpenAI/Python 1.54.0"),
    (b"x-stainless-lang", b"python"),
    (b"x-stainless-package-version", b"1.54.0"),
    (b"x-stainless-os", b"Linux"),
    (b"x-stainless-arch", b"x64"),
    (b"x-stainless-runtime", b"CPython"),
    (b"x-stainless-runtime-version", b"3.11.7"),
    (b"authorization", b"Bearer sk-bench"),
    (b"x-stainless-async", b"false"),
    (b"x-stainless-retry-count", b"0"),
    (b"content-length", b"3512"),
]
#: nginx's response headers, as httptools reports them (wire case).
NGINX_HEADERS = [
    (b"Server", b"nginx/1.22.1"),
    (b"Date", b"Tue, 01 Dec 2026 23:00:00 GMT"),
    (b"Content-Type", b"application/json"),
    (b"Content-Length", b"350"),
    (b"Connection", b"keep-alive"),
]


def completion() -> bytes:
    """The throughput benchmark's fixed chat completion (about 350 bytes, usage last)."""
    return vs.completion().encode()


def sse_stream() -> bytes:
    """The throughput benchmark's stream: role, 16 token, finish and usage events, then ``[DONE]``."""
    return vs.sse_stream().encode()


def chat_body(seed: int = 16) -> bytes:
    """A chat body of about 3.5 KB: a shared ~2.9 KB system prompt and a question."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(" ".join(words)) < 2800:
        words.append(f"policy{rng.randrange(16)}clause{len(words)}")
    messages = [
        {"role": "system", "content": "You are support agent 3. Follow these rules. " + " ".join(words)},
        {"role": "user", "content": f"Question number {rng.randrange(1024)}: which clause covers refunds?"},
    ]
    return json.dumps({"model": vs.MODEL, "max_tokens": 16, "messages": messages}).encode()


def best_us(fn: Callable[[], object], n: int) -> float:
    """Best of 7 runs of ``n`` calls of ``fn``, in CPU µs per call."""
    best = float("inf")
    for _ in range(7):
        start = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, time.process_time() - start)
    return best / n * 1e6


class _AnsweringTransport:
    """A transport whose ``write`` makes the connection receive a canned answer at once."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.protocol: Any = None

    def write(self, data: bytes) -> None:
        self.protocol.data_received(self.answer)

    def writelines(self, parts: Any) -> None:
        self.protocol.data_received(self.answer)

    def get_extra_info(self, name: str) -> None:
        return None

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


def cycle_us(module: SimpleNamespace, answer: bytes, body: bytes, headers: dict[str, str], n: int) -> float:
    """CPU µs per whole client round trip (post, parse, read, release) on a pooled in-memory connection."""

    async def run() -> float:
        pool = module.UpstreamPool(1.0)
        url = "http://127.0.0.1:9"
        host = pool._target(url).pool
        transport = _AnsweringTransport(answer)
        conn = module._Connection(host)
        transport.protocol = conn
        conn.connection_made(transport)
        host.put(conn)
        best = float("inf")
        for _ in range(7):
            start = time.process_time()
            for _ in range(n):
                response = await pool.post(url, "/v1/chat/completions", body, headers)
                while await response.readany():
                    pass
                response.release()
            best = min(best, time.process_time() - start)
        assert host.idle and host.idle[-1] is conn, "the connection must go back to the pool"
        return best / n * 1e6

    try:
        import uvloop  # the proxy's loop when installed
    except ImportError:
        return asyncio.run(run())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run())


def parts(module: SimpleNamespace, n: int) -> dict[str, Callable[[], float]]:
    """Every part's measurement (µs per call) with ``module`` holding the parts (see `merged`)."""
    whole = completion()
    stream = sse_stream()
    body = chat_body()
    chunks = [stream[i : i + 512] for i in range(0, len(stream), 512)]

    def sniff_whole() -> object:
        sniffer = module.UsageSniffer()
        sniffer.feed(whole)
        assert (sniffer.prompt_tokens, sniffer.cached_tokens) == (700, 640)
        return sniffer

    def sniff_stream() -> object:
        sniffer = module.UsageSniffer()
        for chunk in chunks:
            sniffer.feed(chunk)
        assert sniffer.prompt_tokens == 700
        return sniffer

    def request_headers(raw: list[tuple[bytes, bytes]]) -> Callable[[], object]:
        return lambda: module.filter_request_headers(
            raw, forward_authorization=True, api_key=None, request_id="0d5c8e3a9b7f4e21"
        )

    up = module.filter_request_headers(WRK_HEADERS, forward_authorization=True, api_key=None, request_id="r" * 16)
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"%s: %s\r\n" % pair for pair in NGINX_HEADERS) + b"\r\n"
    sse_headers = [
        (b"Content-Type", b"text/event-stream") if name == b"Content-Type" else (name, value)
        for name, value in NGINX_HEADERS
        if name != b"Content-Length"
    ]
    sse_answer = b"HTTP/1.1 200 OK\r\n" + b"".join(b"%s: %s\r\n" % pair for pair in sse_headers)
    sse_answer += b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(stream), stream)
    return {
        "filter_request_headers (wrk, 3)": lambda: best_us(request_headers(WRK_HEADERS), n),
        "filter_request_headers (openai SDK, 16)": lambda: best_us(request_headers(SDK_HEADERS), n),
        "filter_response_headers (nginx, 5)": lambda: best_us(lambda: module.filter_response_headers(NGINX_HEADERS), n),
        "UsageSniffer, 350 B answer": lambda: best_us(sniff_whole, n),
        f"UsageSniffer, SSE in {len(chunks)} chunks": lambda: best_us(sniff_stream, n),
        "cycle: post..release, 350 B answer": lambda: cycle_us(module, head + whole, body, up, n),
        "cycle: post..release, chunked SSE": lambda: cycle_us(module, sse_answer, body, up, n),
    }


def merged(*modules: ModuleType) -> SimpleNamespace:
    """One namespace with every name of ``modules`` (the parts are measured by name, wherever they live)."""
    names: dict[str, Any] = {}
    for module in modules:
        names.update(vars(module))
    return SimpleNamespace(**names)


def _load(rev: str, source: str) -> ModuleType | None:
    """``source`` as of git revision ``rev``, loaded as a separate module; None when it did not exist then."""
    shown = subprocess.run(["git", "show", f"{rev}:{source}"], cwd=ROOT, capture_output=True)
    if shown.returncode != 0:
        return None
    name = "baseline_" + Path(source).stem
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_bytes(shown.stdout)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_revision(rev: str) -> SimpleNamespace:
    """The parts as of git revision ``rev`` (from their modules, or from upstream.py before they were split)."""
    modules = [_load(rev, source) for source in SOURCES]
    if all(module is not None for module in modules):
        return merged(*(m for m in modules if m is not None))
    old = _load(rev, OLD_SOURCE)
    if old is None:
        raise SystemExit(f"{rev} has neither {SOURCES[0]} nor {OLD_SOURCE}")
    return merged(old)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--baseline", metavar="REV", help="also measure the parts as of this git revision")
    parser.add_argument("-n", type=int, default=20000, help="calls per run (default 20000)")
    args = parser.parse_args()
    columns = {
        "this checkout": merged(kvroute_server.http.client, kvroute_server.proxy.headers, kvroute_server.proxy.usage)
    }
    if args.baseline:
        columns[args.baseline] = load_revision(args.baseline)
    measures = {name: parts(module, args.n) for name, module in columns.items()}
    names = list(columns)
    print(f"µs per call, CPU time, best of 7 x {args.n} (machine may be shared: compare within one run)")
    print(f"{'part':<42}" + "".join(f"{name:>16}" for name in names) + ("   change" if len(names) == 2 else ""))
    for part in measures[names[0]]:
        # The columns are measured in turn part by part, baseline first, so that a drift of
        # the machine's speed during the run hits both alike.
        row = {name: measures[name][part]() for name in reversed(names)}
        line = f"{part:<42}" + "".join(f"{row[name]:>16.2f}" for name in names)
        if len(names) == 2:
            line += f"   {(row[names[0]] - row[names[1]]) / row[names[1]]:+.0%}"
        print(line)


if __name__ == "__main__":
    main()
