"""CPU per call of the parts of one proxied request that the router, the metrics and the access log own.

What a proxied request costs in CPU is mostly these parts. A whole-proxy load test mixes them with
the HTTP server, the upstream client and the event loop; this script times them alone, so a
change to one of them can be measured in isolation (run it before and after, e.g. with the
changed files stashed). Nothing touches the network.

Parts (microseconds of process CPU per call, best of ``--repeat`` runs of ``--calls`` calls):

* ``router``: a fleet of 4 backends and ``bounded-load``; requests are chat bodies of about
  3 KB over 16 shared system prompts (seeded). ``strategy.pick`` alone is the reference the
  router adds to; then `Router.decide`, `Router.acquire` + `Router.release`, and a whole
  ``with`` / ``async with router.route(...)`` block (the proxy uses ``async with``). Last, the
  router's own cost: a ``with`` block whose strategy returns the first candidate at once.
* ``metrics``: `ProxyMetrics` as one process builds it: ``observe_decision``, ``request_done``,
  and the updates one proxied request makes (those two and the usage token counters).
* ``metrics, shared``: the same with ``shared=True`` (``kvroute serve --workers N``), in a child
  process whose prometheus-client writes to a temporary ``PROMETHEUS_MULTIPROC_DIR``; adds the
  in-flight gauges (the backend's and the worker's, an inc and a dec each per request).
* ``access log``: one access line with the fields ``kvroute_server.proxy.app._access_line`` passes,
  through the processors `kvroute.cli.configure_logging` configures for ``--log-format json``,
  written to /dev/null; with and without the ``worker`` processor that ``kvroute serve
  --workers N`` adds, and with structlog's filtering bound logger and kvroute's leaner one.

Run: ``python benchmarks/throughput/bench_request_parts.py`` (about 30 s; ``--only router,log``
for some parts). The machine is usually shared: compare rows within one run, or runs made
back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, MutableMapping
from typing import Any

PARTS = ("router", "metrics", "shared", "log")
#: The text of a worker's rows, read back by the parent from the child's stdout.
_CHILD_FLAG = "--shared-child"

#: One measured row: part, what was timed, microseconds per call.
Row = tuple[str, str, float]


def best_us(loop: Callable[[int], object], calls: int, repeat: int) -> float:
    """Microseconds of process CPU per call: the best of ``repeat`` runs of ``loop(calls)``."""
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        started = time.process_time()
        loop(calls)
        best = min(best, time.process_time() - started)
    return best / calls * 1e6


def chat_bodies(count: int, seed: int = 16) -> list[dict[str, Any]]:
    """Chat bodies of about 3 KB: one of 16 system prompts, then user text (the throughput benchmarks' load)."""
    rng = random.Random(seed)
    words = ["cache", "prefix", "route", "engine", "token", "block", "the", "a", "of", "request"]
    systems = [" ".join(rng.choices(words, k=300)) for _ in range(16)]
    return [
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": systems[i % 16]},
                {"role": "user", "content": " ".join(rng.choices(words, k=120))},
            ],
            "max_tokens": 16,
        }
        for i in range(count)
    ]


class _First:
    """A strategy that costs almost nothing: the first candidate, as a `Decision` (what strategies return)."""

    def pick(self, request: Any, candidates: Any) -> Any:
        from kvroute import Decision

        return Decision(candidates[0].backend, reason="first")


def router_rows(calls: int, repeat: int) -> list[Row]:
    import structlog

    from kvroute import Backend, Fleet, Router, RouteRequest

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # fleet events stay quiet
    fleet = Fleet([Backend(f"e{i}", f"http://127.0.0.1:{9000 + i}") for i in range(4)])
    router = Router.create(fleet, "bounded-load")
    requests = [RouteRequest.from_openai(body, request_id=f"r{i}") for i, body in enumerate(chat_bodies(64))]
    strategy, candidates = router.strategy, fleet.candidates("m")
    # The router's own cost: a strategy whose pick is a Decision for the first candidate.
    bare = Router(Fleet([Backend(f"e{i}") for i in range(4)]), _First(), strategy_name="first")

    def pick(n: int) -> None:
        for i in range(n):
            strategy.pick(requests[i & 63], candidates)

    def decide(n: int) -> None:
        for i in range(n):
            router.decide(requests[i & 63])

    def acquire_release(n: int) -> None:
        for i in range(n):
            router.release(router.acquire(requests[i & 63]))

    def with_route(n: int) -> None:
        for i in range(n):
            with router.route(requests[i & 63]):
                pass

    async def routes(n: int) -> None:
        for i in range(n):
            async with router.route(requests[i & 63]):
                pass

    def own_cost(n: int) -> None:
        for i in range(n):
            with bare.route(requests[i & 63]):
                pass

    loop = asyncio.new_event_loop()
    try:
        return [
            ("router", "strategy.pick (bounded-load, reference)", best_us(pick, calls, repeat)),
            ("router", "Router.decide", best_us(decide, calls, repeat)),
            ("router", "Router.acquire + Router.release", best_us(acquire_release, calls, repeat)),
            ("router", "with router.route(...)", best_us(with_route, calls, repeat)),
            (
                "router",
                "async with router.route(...)",
                best_us(lambda n: loop.run_until_complete(routes(n)), calls, repeat),
            ),
            ("router", "with route(...), a strategy costing ~nothing", best_us(own_cost, calls, repeat)),
        ]
    finally:
        loop.close()


def metrics_rows(calls: int, repeat: int, *, shared: bool) -> list[Row]:
    from kvroute import Backend, Fleet
    from kvroute_server.ops.metrics import ProxyMetrics

    part = "metrics, shared" if shared else "metrics"
    fleet = Fleet([Backend(f"e{i}", f"http://127.0.0.1:{9000 + i}") for i in range(4)])
    metrics = ProxyMetrics(fleet, "bounded-load", shared=shared, worker="0")
    backends = [f"e{i}" for i in range(4)]

    def observe_decision(n: int) -> None:
        for _ in range(n):
            metrics.observe_decision(7e-6)

    def request_done(n: int) -> None:
        for i in range(n):
            metrics.request_done(backends[i & 3], "ok", 0.0031)

    def one_request(n: int) -> None:
        # The updates of one proxied, non-streamed request that succeeds on its first attempt.
        for i in range(n):
            backend = backends[i & 3]
            if shared:
                metrics.worker_in_flight_child.inc()
                gauge = metrics.in_flight_child(backend)
                gauge.inc()
            metrics.observe_decision(7e-6)
            metrics.child(metrics.prompt_tokens, backend).inc(700)
            metrics.child(metrics.cached_tokens, backend).inc(512)
            if shared:
                gauge.dec()
                metrics.worker_in_flight_child.dec()
            metrics.request_done(backend, "ok", 0.0031)

    rows = [
        (part, "ProxyMetrics.observe_decision", best_us(observe_decision, calls, repeat)),
        (part, "ProxyMetrics.request_done", best_us(request_done, calls, repeat)),
    ]
    if shared:

        def in_flight(n: int) -> None:
            for i in range(n):
                gauge = metrics.in_flight_child(backends[i & 3])
                gauge.inc()
                gauge.dec()

        def worker_in_flight(n: int) -> None:
            gauge = metrics.worker_in_flight_child
            for _ in range(n):
                gauge.inc()
                gauge.dec()

        rows.append((part, "backend in-flight gauge inc + dec", best_us(in_flight, calls, repeat)))
        rows.append((part, "worker in-flight gauge inc + dec", best_us(worker_in_flight, calls, repeat)))
    rows.append((part, "one request's updates", best_us(one_request, calls, repeat)))
    return rows


def shared_rows(calls: int, repeat: int) -> list[Row]:
    """Run the shared-metrics part in a child process: prometheus-client reads its directory on import."""
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-prom-") as directory:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": directory}
        args = [sys.executable, __file__, _CHILD_FLAG, "--calls", str(calls), "--repeat", str(repeat)]
        done = subprocess.run(args, env=env, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"the shared-metrics child failed (exit {done.returncode}):\n{done.stderr}")
    return [tuple(row) for row in json.loads(done.stdout)]  # type: ignore[misc]


def log_rows(calls: int, repeat: int) -> list[Row]:
    import structlog

    import kvroute.logs
    from kvroute.cli import configure_logging

    saved = sys.stderr
    sink = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - closed below, after every row
    sys.stderr = sink  # configure_logging's logger factory writes to sys.stderr as it is then
    try:
        configure_logging("info", "json")
        cli_processors = structlog.get_config()["processors"]

        def add_worker(logger: Any, name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
            event.setdefault("worker", 0)  # as kvroute_server.ops.workers.worker_main adds it
            return event

        wrappers = [("structlog's filtering logger", structlog.make_filtering_bound_logger(logging.INFO))]
        # Absent from older checkouts, which a before/after run may time.
        lean = getattr(kvroute.logs, "filtering_bound_logger", None)
        if lean is not None:
            wrappers.append(("kvroute.logs.filtering_bound_logger", lean(logging.INFO)))
        rows: list[Row] = []
        for label, wrapper in wrappers:
            for worker, processors in (("", cli_processors), (" + worker", [add_worker, *cli_processors])):
                structlog.configure(processors=processors, wrapper_class=wrapper)
                lines = access_line_loop(structlog.get_logger(f"bench.access.{len(rows)}"))
                rows.append(("access log", f"json{worker}, {label}", best_us(lines, calls, repeat)))
        return rows
    finally:
        sys.stderr = saved
        sink.close()


def access_line_loop(log: Any) -> Callable[[int], None]:
    """A loop writing ``n`` access lines with the fields and value types `_access_line` passes."""

    def lines(n: int) -> None:
        for i in range(n):
            log.info(
                "request",
                request_id="5f0c6a1e9b7d4c2a8e3f1b0d6c9a7e21",
                model="m",
                strategy="bounded-load",
                backend="e1",
                reason="hash",
                key="9c1f0e6d2b3a4857",
                spilled=False,
                status=200,
                outcome="ok",
                attempts=1,
                stream=False,
                ttft_s=None,
                duration_s=round(0.0031 + i * 1e-9, 6),
                error=None,
            )

    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000, help="calls per run (default 20000)")
    parser.add_argument("--repeat", type=int, default=7, help="runs per row; the best counts (default 7)")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of: {', '.join(PARTS)}")
    parser.add_argument(_CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shared_child:
        print(json.dumps(metrics_rows(args.calls, args.repeat, shared=True)))
        return
    only = [part.strip() for part in args.only.split(",") if part.strip()]
    unknown = sorted(set(only) - set(PARTS))
    if unknown:
        parser.error(f"--only takes parts of {', '.join(PARTS)} (got {', '.join(unknown)})")
    makers: dict[str, Callable[[], list[Row]]] = {
        "router": lambda: router_rows(args.calls, args.repeat),
        "metrics": lambda: metrics_rows(args.calls, args.repeat, shared=False),
        "shared": lambda: shared_rows(args.calls, args.repeat),
        "log": lambda: log_rows(args.calls, args.repeat),
    }
    print(f"µs of process CPU per call, best of {args.repeat} x {args.calls} calls (python {sys.version.split()[0]})")
    print(f"{'part':<16} {'what':<54} {'µs/call':>8}")
    for part in only:
        for name, what, us in makers[part]():
            print(f"{name:<16} {what:<54} {us:8.2f}")


if __name__ == "__main__":
    main()
