"""A real browser on the status page: headless Debian Chromium driven by Playwright, `kvroute serve` as a process.

Both are required, not optional: without them these tests fail, saying what to install.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.harness import Servers, chat_body, http

TOKEN = "browser-admin-token-0123456789"
#: Four conversations, each with its own long shared prefix (so bounded-load has keys to place).
PREFIXES = [f"conversation {n}: " + "system prompt words " * 120 for n in range(4)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Proxy:
    """``kvroute serve`` in a child process on loopback, stopped by `stop`."""

    def __init__(self, backends: list[str], *args: str, port: int | None = None) -> None:
        exe = shutil.which("kvroute", path=str(Path(sys.executable).parent)) or shutil.which("kvroute")
        assert exe, "the kvroute command is not installed in this environment (pip install -e ./core)"
        self.port = _free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        command = [exe, "serve", "--port", str(self.port), "--admin-token", TOKEN, "--no-access-log"]
        for backend in backends:
            command += ["--backend", backend]
        self.process = subprocess.Popen([*command, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"kvroute serve exited with {self.process.returncode}: {self._stderr()}")
            try:
                if http("GET", self.url + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"kvroute serve did not become healthy within 30 s: {self._stderr()}")
            time.sleep(0.1)

    def _stderr(self) -> str:
        if self.process.stderr is None or self.process.poll() is None:
            return "(still running)"
        return self.process.stderr.read().decode(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self.process.stderr is not None:
            self.process.stderr.close()


class Traffic:
    """Chat requests on the four conversations from ``clients`` threads until stopped."""

    def __init__(self, url: str, clients: int = 2, max_tokens: int = 24) -> None:
        self.url = url
        self.clients = clients
        self.max_tokens = max_tokens
        self.sent = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def _run(self, offset: int) -> None:
        n = offset
        while not self._stop.is_set():
            prefix = PREFIXES[n % len(PREFIXES)]
            body = chat_body(prefix + f"question {n}", max_tokens=self.max_tokens, stream=(n // 4) % 2 == 0)
            code, _, answer = http("POST", self.url + "/v1/chat/completions", body)
            if code != 200:
                self.failures.append(f"{code}: {answer[:200]!r}")
            self.sent += 1
            n += self.clients
            self._stop.wait(0.05)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        assert not self.failures, f"requests failed while traffic flowed: {self.failures[:3]}"


@pytest.fixture(scope="session")
def chromium() -> Iterator[Any]:
    """Headless Debian Chromium under Playwright; fails (does not skip) when either is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(
            "the browser tests need Playwright: .venv/bin/pip install playwright "
            "(its own browsers are not used: Debian's chromium is)",
            pytrace=False,
        )
    executable = os.environ.get("KVROUTE_CHROMIUM") or shutil.which("chromium")
    if executable is None:
        pytest.fail(
            "the browser tests need Debian's Chromium (expected chromium on PATH or KVROUTE_CHROMIUM, got neither): "
            "install Debian's chromium and fonts-dejavu-core packages; the README's test command `bash tests/run` "
            "does it when run as root, or run "
            "`apt-get update && apt-get install -y --no-install-recommends chromium fonts-dejavu-core`.",
            pytrace=False,
        )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def servers() -> Iterator[Servers]:
    """Emulated engines in threads, stopped when the test ends."""
    registry = Servers()
    try:
        yield registry
    finally:
        registry.stop_all()


@pytest.fixture
def fleet(servers: Servers) -> Iterator[Proxy]:
    """``kvroute serve`` (bounded-load, vllm kind for engine load, two shadows) in front of four emulators."""
    emulators = servers.emulators(4, time_scale=0.05)
    backends = [f"id=gpu-{i},url={e.url},kind=vllm" for i, e in enumerate(emulators)]
    proxy = Proxy(
        backends,
        "--strategy",
        "bounded-load",
        "--option",
        "prefix_length=1024",
        "--option",
        "concurrency_threshold=2",
        "--health-interval",
        "0.5",
        "--status-decisions",
        "25",
        "--shadow",
        "consistent-hash,least-outstanding",
        "--shadow-option",
        "consistent-hash.prefix_length=1024",
        "--cache-view",
        "units=words",
    )
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def guarded(servers: Servers) -> Iterator[Proxy]:
    """``kvroute serve --status admin`` in front of one emulator."""
    emulator = servers.emulator()
    proxy = Proxy([f"id=solo,url={emulator.url}"], "--status", "admin")
    try:
        yield proxy
    finally:
        proxy.stop()
