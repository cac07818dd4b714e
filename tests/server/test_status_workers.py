"""The status under ``kvroute serve --workers 2``: counters merged over the workers, decisions the worker's own."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.harness import Servers, chat_body, http


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve_workers(servers: Servers, *options: str) -> Iterator[str]:
    """``kvroute serve --workers 2 OPTIONS`` in front of two emulators; yields its URL once healthy, then stops it."""
    emulators = servers.emulators(2)
    exe = shutil.which("kvroute", path=str(Path(sys.executable).parent)) or shutil.which("kvroute")
    assert exe, "the kvroute command is not installed in this environment"
    port = _free_port()
    command = [exe, "serve", "--workers", "2", "--port", str(port), "--no-access-log", "--log-level", "error"]
    command += options
    for i, emulator in enumerate(emulators):
        command += ["--backend", f"e{i}={emulator.url}"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, f"kvroute serve --workers 2 exited with {process.returncode}"
            try:
                if http("GET", url + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "kvroute serve --workers 2 was not healthy within 30 s"
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture
def two_workers(servers: Servers) -> Iterator[str]:
    """``kvroute serve --workers 2`` in front of two emulators; yields its URL and stops it at teardown."""
    with serve_workers(servers) as url:
        yield url


def answer(url: str) -> dict[str, Any]:
    # A new connection each time, so that either worker may answer.
    code, _, body = http("GET", url + "/status.json", headers={"connection": "close"})
    assert code == 200, body
    return json.loads(body)  # type: ignore[no-any-return]


def requests_metric(url: str) -> float:
    """``kvroute_requests_total`` summed, from /metrics (merged over the workers)."""
    text = http("GET", url + "/metrics")[2].decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvroute_requests_total"
    )


class TestStatusUnderWorkers:
    """Every worker's /status.json under ``--workers 2``."""

    def test_counters_are_merged_decisions_are_own(self, two_workers: str) -> None:
        """Whichever worker answers, request counts equal the merged /metrics; its decisions are its own share."""
        total = 40

        def one(i: int) -> int:
            return http("POST", two_workers + "/v1/chat/completions", chat_body(f"q{i}", max_tokens=16))[0]

        with ThreadPoolExecutor(max_workers=total) as pool:  # a burst, so that both workers take some
            assert list(pool.map(one, range(total))) == [200] * total
        # A request is counted just after its answer went out: wait for the last ones.
        deadline = time.monotonic() + 10
        while (metric := requests_metric(two_workers)) != total and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric == total
        own: dict[int, int] = {}
        deadline = time.monotonic() + 20
        # Bursts of new connections until each worker has answered (which one accepts is the kernel's choice).
        while len(own) < 2 and time.monotonic() < deadline:
            with ThreadPoolExecutor(max_workers=10) as pool:
                docs = list(pool.map(lambda _: answer(two_workers), range(20)))
            for doc in docs:
                assert doc["worker"]["count"] == 2
                assert doc["totals"]["routed"] == total, "every worker must show the requests of both"
                assert sum(b["requests"]["total"] for b in doc["backends"]) == total
                assert "decisions" in doc["worker"]["own"] and "requests" in doc["worker"]["merged"]
                own[doc["worker"]["index"]] = len(doc["decisions"]["recent"])
        assert sorted(own) == [0, 1], f"both workers should have answered within 20 s (got worker(s) {sorted(own)})"
        assert sum(own.values()) == total, f"each worker's decisions are its own requests (got {own})"
