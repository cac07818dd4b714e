"""Start `kvroute emulate` engines and `kvroute serve` replicas as processes on loopback, and stop them by PID.

Every process gets a port the OS just handed out, is waited for on an HTTP path with a
bounded deadline, and is terminated (then killed if it lingers) when the test is done.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx

__all__ = ["Process", "engine_load", "free_port", "serve_config", "start_engines", "start_replicas", "until"]

KVROUTE = [sys.executable, "-m", "kvroute"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


async def start_engines(client: httpx.AsyncClient, count: int, *, time_scale: float) -> list[Process]:
    """``count`` engine emulators serving model ``m``, ready to answer."""
    engines = []
    for i in range(count):
        port = free_port()
        args = [*KVROUTE, "emulate", "--port", str(port), "--model", "m", "--time-scale", str(time_scale)]
        engines.append(Process(f"engine-{i}", args, port))
    try:
        for engine in engines:
            await engine.ready(client, "/health")
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


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
    ]
    for i, engine in enumerate(engines):
        lines += [
            "[[backends]]",
            f'id = "e{i}"',
            f'url = "{engine.url}"',
            'kind = "vllm"',
            'adapter_options = { kv_events = "off" }',
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


_SAMPLE = re.compile(r'^(vllm:num_requests_(?:running|waiting))\{[^}]*\}\s+([0-9.eE+-]+)$', re.M)


async def engine_load(client: httpx.AsyncClient, engine: Process) -> int:
    """Running + waiting requests as the engine reports them on /metrics."""
    text = (await client.get(engine.url + "/metrics")).text
    return int(sum(float(value) for _, value in _SAMPLE.findall(text)))


async def until(check: Callable[[], Awaitable[bool]], within: float = 30.0) -> None:
    """Poll ``check`` until it holds; ``TimeoutError`` after ``within`` seconds (state read over HTTP has no event)."""
    with anyio.fail_after(within):
        while not await check():  # noqa: ASYNC110 - the state lives in other processes
            await anyio.sleep(0.05)
