"""`kvroute serve --workers 2` as a process over three `kvroute emulate` engines.

Every request uses a new connection, so the kernel spreads them over both workers. The
tests check what a single process guarantees: each prefix on its independently computed
home, one /metrics view (totals equal to what was sent, in-flight gauges summed over the
workers), an admin drain that reaches every worker, a killed worker restarted with the same
fleet, and no worker left behind when the supervisor stops (gracefully or SIGKILLed).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.replicas.processes import (
    KVROUTE,
    Process,
    Sample,
    body,
    free_port,
    gone,
    home,
    parent_pid,
    samples,
    serve_config,
    start_engines,
    total,
    until,
)

ADMIN = "workers-test-admin-token"
AUTH = {"authorization": f"Bearer {ADMIN}"}
WORKERS = 2


@pytest.fixture(scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """A client that opens a new connection for every request."""
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        yield c


@pytest.fixture(scope="module")
async def engines(client: httpx.AsyncClient) -> AsyncIterator[list[Process]]:
    # Time scale 1: a held stream of 4,000 tokens decodes for about a minute at little CPU cost.
    started = await start_engines(client, 3, time_scale=1.0)
    try:
        yield started
    finally:
        for engine in started:
            engine.stop()


def worker_pids(found: list[Sample]) -> dict[str, int]:
    """Worker index -> pid of the live worker processes, from ``kvroute_worker_up``."""
    return {labels["worker"]: int(labels["pid"]) for name, labels, _ in found if name == "kvroute_worker_up"}


def run_dir(server: Process) -> Path:
    """The supervisor's run directory, from its ``workers_starting`` log line."""
    for line in server.output().splitlines():
        if '"workers_starting"' in line:
            return Path(json.loads(line)["run_dir"])
    raise AssertionError(f"no workers_starting line in the supervisor's log:\n{server.output()}")


@contextlib.asynccontextmanager
async def supervisor(client: httpx.AsyncClient, engines: list[Process], tmp_path: Path) -> AsyncIterator[Process]:
    """`kvroute serve --workers 2` (consistent-hash) in front of the engines; stopped by its pid."""
    config = tmp_path / "kvroute.toml"
    config.write_text(
        serve_config(engines, "consistent-hash", {"prefix_length": 1024}, admin_token=ADMIN, health_interval=1.0)
    )
    port = free_port()
    args = [
        *KVROUTE,
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
        "--workers",
        str(WORKERS),
        "--log-level",
        "info",
    ]
    server = Process("supervisor", args, port)
    pids: dict[str, int] = {}
    try:
        await server.ready(client, "/health")
        await until(lambda: _both_up(client, server))
        pids = worker_pids(await samples(client, server.url))
        yield server
    finally:
        server.stop()
        for pid in pids.values():  # the supervisor's own children only, and only if still its workers
            if not gone(pid) and parent_pid(pid) == server.popen.pid:
                os.kill(pid, signal.SIGKILL)


async def _both_up(client: httpx.AsyncClient, server: Process) -> bool:
    return len(worker_pids(await samples(client, server.url))) == WORKERS


async def send_all(client: httpx.AsyncClient, server: Process, bodies: list[dict[str, Any]]) -> list[str]:
    """Send every body (8 at a time, each on a new connection); returns the chosen backend per body."""
    chosen: list[str] = [""] * len(bodies)
    limiter = anyio.CapacityLimiter(8)

    async def one(i: int) -> None:
        async with limiter:
            response = await client.post(server.url + "/v1/chat/completions", json=bodies[i])
        assert response.status_code == 200, response.text
        chosen[i] = response.headers["x-kvroute-backend"]

    async with anyio.create_task_group() as tg:
        for i in range(len(bodies)):
            tg.start_soon(one, i)
    return chosen


def per_worker(found: list[Sample], name: str) -> dict[str, float]:
    return {labels["worker"]: value for n, labels, value in found if n == name}


class TestOneServer:
    @pytest.mark.anyio
    async def test_prefixes_land_on_their_home_and_totals_add_up(
        self, client: httpx.AsyncClient, engines: list[Process], tmp_path: Path
    ) -> None:
        """96 requests over new connections: each on its home, both workers served, /metrics totals equal what was
        sent."""
        async with supervisor(client, engines, tmp_path) as server:
            bodies = [body(p, f"round {r}") for r in range(2) for p in range(48)]
            chosen = await send_all(client, server, bodies)
            assert chosen == [home(b) for b in bodies]
            found = await samples(client, server.url)
            served = per_worker(found, "kvroute_worker_requests_total")
            print(f"\nrequests per worker: {served}")
            assert set(served) == {"0", "1"} and all(v > 0 for v in served.values())
            assert sum(served.values()) == len(bodies)
            assert (
                total(found, "kvroute_requests_total")
                == total(found, "kvroute_requests_total", outcome="ok")
                == len(bodies)
            )
            by_backend = Counter(chosen)
            for backend, count in by_backend.items():
                assert total(found, "kvroute_requests_total", backend=backend) == count

    @pytest.mark.anyio
    async def test_in_flight_gauges_sum_over_workers(
        self, client: httpx.AsyncClient, engines: list[Process], tmp_path: Path
    ) -> None:
        """Streams held open on both workers: every scrape shows their sum per backend and per worker; then 0."""
        async with supervisor(client, engines, tmp_path) as server:
            async with contextlib.AsyncExitStack() as stack:
                held: list[str] = []
                workers: dict[str, float] = {}
                for i in range(12):  # until both workers hold at least one stream
                    request = body(100 + i, "a long answer", stream=True, max_tokens=4000)
                    url = server.url + "/v1/chat/completions"
                    response = await stack.enter_async_context(client.stream("POST", url, json=request))
                    assert response.status_code == 200
                    held.append(response.headers["x-kvroute-backend"])
                    workers = per_worker(await samples(client, server.url), "kvroute_worker_in_flight")
                    if len(held) >= 3 and all(workers.get(w, 0) > 0 for w in ("0", "1")):
                        break
                print(f"\nheld streams per backend {dict(Counter(held))}, per worker {workers}")
                assert all(workers.get(w, 0) > 0 for w in ("0", "1"))
                for _ in range(6):  # each scrape is answered by either worker: all show the merged values
                    found = await samples(client, server.url)
                    assert total(found, "kvroute_worker_in_flight") == len(held)
                    for backend in ("e0", "e1", "e2"):
                        assert total(found, "kvroute_in_flight", backend=backend) == held.count(backend)

            async def idle() -> bool:  # the streams are closed: the workers cancel them upstream
                return total(await samples(client, server.url), "kvroute_in_flight") == 0

            await until(idle)

    @pytest.mark.anyio
    async def test_one_admin_drain_reaches_every_worker(
        self, client: httpx.AsyncClient, engines: list[Process], tmp_path: Path
    ) -> None:
        """One drain call (one worker receives it) answers after both applied it; then no worker sends to e1."""
        async with supervisor(client, engines, tmp_path) as server:
            response = await client.post(server.url + "/admin/backends/e1/drain", headers=AUTH, json={})
            assert response.status_code == 202, response.text
            assert response.json()["workers"] == {"applied": 2, "live": 2}
            before = per_worker(await samples(client, server.url), "kvroute_worker_requests_total")
            bodies = [body(p, "after the drain") for p in range(48)]
            assert sum(home(b) == "e1" for b in bodies) > 0
            chosen = await send_all(client, server, bodies)
            assert chosen == [home(b, exclude={"e1"}) for b in bodies]
            found = await samples(client, server.url)
            after = per_worker(found, "kvroute_worker_requests_total")
            assert all(after.get(w, 0) > before.get(w, 0) for w in ("0", "1"))  # both workers took part
            assert total(found, "kvroute_backend_draining", backend="e1") == 1

    @pytest.mark.anyio
    async def test_a_killed_worker_comes_back_with_the_fleet_and_the_totals(
        self, client: httpx.AsyncClient, engines: list[Process], tmp_path: Path
    ) -> None:
        """SIGKILL on worker 0: restarted with a new pid, it replays the drain; totals keep the dead worker's counts."""
        async with supervisor(client, engines, tmp_path) as server:
            first = [body(p, "before") for p in range(20)]
            await send_all(client, server, first)
            assert (
                await client.post(server.url + "/admin/backends/e2/drain", headers=AUTH, json={})
            ).status_code == 202
            old = worker_pids(await samples(client, server.url))
            assert parent_pid(old["0"]) == server.popen.pid
            os.kill(old["0"], signal.SIGKILL)

            async def restarted() -> bool:
                pids = worker_pids(await samples(client, server.url))
                return pids.get("0", old["0"]) != old["0"] and len(pids) == WORKERS

            await until(restarted)
            found = await samples(client, server.url)
            assert per_worker(found, "kvroute_worker_starts_total") == {"0": 2, "1": 1}
            assert total(found, "kvroute_requests_total") == len(first)
            before = per_worker(found, "kvroute_worker_requests_total")
            second = [body(p, "after") for p in range(48)]
            chosen = await send_all(client, server, second)
            assert "e2" not in chosen and chosen == [home(b, exclude={"e2"}) for b in second]
            after = per_worker(await samples(client, server.url), "kvroute_worker_requests_total")
            assert after["0"] > before["0"]  # the new worker 0 served, with e2 drained
            assert sum(after.values()) == len(first) + len(second)


class TestStopping:
    @pytest.mark.anyio
    @pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
    async def test_no_worker_outlives_the_supervisor(
        self, sig: signal.Signals, client: httpx.AsyncClient, engines: list[Process], tmp_path: Path
    ) -> None:
        """After SIGTERM (graceful) or SIGKILL (no handler runs) to the supervisor alone, both workers exit."""
        async with supervisor(client, engines, tmp_path) as server:
            pids = list(worker_pids(await samples(client, server.url)).values())
            directory = run_dir(server)
            assert len(pids) == WORKERS and all(parent_pid(pid) == server.popen.pid for pid in pids)
            assert directory.is_dir()
            os.kill(server.popen.pid, sig)
            with anyio.fail_after(30):
                while server.popen.poll() is None:  # noqa: ASYNC110 - a child process has no awaitable exit
                    await anyio.sleep(0.05)

            async def workers_gone() -> bool:
                return all(gone(pid) for pid in pids)

            await until(workers_gone)
            if sig == signal.SIGTERM:
                assert server.popen.returncode == 0
            await until(lambda: _removed(directory))


async def _removed(directory: Path) -> bool:
    return not await anyio.Path(directory).exists()
