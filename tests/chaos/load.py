"""The chaos suite's load and its figures: a `kvroute serve` process over `kvroute emulate` engines and fake ones.

`Load.run` sends chat requests (half streamed, prompts from a seeded pool of documents of varied sizes so that
prefixes repeat, varied ``max_tokens``) at a fixed concurrency for a while or a count, each with a client
timeout, and classifies every answer as the client saw it (`Result.kind`):

- ``ok``: a whole completion (200 and a JSON object with ``choices``), or a stream ending with ``[DONE]`` and
  no error event;
- ``stream_error``: a stream that started and then ended with an SSE error event and ``[DONE]`` (its engine
  failed while it was streaming);
- ``error``: a clean error answer (a status other than 200 with an OpenAI-style JSON error);
- ``lost``: anything else: a client timeout, a dropped connection, a stream without ``[DONE]``, a 200 that is
  not a completion.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import attrs
import httpx

from tests.replicas.processes import KVROUTE, Process, free_port

__all__ = ["Load", "Result", "proxy_config", "start_proxy", "summary"]

#: The client's timeout per request (the issue's).
CLIENT_TIMEOUT = 40.0
_WORDS = [
    "cache",
    "prefill",
    "decode",
    "token",
    "block",
    "engine",
    "fleet",
    "router",
    "prefix",
    "shard",
    "replica",
    "tensor",
    "batch",
]


def _document(rng: random.Random, n: int) -> str:
    return f"Document {n}. " + " ".join(rng.choice(_WORDS) for _ in range(rng.choice([40, 150, 600, 1500])))


@attrs.define
class Result:
    """One client request as the client saw it."""

    index: int
    stream: bool
    started: float
    ended: float
    kind: str
    status: int = 0
    detail: str = ""
    backend: str = ""

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@attrs.define
class Load:
    """Requests against ``url`` (a proxy), seeded; every result kept in order of completion."""

    url: str
    seed: int = 25
    concurrency: int = 12
    documents: int = 40
    results: list[Result] = attrs.field(factory=list)
    t0: float = attrs.field(factory=time.monotonic)

    def body(self, rng: random.Random, index: int) -> dict[str, Any]:
        n = rng.randrange(self.documents)
        doc = _document(random.Random(n), n)  # the same document text for the same n, in every run
        stream = index % 2 == 0
        body: dict[str, Any] = {
            "model": "m",
            "messages": [{"role": "system", "content": doc}, {"role": "user", "content": f"Question {index}?"}],
            "max_tokens": rng.choice([4, 8, 16, 32]),
            "stream": stream,
        }
        return body

    async def run(self, *, count: int | None = None, seconds: float | None = None) -> list[Result]:
        """Send ``count`` requests, or keep sending for ``seconds``, ``concurrency`` at a time."""
        rng = random.Random(self.seed)
        next_index = 0
        stop_at = time.monotonic() + seconds if seconds is not None else None
        limits = httpx.Limits(max_connections=self.concurrency * 2, max_keepalive_connections=self.concurrency * 2)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:

            async def worker() -> None:
                nonlocal next_index
                while True:
                    if count is not None and next_index >= count:
                        return
                    if stop_at is not None and time.monotonic() >= stop_at:
                        return
                    index = next_index
                    next_index += 1
                    self.results.append(await self.one(client, index, self.body(rng, index)))

            async with anyio.create_task_group() as tg:
                for _ in range(self.concurrency):
                    tg.start_soon(worker)
        return self.results

    async def one(self, client: httpx.AsyncClient, index: int, body: dict[str, Any]) -> Result:
        stream = bool(body["stream"])
        started = time.monotonic()
        status, data, backend = 0, b"", ""
        try:
            with anyio.fail_after(CLIENT_TIMEOUT):
                async with client.stream("POST", self.url + "/v1/chat/completions", json=body) as response:
                    status = response.status_code
                    backend = response.headers.get("x-kvroute-backend", "")
                    data = await response.aread()
        except TimeoutError:
            return Result(index, stream, started, time.monotonic(), "lost", status, "client timeout", backend)
        except httpx.HTTPError as exc:
            return Result(index, stream, started, time.monotonic(), "lost", status, f"{type(exc).__name__}", backend)
        kind, detail = _classify(stream, status, data)
        return Result(index, stream, started, time.monotonic(), kind, status, detail, backend)


def _classify(stream: bool, status: int, data: bytes) -> tuple[str, str]:
    if status != 200:
        try:
            error = json.loads(data)["error"]
        except (ValueError, KeyError, TypeError):
            return "lost", f"{status} without a JSON error"
        return "error", f"{status} {error.get('code')}"
    if not stream:
        try:
            answer = json.loads(data)
        except ValueError:
            return "lost", "200 that is not JSON"
        return ("ok", "") if isinstance(answer, dict) and answer.get("choices") else ("lost", "200 without choices")
    events = [e for e in data.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
    if not events or events[-1].strip() != b"data: [DONE]":
        return "lost", "stream without [DONE]"
    if any(b'"error"' in e for e in events):
        return "stream_error", "SSE error event"
    return "ok", ""


def summary(results: Sequence[Result]) -> dict[str, Any]:
    """Counts by kind and latency figures (seconds) of ``results``."""
    seconds = sorted(r.seconds for r in results)
    kinds = Counter(r.kind for r in results)

    def q(p: float) -> float:
        return round(seconds[min(len(seconds) - 1, int(p * len(seconds)))], 3) if seconds else 0.0

    return {
        "requests": len(results),
        **{k: kinds.get(k, 0) for k in ("ok", "stream_error", "error", "lost")},
        "lost_details": dict(Counter(r.detail for r in results if r.kind in ("lost", "error"))),
        "p50_s": q(0.5),
        "p99_s": q(0.99),
        "max_s": round(seconds[-1], 3) if seconds else 0.0,
        "mean_s": round(statistics.fmean(seconds), 3) if seconds else 0.0,
        "slowest": [
            f"#{r.index} {'stream' if r.stream else 'whole'} {r.seconds:.2f}s {r.kind} via {r.backend or '-'}"
            for r in sorted(results, key=lambda r: -r.seconds)[:3]
        ],
    }


def proxy_config(backends: Sequence[tuple[str, str]], **sections: dict[str, Any]) -> str:
    """A `kvroute serve` TOML file: ``[[backends]]`` (id, url) of kind openai serving ``m``, and extra tables."""
    lines = ["[server]", "access_log = false"]
    for name, table in sections.items():
        if name == "server":
            lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    for name, table in sections.items():
        if name != "server":
            lines += [f"[{name}]", *(f"{k} = {json.dumps(v)}" for k, v in table.items())]
    for backend_id, url in backends:
        lines += ["[[backends]]", f'id = "{backend_id}"', f'url = "{url}"', 'models = ["m"]']
    return "\n".join(lines) + "\n"


async def start_proxy(client: httpx.AsyncClient, config: str, directory: Any, *flags: str) -> Process:
    """`kvroute serve` as a process with ``config`` (and ``flags``), ready when /metrics answers."""
    path = directory / "chaos.toml"
    path.write_text(config)
    port = free_port()
    args = [*KVROUTE, "serve", "--config", str(path), "--port", str(port), "--log-level", "warning", *flags]
    proxy = Process("proxy", args, port)
    try:
        await proxy.ready(client, "/metrics")
    except BaseException:
        proxy.stop()
        raise
    return proxy


def window(results: Sequence[Result], start: float, end: float = float("inf")) -> list[Result]:
    """The results of requests started in ``[start, end)`` (monotonic)."""
    return [r for r in results if start <= r.started < end]


def share(received: int, sent: int) -> float:
    return round(received / sent, 4) if sent else 0.0


Check = Callable[[], bool]
