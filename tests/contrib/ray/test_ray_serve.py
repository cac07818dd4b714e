"""kvroute_ray in a real local Ray Serve: routers compared on emulated engines, a replica killed, a scale-out.

Each application is 4 replicas of `engine_app.EmulatedEngine` (the simulator's engine model: prefix
cache, LRU eviction, prefill cost) called through a deployment handle, whose request router runs in
this process. Hit rate and TTFT come from the replicas' own answers (cached tokens, first-token time
in engine time). Timing is reported, never asserted; the assertions are on counts.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import ray
from kvroute_ray import KvrouteRequestRouter, request_router_config
from kvroute_ray.registry import routers
from ray import serve
from ray.serve.config import RequestRouterConfig

from kvroute.testing.measure import Movement, Tolerance
from tests.contrib.ray.engine_app import CAPACITY_BLOCKS, EmulatedEngine, arrival_gaps, workload

pytestmark = pytest.mark.usefixtures("serve_cluster")

#: Requests per router and their mean arrival rate (per second) in the comparison.
REQUESTS = 240
RATE = 30.0

PREFIX_AFFINITY = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"


def router_configs() -> dict[str, RequestRouterConfig]:
    return {
        "kvroute bounded-load": request_router_config("bounded-load"),
        "kvroute tokenizer-prefix": request_router_config(
            "tokenizer-prefix", {"capacity_blocks": CAPACITY_BLOCKS, "block_size": 16}
        ),
        "Ray PrefixCacheAffinityRouter (defaults)": RequestRouterConfig(request_router_class=PREFIX_AFFINITY),
        "Ray PrefixCacheAffinityRouter (imbalanced_threshold=8)": RequestRouterConfig(
            request_router_class=PREFIX_AFFINITY, request_router_kwargs={"imbalanced_threshold": 8}
        ),
        "Ray default (power of two)": RequestRouterConfig(),
    }


async def drive(handle: Any, requests: Sequence[Any], gaps: Sequence[float], on_sent: Any = None) -> list[Any]:
    """Send ``requests`` with the given gaps between them; answers (or exceptions) in order."""

    async def one(request: Any) -> Any:
        return await handle.remote(request)

    tasks = []
    for n, (request, gap) in enumerate(zip(requests, gaps, strict=True)):
        tasks.append(asyncio.ensure_future(one(request)))
        if on_sent is not None:
            on_sent(n)
        await asyncio.sleep(gap)
    return await asyncio.gather(*tasks, return_exceptions=True)


def summary(answers: Sequence[dict[str, Any]]) -> dict[str, float]:
    ttft = sorted(a["ttft_ms"] for a in answers)
    return {
        "hit_rate": sum(a["cached_tokens"] for a in answers) / sum(a["prompt_tokens"] for a in answers),
        "ttft_p50": ttft[len(ttft) // 2],
        "ttft_p99": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))],
        "busiest_share": max(Counter(a["replica"] for a in answers).values()) / len(answers),
    }


def router_of(app: str) -> KvrouteRequestRouter:
    """This process's kvroute router for the application's deployment."""
    found = routers(app)
    assert found, f"no kvroute router for {app!r} in this process"
    router: KvrouteRequestRouter = found[-1]
    return router


class TestRouterComparison:
    def test_prefix_routers_against_ray_routers(self, capsys: pytest.CaptureFixture[str]) -> None:
        """On the same seeded workload, kvroute's prefix routers get a far higher hit rate than Ray's default router."""
        requests = workload(REQUESTS)
        gaps = arrival_gaps(REQUESTS, RATE)
        results: dict[str, dict[str, float]] = {}
        for n, (name, config) in enumerate(router_configs().items()):
            app = f"compare-{n}"
            handle = serve.run(EmulatedEngine.options(request_router_config=config).bind(), name=app)
            try:
                answers = asyncio.run(drive(handle, requests, gaps))
            finally:
                serve.delete(app)
            errors = [a for a in answers if not isinstance(a, dict)]
            assert not errors, f"{name}: {len(errors)} requests failed, first: {errors[0]!r}"
            results[name] = summary(answers)
        with capsys.disabled():
            print(f"\n{REQUESTS} requests at {RATE:.0f}/s, 4 replicas of {CAPACITY_BLOCKS} blocks (engine time):")
            print("| router | hit rate | TTFT p50 (ms) | TTFT p99 (ms) | busiest replica's share |")
            print("|---|---:|---:|---:|---:|")
            for name, r in results.items():
                print(
                    f"| {name} | {r['hit_rate']:.3f} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} "
                    f"| {r['busiest_share']:.2f} |"
                )
        default = results["Ray default (power of two)"]["hit_rate"]
        assert results["kvroute bounded-load"]["hit_rate"] > default + 0.2
        assert results["kvroute tokenizer-prefix"]["hit_rate"] > default + 0.2


class TestScaleOutAndParsing:
    def test_scale_out_four_to_five_and_unparsed_bodies(self, capsys: pytest.CaptureFixture[str]) -> None:
        """4 -> 5 replicas moves keys only onto the new one (about a fifth); unreadable bodies still route."""
        app = "scale"
        config = request_router_config("bounded-load")
        # A fixed deployment version makes the second serve.run a scale-out (Serve keeps the 4 replicas);
        # without one, serve.run from Python stamps a random version and replaces every replica.
        pinned: dict[str, Any] = {"request_router_config": config, "version": "scale-test", "_internal": True}
        handle = serve.run(EmulatedEngine.options(**pinned).bind(), name=app)
        keys = [{"model": "emulated", "prompt": f"session {n} " + "context " * 20, "max_tokens": 1} for n in range(300)]

        async def assign() -> tuple[str, ...]:
            answers = []
            for start in range(0, len(keys), 4):  # a few at a time: no replica near its load cap
                answers.extend(await asyncio.gather(*(handle.remote(k) for k in keys[start : start + 4])))
            return tuple(a["replica"] for a in answers)

        try:
            before = asyncio.run(assign())
            assert len(set(before)) == 4
            odd = [b"\x00\xff not a body", 12345, {"model": "emulated"}]

            async def send_odd() -> list[Any]:
                return list(await asyncio.gather(*(handle.remote(o) for o in odd)))

            answers = asyncio.run(asyncio.wait_for(send_odd(), 60))
            assert all(a["unparsed"] for a in answers)
            assert router_of(app).stats.unparsed == len(odd)

            # Keep the first handle and its router, which follow the scale-out (on Ray 2.55 the handle a
            # second serve.run returns has a new router that may route before it knows every replica).
            router = router_of(app)
            serve.run(EmulatedEngine.options(num_replicas=5, **pinned).bind(), name=app)
            deadline = time.monotonic() + 60
            while len(router.fleet) < 5 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert len(router.fleet) == 5
            after = asyncio.run(assign())
        finally:
            serve.delete(app)
        if not set(after) & set(before):  # Ray 2.55's Serve replaces every replica on this serve.run
            pytest.skip("this Ray version replaced all 4 replicas instead of adding one: no scale-out to measure")
        (new,) = set(after) - set(before)
        movement = Movement(before, after)
        assert set(movement.destinations()) == {new}, (movement.destinations(), router.stats)
        assert Tolerance().allows(movement.fraction, 0.2, len(keys)), movement.fraction
        with capsys.disabled():
            print(f"\nscale-out 4 -> 5: {movement.fraction:.3f} of {len(keys)} keys moved, all to the new replica")


class TestReplicaKilled:
    def test_killed_replica_loses_only_its_own_requests(self, capsys: pytest.CaptureFixture[str]) -> None:
        """A replica killed mid-run fails only requests Ray itself loses (actor died); the rest go to the others."""
        app = "kill"
        handle = serve.run(
            EmulatedEngine.options(request_router_config=request_router_config("bounded-load")).bind(), name=app
        )
        requests = workload(REQUESTS, seed=21)
        gaps = arrival_gaps(REQUESTS, RATE, seed=22)
        replicas = {
            a["name"].rsplit("#", 1)[-1]: a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#")
        }
        assert len(replicas) == 4
        killed: list[str] = []

        def kill(n: int) -> None:
            """Halfway through, kill the replica with the most requests in flight (as this router counts them)."""
            if n == REQUESTS // 2:
                busiest = max(router_of(app).fleet, key=lambda state: state.in_flight).id
                actor = replicas[busiest]
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
                killed.append(busiest)

        try:
            answers = asyncio.run(drive(handle, requests, gaps, on_sent=kill))
            router = router_of(app)
        finally:
            serve.delete(app)
        assert killed
        victim_id = killed[0]
        failures = [a for a in answers if not isinstance(a, dict)]
        assert all(isinstance(f, ray.exceptions.RayActorError) for f in failures), failures[:3]
        assert len(failures) <= 64  # at most what the victim could hold (max_ongoing_requests)
        late = answers[-REQUESTS // 4 :]
        assert all(isinstance(a, dict) and a["replica"] != victim_id for a in late)
        assert victim_id not in router.fleet
        with capsys.disabled():
            print(
                f"\nbusiest replica killed at request {REQUESTS // 2}: {len(failures)} of {REQUESTS} lost (actor died)"
            )
