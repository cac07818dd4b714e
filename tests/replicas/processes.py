"""Start `kvroute emulate` engines and `kvroute serve` replicas as processes on loopback, and stop them by PID.

Every process gets a port the OS just handed out, is waited for on an HTTP path with a
bounded deadline, and is terminated (then killed if it lingers) when the test is done.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx

from kvroute import Backend, Fleet, Router, RouteRequest
from tests.helpers import free_port

__all__ = [
    "ENGINES",
    "Process",
    "backend_tables",
    "body",
    "engine_load",
    "free_port",
    "home",
    "serve_config",
    "start_engines",
    "start_replicas",
    "until",
    "wait_ready",
]

KVROUTE = [sys.executable, "-m", "kvroute"]
#: Engines in the tests' fleet, e0, e1, ...
ENGINES = 3
#: A document longer than the 1,024 characters the strategies key on.
FILLER = "".join(f"Clause {i}: the parties agree that caches are worth keeping warm. " for i in range(18))


def body(prefix: int, question: str, **extra: Any) -> dict[str, Any]:
    """A chat request whose routing key is its document ``prefix``."""
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": f"Document {prefix}. {FILLER}"},
            {"role": "user", "content": question},
        ],
        "max_tokens": 1,
        **extra,
    }


def home(request_body: dict[str, Any], exclude: Collection[str] = frozenset()) -> str:
    """Where a consistent-hash router in this process sends the body: the replicas must agree with it."""
    router = Router.create(
        Fleet([Backend(f"e{i}") for i in range(ENGINES)]), "consistent-hash", {"prefix_length": 1024}
    )
    return router.decide(RouteRequest.from_openai(request_body), exclude=exclude)[0].backend.id


class Process:
    """One child process listening on ``port``; stopped by its PID only."""

    def __init__(self, name: str, args: Sequence[str], port: int) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process; closed in stop()
        self.popen = subprocess.Popen([*args], stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    async def ready(self, client: httpx.AsyncClient, path: str) -> None:
        with anyio.fail_after(60):
            while True:
                if self.popen.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.output()}")
                try:
                    if (await client.get(self.url + path)).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await anyio.sleep(0.1)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        self.log.close()


async def wait_ready(client: httpx.AsyncClient, processes: list[Process], path: str = "/health") -> list[Process]:
    """Wait until every process answers ``path``; if one never does, stop them all and raise."""
    try:
        for process in processes:
            await process.ready(client, path)
    except BaseException:
        for process in processes:
            process.stop()
        raise
    return processes


async def start_engines(client: httpx.AsyncClient, count: int, *, time_scale: float) -> list[Process]:
    """``count`` engine emulators serving model ``m``, ready to answer."""
    engines = []
    for i in range(count):
        port = free_port()
        args = [*KVROUTE, "emulate", "--port", str(port), "--model", "m", "--time-scale", str(time_scale)]
        engines.append(Process(f"engine-{i}", args, port))
    return await wait_ready(client, engines)


def backend_tables(engines: Sequence[Process]) -> list[str]:
    """TOML ``[[backends]]`` tables for the engines: ``vllm`` backends e0, e1, ... without KV events."""
    lines = []
    for i, engine in enumerate(engines):
        lines += [
            "[[backends]]",
            f'id = "e{i}"',
            f'url = "{engine.url}"',
            'kind = "vllm"',
            'adapter_options = { kv_events = "off" }',
        ]
    return lines


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def serve_config(
    engines: Sequence[Process], strategy: str, options: Mapping[str, Any], *, admin_token: str, health_interval: float
) -> str:
    """A `kvroute serve` TOML file: the engines as ``vllm`` backends e0, e1... (load read from /metrics)."""
    lines = [
        "[server]",
        f"admin_token = {_toml_value(admin_token)}",
        "access_log = false",
        "[routing]",
        f"strategy = {_toml_value(strategy)}",
        "[routing.options]",
        *(f"{k} = {_toml_value(v)}" for k, v in options.items()),
        "[health]",
        f"interval = {health_interval}",
        *backend_tables(engines),
    ]
    return "\n".join(lines) + "\n"


async def start_replicas(client: httpx.AsyncClient, config: str, count: int, directory: Path) -> list[Process]:
    """``count`` `kvroute serve` processes with the same configuration file."""
    path = directory / "kvroute.toml"
    path.write_text(config)
    replicas = []
    for i in range(count):
        port = free_port()
        args = [*KVROUTE, "serve", "--config", str(path), "--port", str(port), "--log-level", "warning"]
        replicas.append(Process(f"replica-{i}", args, port))
    try:
        for replica in replicas:
            await replica.ready(client, "/metrics")
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas


_SAMPLE = re.compile(r"^(vllm:num_requests_(?:running|waiting))\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)


async def engine_load(client: httpx.AsyncClient, engine: Process) -> int:
    """Running + waiting requests as the engine reports them on /metrics."""
    text = (await client.get(engine.url + "/metrics")).text
    return int(sum(float(value) for _, value in _SAMPLE.findall(text)))


async def until(check: Callable[[], Awaitable[bool]], within: float = 30.0) -> None:
    """Poll ``check`` until it holds; ``TimeoutError`` after ``within`` seconds (state read over HTTP has no event)."""
    with anyio.fail_after(within):
        while not await check():  # noqa: ASYNC110 - the state lives in other processes
            await anyio.sleep(0.05)


#: One metric sample: (name, labels, value).
Sample = tuple[str, dict[str, str], float]


async def samples(client: httpx.AsyncClient, url: str) -> list[Sample]:
    """Every sample of ``url``'s /metrics, parsed with prometheus-client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get(url + "/metrics")).text
    return [
        (s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text) for s in family.samples
    ]


def total(found: list[Sample], name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for n, ls, v in found if n == name and all(ls.get(k) == want for k, want in labels.items()))


def parent_pid(pid: int) -> int | None:
    """The parent of a running process (None when it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[1])


def gone(pid: int) -> bool:
    """Whether a process has exited (a zombie waiting for its parent counts as exited)."""
    return parent_pid(pid) is None
