"""Benchmark the in-process overhead of kvroute-litellm in LiteLLM's Router (not a test).

Usage: python benchmarks/bench_litellm.py [--calls N] [--deployments N] [--json FILE]

Every call is ``Router.acompletion(..., mock_response="ok")``: LiteLLM runs its whole
pipeline (pre-routing, the pick, the call wrapper, success callbacks) but sends nothing, so
the difference between two rows is the routing's own cost, without network noise. The
prompt is a chat request of ~4,000 characters (a system prompt, a document, a question).
Rows:

* ``litellm simple-shuffle``: LiteLLM's default routing, no kvroute (the baseline).
* ``kvroute consistent-hash`` / ``kvroute bounded-load``: `kvroute_litellm.install`.
* ``pick only``: ``KvrouteRouting.async_get_available_deployment`` called directly (the
  healthy-deployment query to LiteLLM, the RouteRequest, the lease) with the lease ended at
  once; ``select(kind="healthy")`` alone, the part of it that is LiteLLM's; and
  ``kvroute's own part``: the fleet sync, RouteRequest, strategy pick and lease on a given
  healthy list, plus ending the lease.

Rows take turns in blocks of 50 calls so that a busy machine's slow phases hit every row.

Prints medians and p99 per call in microseconds. Calls run one at a time (the overhead per
call, not throughput); LiteLLM's success callbacks run in the background and are drained
between rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the price list

import kvroute_litellm
import litellm
import structlog

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # fleet events at info would flood stdout

DOCUMENT = "".join(f"Paragraph {i}: routers that remember which server saw a prefix save prefill. " for i in range(48))


def model_list(count: int) -> list[dict[str, Any]]:
    return [
        {
            "model_name": "m",
            "litellm_params": {"model": "openai/m", "api_base": f"http://127.0.0.1:{9 + i}/v1", "api_key": "unused"},
            "model_info": {"id": f"d{i}"},
        }
        for i in range(count)
    ]


def messages(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"You answer questions about document {i % 64}."},
        {"role": "user", "content": f"{DOCUMENT}\nQuestion {i}: what does paragraph {i % 48} say?"},
    ]


async def drain(routings: list[kvroute_litellm.KvrouteRouting]) -> None:
    """Wait until LiteLLM's background success callbacks have ended every lease."""
    for _ in range(200):
        if all(r.open_leases() == 0 for r in routings):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("some leases were not ended by LiteLLM's callbacks")


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_us": statistics.median(ordered),
        "p99_us": ordered[int(0.99 * (len(ordered) - 1))],
        "mean_us": statistics.fmean(ordered),
    }


async def run(calls: int, deployments: int, block: int = 50) -> dict[str, dict[str, float]]:
    rows: dict[str, Callable[[int], Awaitable[object]]] = {}
    routings: list[kvroute_litellm.KvrouteRouting] = []

    baseline = litellm.Router(model_list=model_list(deployments))
    rows["litellm simple-shuffle"] = lambda i: baseline.acompletion(model="m", messages=messages(i), mock_response="ok")
    for strategy in ("consistent-hash", "bounded-load"):
        router = litellm.Router(model_list=model_list(deployments))
        routing = kvroute_litellm.install(router, strategy, {"prefix_length": 2048})
        routings.append(routing)
        rows[f"kvroute {strategy}"] = lambda i, r=router: r.acompletion(
            model="m", messages=messages(i), mock_response="ok"
        )

        async def pick_only(i: int, routing: kvroute_litellm.KvrouteRouting = routing) -> None:
            kwargs: dict[str, Any] = {"metadata": {}}
            await routing.async_get_available_deployment("m", messages(i), request_kwargs=kwargs)
            routing.finish({"litellm_params": {"metadata": kwargs["metadata"]}}, ok=True)

        healthy = model_list(deployments)

        async def own_work(
            i: int, routing: kvroute_litellm.KvrouteRouting = routing, healthy: list[dict[str, Any]] = healthy
        ) -> None:
            kwargs: dict[str, Any] = {"metadata": {}}
            routing._choose("m", messages(i), None, kwargs, healthy)
            routing.finish({"litellm_params": {"metadata": kwargs["metadata"]}}, ok=True)

        rows[f"pick only ({strategy})"] = pick_only
        rows[f"kvroute's own part ({strategy})"] = own_work
    healthy_only = litellm.Router(model_list=model_list(deployments))
    rows["select(kind='healthy') alone"] = lambda i: healthy_only.select(
        "m", {"metadata": {}}, kind="healthy", messages=messages(i)
    )

    for one in rows.values():  # warm caches and LiteLLM's lazy imports
        for i in range(50):
            await one(i)
    await drain(routings)
    # Rows take turns in blocks, so that a slow phase of a busy machine hits every row alike.
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for start in range(0, calls, block):
        for name, one in rows.items():
            for i in range(start, min(start + block, calls)):
                t0 = time.perf_counter()
                await one(i)
                samples[name].append((time.perf_counter() - t0) * 1e6)
        await drain(routings)
    for routing in routings:
        routing.uninstall()
    return {name: summary(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--deployments", type=int, default=4)
    parser.add_argument("--json", dest="json_file")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args.calls, args.deployments))
    base = results["litellm simple-shuffle"]["p50_us"]
    from importlib.metadata import version

    print(
        f"litellm {version('litellm')}, {args.deployments} deployments, {args.calls} calls per row, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'row':36} {'p50 µs':>10} {'p99 µs':>10} {'p50 - baseline':>15}")
    for name, row in results.items():
        delta = f"{row['p50_us'] - base:+.0f}" if name.startswith("kvroute ") else ""
        print(f"{name:36} {row['p50_us']:10.0f} {row['p99_us']:10.0f} {delta:>15}")
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(results, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
