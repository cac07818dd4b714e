"""Several `kvroute serve` replicas over one fleet of engine emulators, with no coordination between them.

* Hash placement is a function of (request, backend ids, weights) only, so two replicas
  receiving interleaved traffic send each prefix to the same engine, the one a third
  process (this test) computes on its own.
* Load bounds: each replica counts only its own requests in flight, so a per-replica
  concurrency threshold T bounds an engine at N x T with N replicas. Counting the engines'
  reported load (``engine_load=true``) makes T mean the same fleet-wide.

The measured agreement rates are printed (``-s``) and recorded in docs/embedding.md.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from kvroute import Backend, Fleet, Router, RouteRequest, Sessions
from tests.replicas.processes import (
    ENGINES,
    Process,
    body,
    engine_load,
    home,
    serve_config,
    start_engines,
    start_replicas,
    until,
)

ADMIN = "replica-test-admin-token"
PREFIXES = 48
ROUNDS = 4


async def replica_metrics(client: httpx.AsyncClient, replica: Process) -> dict[str, float]:
    """The replica's own counters: in flight per backend and spilled requests."""
    text = (await client.get(replica.url + "/metrics")).text
    out: dict[str, float] = {}
    for backend, value in re.findall(r'^kvroute_in_flight\{backend="([^"]+)"\} ([0-9.]+)$', text, re.M):
        out[f"in_flight:{backend}"] = float(value)
    out["spills"] = sum(float(v) for v in re.findall(r"^kvroute_spills_total\{[^}]*\} ([0-9.]+)$", text, re.M))
    return out


async def total_load(
    client: httpx.AsyncClient, engines: list[Process], *, at_least: int = 0, at_most: int | None = None
) -> bool:
    """Whether the engines' summed running + waiting is within [at_least, at_most]."""
    total = sum([await engine_load(client, e) for e in engines])
    return total >= at_least and (at_most is None or total <= at_most)


@pytest.fixture(scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
async def engines(client: httpx.AsyncClient) -> AsyncIterator[list[Process]]:
    started = await start_engines(client, ENGINES, time_scale=0.1)
    try:
        yield started
    finally:
        for engine in started:
            engine.stop()


@contextlib.asynccontextmanager
async def replicas(
    client: httpx.AsyncClient,
    engines: list[Process],
    tmp_path: Path,
    strategy: str,
    options: dict[str, Any],
    *,
    health_interval: float = 1.0,
) -> AsyncIterator[list[Process]]:
    config = serve_config(engines, strategy, options, admin_token=ADMIN, health_interval=health_interval)
    started = await start_replicas(client, config, 2, tmp_path)
    try:
        yield started
    finally:
        for replica in started:
            replica.stop()


async def send(client: httpx.AsyncClient, replica: Process, request_body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    response = await client.post(replica.url + "/v1/chat/completions", json=request_body)
    assert response.status_code == 200, response.text
    return response.headers["x-kvroute-backend"], response.json()


class TestAgreement:
    @pytest.mark.anyio
    @pytest.mark.parametrize("strategy", ["consistent-hash", "bounded-load"])
    async def test_interleaved_traffic_lands_on_one_engine_per_prefix(
        self, strategy: str, client: httpx.AsyncClient, engines: list[Process], tmp_path: Path
    ) -> None:
        """Both replicas send every prefix to the engine this process computes; bounded-load deviates only by its
        spills."""
        async with replicas(client, engines, tmp_path, strategy, {"prefix_length": 1024}) as (a, b):
            chosen: dict[int, list[tuple[str, str]]] = defaultdict(list)
            cached: list[int] = []
            limiter = anyio.CapacityLimiter(8)

            async def one(prefix: int, rnd: int) -> None:
                replica = (a, b)[(prefix + rnd) % 2]
                async with limiter:
                    backend, answer = await send(client, replica, body(prefix, f"round {rnd}: what does clause 3 say?"))
                chosen[prefix].append((replica.name, backend))
                if rnd > 0:
                    cached.append(answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))

            for rnd in range(ROUNDS):
                async with anyio.create_task_group() as tg:
                    for prefix in range(PREFIXES):
                        tg.start_soon(one, prefix, rnd)

            homes = {p: home(body(p, "x")) for p in range(PREFIXES)}
            requests = [(p, name, backend) for p, picks in chosen.items() for name, backend in picks]
            at_home = sum(backend == homes[p] for p, _, backend in requests) / len(requests)
            same_engine = sum(len({backend for _, backend in chosen[p]}) == 1 for p in range(PREFIXES)) / PREFIXES
            spills = (await replica_metrics(client, a))["spills"] + (await replica_metrics(client, b))["spills"]
            print(
                f"\n{strategy}: {len(requests)} requests, at the independently computed home {at_home:.1%}, "
                f"prefixes on one engine across both replicas {same_engine:.1%}, spills {spills:.0f}"
            )
            assert len(requests) == PREFIXES * ROUNDS and {r for _, r, _ in requests} == {a.name, b.name}
            assert set(homes.values()) == {f"e{i}" for i in range(ENGINES)}
            away = sum(backend != homes[p] for p, _, backend in requests)
            if strategy == "consistent-hash":
                assert away == 0
                assert all(c > 0 for c in cached)  # rounds after the first hit the engine's prefix cache
            else:
                assert away <= spills  # only a spilled request may leave its home

    @pytest.mark.anyio
    async def test_agreement_survives_a_drain(
        self, client: httpx.AsyncClient, engines: list[Process], tmp_path: Path
    ) -> None:
        """Draining e1 on both replicas moves only e1's prefixes, and both replicas move them to the same engine."""
        async with replicas(client, engines, tmp_path, "consistent-hash", {"prefix_length": 1024}) as (a, b):
            headers = {"authorization": f"Bearer {ADMIN}"}
            for replica in (a, b):
                response = await client.post(f"{replica.url}/admin/backends/e1/drain", headers=headers, json={})
                assert response.status_code == 202 and response.json()["draining"] is True, response.text
            for prefix in range(PREFIXES):
                request_body = body(prefix, "after the drain")
                got_a, _ = await send(client, a, request_body)
                got_b, _ = await send(client, b, request_body)
                before = home(request_body)
                expected = before if before != "e1" else home(request_body, exclude={"e1"})
                assert got_a == got_b == expected


class TestSessions:
    @pytest.mark.anyio
    async def test_a_session_stays_on_one_engine_across_replicas(
        self, client: httpx.AsyncClient, engines: list[Process], tmp_path: Path
    ) -> None:
        """Turns of one session alternate between replicas yet reach one engine, the one its id hashes to."""
        async with replicas(client, engines, tmp_path, "bounded-load", {}) as (a, b):
            local = Router.create(
                Fleet([Backend(f"e{i}") for i in range(ENGINES)]), "bounded-load", {}, sessions=Sessions()
            )
            chosen: dict[str, set[str]] = defaultdict(set)
            expected: dict[str, str] = {}
            for turn in range(4):
                for s in range(24):
                    session = f"agent-{s}"
                    request_body = body(0, f"{session} turn {turn}")  # one shared preamble for every session
                    if turn == 0:
                        request = RouteRequest.from_openai(request_body, headers={"x-session-id": session})
                        expected[session] = local.decide(request)[0].backend.id
                    response = await client.post(
                        (a, b)[(s + turn) % 2].url + "/v1/chat/completions",
                        json=request_body,
                        headers={"x-session-id": session},
                    )
                    assert response.status_code == 200, response.text
                    chosen[session].add(response.headers["x-kvroute-backend"])
            assert all(chosen[s] == {expected[s]} for s in expected), (chosen, expected)
            assert len(set(expected.values())) == ENGINES  # 24 sessions over 3 engines use every one


class TestLoadBounds:
    @pytest.mark.anyio
    @pytest.mark.parametrize("count_engine_load, home_load", [(False, 4), (True, 2)])
    async def test_concurrency_threshold_with_two_replicas(
        self, count_engine_load: bool, home_load: int, client: httpx.AsyncClient, engines: list[Process], tmp_path: Path
    ) -> None:
        """Threshold 2, one hot prefix, 6 long requests alternating replicas: the hot engine holds 2 x 2 with
        per-replica counting, and 2 when the replicas count the load the engines report."""
        threshold = 2
        options = {
            "prefix_length": 1024,
            "load_factor": "off",
            "concurrency_threshold": threshold,
            "engine_load": count_engine_load,
        }
        # About 18 s of decoding on the emulator at time scale 0.1: long enough to overlap all six, bounded
        # however the emulator treats a closed stream.
        hot = body(7, "stream a long answer", stream=True, max_tokens=12000)
        target = engines[int(home(hot)[1:])]
        async with replicas(client, engines, tmp_path, "bounded-load", options, health_interval=0.1) as pair:
            streams: list[httpx.Response] = []
            async with contextlib.AsyncExitStack() as stack:
                for i in range(6):
                    replica = pair[i % 2]
                    response = await stack.enter_async_context(
                        client.stream("POST", replica.url + "/v1/chat/completions", json=hot)
                    )
                    assert response.status_code == 200
                    streams.append(response)
                    await until(lambda n=i + 1: total_load(client, engines, at_least=n))
                    if count_engine_load:
                        await anyio.sleep(1.0)  # ten health rounds: both replicas have read the engines' /metrics since
                per_engine = {e.name: await engine_load(client, e) for e in engines}
                views = [await replica_metrics(client, r) for r in pair]
                chosen = Counter(s.headers["x-kvroute-backend"] for s in streams)
                print(f"\nengine_load={count_engine_load}: engines report {per_engine}, replicas chose {dict(chosen)}")
                assert per_engine[target.name] == home_load
                assert sum(per_engine.values()) == 6
                for view in views:
                    assert view[f"in_flight:{home(hot)}"] <= threshold  # each replica keeps its own bound

            async def idle() -> bool:
                views = [await replica_metrics(client, r) for r in pair]
                in_flight = sum(v for view in views for k, v in view.items() if k.startswith("in_flight:"))
                return in_flight == 0 and await total_load(client, engines, at_most=0)

            await until(idle, within=90)
