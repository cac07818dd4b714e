"""The runnable gateways in docs/examples/, each started as a process in front of fake engines on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest

from kvroute import Backend, Fleet, Router, RouteRequest
from tests.examples.openai_fake import FakeBackend, eventually, fake_backends
from tests.helpers import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
GATEWAYS = ["fastapi_gateway.py", "aiohttp_gateway.py"]
#: Longer than the 1,024 characters consistent-hash keys on, so a suffix does not change the key.
DOCUMENT = "".join(f"Section {i}: routers that remember prefixes save prefill. " for i in range(24))
OPTIONS = ["--strategy", "consistent-hash", "--option", "prefix_length=1024"]


def chat(system: str, user: str, **extra: object) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        **extra,
    }


def home_of(body: dict[str, object], ids: list[str]) -> str:
    """Where a standalone kvroute router with the same strategy sends this body."""
    router = Router.create(Fleet([Backend(i) for i in ids]), "consistent-hash", {"prefix_length": 1024})
    return router.decide(RouteRequest.from_openai(body))[0].backend.id


class Gateway:
    """One example gateway process on a free loopback port; stopped by its PID."""

    def __init__(self, script: str, backends: dict[str, str]) -> None:
        self.port = free_port()
        flags = [f"--backend={i}={url}" for i, url in backends.items()]
        self.process = subprocess.Popen(
            [sys.executable, str(EXAMPLES / script), *flags, *OPTIONS, "--port", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    async def ready(self, client: httpx.AsyncClient) -> None:
        with anyio.fail_after(30):
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"gateway exited early: {self.process.stderr.read().decode() if self.process.stderr else ''}"
                    )
                try:
                    if (await client.get(f"{self.url}/kvroute/fleet")).status_code == 200:
                        return
                except httpx.TransportError:
                    await anyio.sleep(0.1)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        if self.process.stderr:
            self.process.stderr.close()


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeBackend]]:
    async with fake_backends(3) as backends:
        yield backends


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as c:
        yield c


async def start(script: str, backends: dict[str, str], client: httpx.AsyncClient) -> Gateway:
    gateway = Gateway(script, backends)
    try:
        await gateway.ready(client)
    except BaseException:
        gateway.stop()
        raise
    return gateway


@pytest.mark.parametrize("script", GATEWAYS)
class TestGatewayExample:
    @pytest.mark.anyio
    async def test_routes_by_prefix_and_streams(
        self, script: str, engines: list[FakeBackend], client: httpx.AsyncClient
    ) -> None:
        """Same prefix, same engine (where kvroute's own router would send it); SSE and errors pass through."""
        ids = {f"d{i}": b.url for i, b in enumerate(engines)}
        gateway = await start(script, ids, client)
        try:
            chosen = set()
            for q in range(6):
                response = await client.post(f"{gateway.url}/v1/chat/completions", json=chat(DOCUMENT, f"question {q}"))
                assert response.status_code == 200
                chosen.add(response.headers["x-kvroute-backend"])
                assert (
                    response.json()["choices"][0]["message"]["content"]
                    == f"from b{response.headers['x-kvroute-backend'][1:]}"
                )
            assert chosen == {home_of(chat(DOCUMENT, "q"), list(ids))}
            spread = set()
            for p in range(24):
                response = await client.post(f"{gateway.url}/v1/chat/completions", json=chat(f"{p}:" + DOCUMENT, "x"))
                spread.add(response.headers["x-kvroute-backend"])
            assert spread == set(ids)

            async with client.stream(
                "POST", f"{gateway.url}/v1/completions", json={"model": "m", "prompt": DOCUMENT, "stream": True}
            ) as stream:
                assert stream.headers["content-type"].startswith("text/event-stream")
                lines = [line async for line in stream.aiter_lines() if line]
            assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["choices"][0]["text"].startswith("from b")

            bad = await client.post(f"{gateway.url}/v1/chat/completions", json={"model": "m", "messages": []})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        finally:
            gateway.stop()

    @pytest.mark.anyio
    async def test_in_flight_is_visible_while_held(
        self, script: str, engines: list[FakeBackend], client: httpx.AsyncClient
    ) -> None:
        """A request an engine is holding shows as in flight on that backend, and is gone once answered."""
        ids = {f"d{i}": b.url for i, b in enumerate(engines)}
        gateway = await start(script, ids, client)
        try:
            body = chat(DOCUMENT, "held")
            home = home_of(body, list(ids))
            engine = engines[int(home[1:])]
            engine.hold()
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: client.post(f"{gateway.url}/v1/chat/completions", json=body))
                await eventually(lambda: engine.held == 1)
                fleet = {b["id"]: b["in_flight"] for b in (await client.get(f"{gateway.url}/kvroute/fleet")).json()}
                assert fleet == {i: int(i == home) for i in ids}
                engine.release()
            fleet = {b["id"]: b["in_flight"] for b in (await client.get(f"{gateway.url}/kvroute/fleet")).json()}
            assert set(fleet.values()) == {0}
        finally:
            gateway.stop()


class TestAiohttpRetry:
    @pytest.mark.anyio
    async def test_dead_backend_is_retried_elsewhere(
        self, engines: list[FakeBackend], client: httpx.AsyncClient
    ) -> None:
        """When the chosen backend refuses connections, the aiohttp gateway routes again without it."""
        dead = f"http://127.0.0.1:{free_port()}"
        ids = {"d0": engines[0].url, "d1": engines[1].url, "dead": dead}
        gateway = await start("aiohttp_gateway.py", ids, client)
        try:
            body = next(b for p in range(200) if home_of(b := chat(f"{p}/" + DOCUMENT, "x"), list(ids)) == "dead")
            response = await client.post(f"{gateway.url}/v1/chat/completions", json=body)
            assert response.status_code == 200 and response.headers["x-kvroute-backend"] in {"d0", "d1"}
        finally:
            gateway.stop()


class TestArguments:
    @pytest.mark.parametrize("script", GATEWAYS)
    def test_bad_flag_is_explained(self, script: str) -> None:
        """A malformed --backend exits 2 saying what was expected and what was got."""
        result = subprocess.run(
            [sys.executable, str(EXAMPLES / script), "--backend", "nourl"], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 2 and "--backend must look like ID=URL (got 'nourl')" in result.stderr
