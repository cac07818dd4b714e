"""Sum a py-spy ``raw`` profile (collapsed stacks) of ``kvroute serve`` into the parts of a request.

Each sample goes to the part of its innermost frame that matches one (searching from the leaf
outwards), so that a socket write made by uvicorn counts as "client I/O" and one made by aiohttp
as "upstream client". Samples in no part (the event loop's own C code) are "event loop".

Run: ``python benchmarks/throughput/profile_summary.py PROFILE.txt [...]`` (one column each).
"""

from __future__ import annotations

import sys
from collections import Counter

#: (part, substrings of a frame "function (file:line)"), tried in this order for each frame.
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("logging (structlog)", ("structlog/", "kvroute/logs.py", "ProxyApp._finish")),
    ("metrics (prometheus-client)", ("prometheus_client/", "kvroute_server/ops/metrics.py")),
    ("JSON parse", ("loads_body", "orjson")),
    ("routing (RouteRequest, router, strategy)", ("kvroute/", "kvroute_bounded_load/", "kvroute_tokenizer_prefix/")),
    # uvicorn's writes went through _CoalescingTransport (runner.py); kvroute's protocol writes in these two.
    ("client I/O: response writes", ("_CoalescingTransport", "runner.py", "HttpProtocol._finish", "_flush_head")),
    (
        "upstream client (aiohttp, or kvroute's UpstreamPool)",
        ("aiohttp/", "yarl/", "multidict/", "UpstreamPool", "_Connection.", "UpstreamResponse.", "_HostPool."),
    ),
    (
        "HTTP server and ASGI (uvicorn, kvroute_server.http.protocol)",
        (
            "uvicorn/",
            "httptools",
            "granian/",
            "kvroute_server/http/protocol.py",
            "kvroute_server/http/reader.py",
            "kvroute_server/http/response.py",
            "kvroute_server/http/cycle.py",
        ),
    ),
    (
        "forwarding (headers, relay, retries)",
        (
            "kvroute_server/proxy/forwarding.py",
            "kvroute_server/http/client.py",
            "kvroute_server/proxy/headers.py",
            "kvroute_server/proxy/usage.py",
        ),
    ),
    ("app (dispatch, body read, request id)", ("kvroute_server/proxy/app.py", "kvroute_server/http/asgi.py")),
    ("event loop (uvloop) and asyncio (tasks, timeouts)", ("asyncio/", "uvloop/")),
)
#: Frames below every request (the process's entry point), never a part.
SKIP = ("kvroute/__main__.py", "click/", "runpy", "kvroute_server/cli.py", "kvroute_server/ops/workers.py")
OTHER = "the rest"


def summarize(path: str) -> Counter[str]:
    """Samples per part in one py-spy raw file."""
    parts: Counter[str] = Counter()
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            frames = stack.split(";")
            part = OTHER
            for frame in reversed(frames):
                if any(skip in frame for skip in SKIP):
                    continue
                hit = next((name for name, needles in PARTS if any(n in frame for n in needles)), None)
                if hit is not None:
                    part = hit
                    break
            parts[part] += int(count)
    return parts


def main() -> None:
    files = sys.argv[1:]
    columns = [summarize(path) for path in files]
    names = [name for name, _ in PARTS] + [OTHER]
    print("| part | " + " | ".join(files) + " |")
    print("|---|" + "---|" * len(files))
    for name in names:
        cells = [f"{c[name] / max(sum(c.values()), 1):.1%}" for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| samples | " + " | ".join(str(sum(c.values())) for c in columns) + " |")


if __name__ == "__main__":
    main()
