"""The real commands as processes: `kvroute serve` from a TOML file in front of `kvroute emulate` processes,
and what a new user meets first: help, mistakes and log lines."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.helpers import free_port as _free_port
from tests.server.harness import chat_body, http

pytestmark = pytest.mark.e2e


def _wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if http("GET", url, timeout=2)[0] == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer 200 within {timeout} s")


@contextlib.contextmanager
def _process(args: list[str], ready: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start a command in its own process group and stop it (by its pid) at the end."""
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_http(ready)
        time.sleep(0.3)  # a server that lost its port to another program exits at once: notice it
        assert proc.poll() is None, f"{args} exited with {proc.returncode}; see {log}"
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)


def _kvroute(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the ``kvroute`` console script installed next to this interpreter, as a user would."""
    script = shutil.which("kvroute", path=str(Path(sys.executable).parent))
    assert script is not None, f"no kvroute script next to {sys.executable}"
    return subprocess.run([script, *args], capture_output=True, text=True, timeout=120, check=False)


def _emulate(port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvroute",
        "emulate",
        "--port",
        str(port),
        "--model",
        "m",
        "--time-scale",
        "0.02",
        "--num-gpu-blocks",
        "2048",
    ]


class TestCommands:
    def test_serve_from_toml_fronts_emulators(self, tmp_path: Path) -> None:
        """kvroute serve --config works with the openai SDK and logs one JSON line per request."""
        e_ports = [_free_port(), _free_port()]
        p_port = _free_port()
        config = tmp_path / "kvroute.toml"
        config.write_text(
            f'[server]\nport = {p_port}\n[routing]\nstrategy = "consistent-hash"\n'
            "[routing.options]\nprefix_length = 1024\n"
            + "".join(f'[[backends]]\nid = "e{i}"\nurl = "http://127.0.0.1:{p}"\n' for i, p in enumerate(e_ports))
        )
        with contextlib.ExitStack() as stack:
            for i, port in enumerate(e_ports):
                stack.enter_context(_process(_emulate(port), f"http://127.0.0.1:{port}/health", tmp_path / f"e{i}.log"))
            proxy_log = tmp_path / "proxy.log"
            stack.enter_context(
                _process(
                    [sys.executable, "-m", "kvroute", "serve", "--config", str(config)],
                    f"http://127.0.0.1:{p_port}/health",
                    proxy_log,
                )
            )
            client = stack.enter_context(
                openai.OpenAI(base_url=f"http://127.0.0.1:{p_port}/v1", api_key="k", max_retries=0, timeout=30)
            )
            reply = client.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": "hello " * 300}], max_tokens=3
            )
            assert reply.headers["x-kvroute-backend"] in ("e0", "e1")
            assert reply.parse().usage.completion_tokens == 3
        lines = [json.loads(line) for line in proxy_log.read_text().splitlines() if line.startswith("{")]
        requests = [line for line in lines if line["event"] == "request"]
        assert len(requests) == 1
        added = [line["backend"] for line in lines if line["event"] == "fleet_changed" and line["change"] == "added"]
        assert added == ["e0", "e1"]  # the library's own events reach the default (info) log too
        assert requests[0]["strategy"] == "consistent-hash" and requests[0]["key"] is not None

    def test_workers_stop_cleanly_on_sigterm(self, tmp_path: Path) -> None:
        """SIGTERM to `kvroute serve --workers 2` stops both workers with status 0 and no interpreter abort.

        The workers used to print "Fatal Python error: _enter_buffered_busy" at exit: the thread that
        watches the supervisor's pipe held stdin's buffered-reader lock.
        """
        e_port, p_port = _free_port(), _free_port()
        proxy_log = tmp_path / "proxy.log"
        backend = ["--backend", f"e0=http://127.0.0.1:{e_port}", "--no-access-log"]
        with _process(_emulate(e_port), f"http://127.0.0.1:{e_port}/health", tmp_path / "e0.log"):
            with proxy_log.open("wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "kvroute", "serve", "--port", str(p_port), "--workers", "2", *backend],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            try:
                _wait_http(f"http://127.0.0.1:{p_port}/health")
                status, *_ = http(
                    "POST", f"http://127.0.0.1:{p_port}/v1/chat/completions", chat_body("hi", max_tokens=2, model="m")
                )
                assert status == 200
                os.kill(proc.pid, signal.SIGTERM)  # the supervisor only: it stops its workers
                assert proc.wait(timeout=30) == 0
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=15)
        log = proxy_log.read_text()
        assert "workers_stopped" in log
        assert "Fatal Python error" not in log, log

    def test_killed_emulator_process_is_survived_and_rejoins(self, tmp_path: Path) -> None:
        """SIGKILL on one emulator process under load: every non-streamed request succeeds; it rejoins after restart."""
        e_ports = [_free_port(), _free_port()]
        p_port = _free_port()
        proxy_url = f"http://127.0.0.1:{p_port}"
        with contextlib.ExitStack() as stack:
            victim = stack.enter_context(
                _process(_emulate(e_ports[0]), f"http://127.0.0.1:{e_ports[0]}/health", tmp_path / "e0.log")
            )
            stack.enter_context(
                _process(_emulate(e_ports[1]), f"http://127.0.0.1:{e_ports[1]}/health", tmp_path / "e1.log")
            )
            stack.enter_context(
                _process(
                    [
                        sys.executable,
                        "-m",
                        "kvroute",
                        "serve",
                        "--port",
                        str(p_port),
                        "--strategy",
                        "least-outstanding",
                        "--option",
                        "seed=1",
                        "--backend",
                        f"e0=http://127.0.0.1:{e_ports[0]}",
                        "--backend",
                        f"e1=http://127.0.0.1:{e_ports[1]}",
                        "--health-interval",
                        "0.1",
                        "--unhealthy-threshold",
                        "1",
                        "--healthy-threshold",
                        "2",
                        "--no-access-log",
                    ],
                    proxy_url + "/health",
                    tmp_path / "proxy.log",
                )
            )

            def one(i: int) -> int:
                status, _, body = http(
                    "POST", proxy_url + "/v1/chat/completions", chat_body(f"kill test {i}", max_tokens=30)
                )
                return status if status != 200 or json.loads(body)["choices"] else -1

            with ThreadPoolExecutor(max_workers=8) as pool:
                futures = [pool.submit(one, i) for i in range(200)]
                deadline = time.monotonic() + 30
                while sum(f.done() for f in futures) < 40 and time.monotonic() < deadline:
                    time.sleep(0.005)
                os.killpg(victim.pid, signal.SIGKILL)  # mid-run: 40 done, the rest queued or in flight
                victim.wait(timeout=10)
                statuses = [f.result(timeout=60) for f in futures]
            assert statuses == [200] * 200

            def e0_healthy() -> str:
                metrics = http("GET", proxy_url + "/metrics")[2].decode()
                return "1" if 'kvroute_backend_healthy{backend="e0"} 1.0' in metrics else "0"

            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and e0_healthy() != "0":
                time.sleep(0.05)
            assert e0_healthy() == "0"
            stack.enter_context(
                _process(_emulate(e_ports[0]), f"http://127.0.0.1:{e_ports[0]}/health", tmp_path / "e0-again.log")
            )
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and e0_healthy() != "1":
                time.sleep(0.05)
            assert e0_healthy() == "1"
            backends = {
                http("POST", proxy_url + "/v1/chat/completions", chat_body(f"back {i}"))[1]["x-kvroute-backend"]
                for i in range(12)
            }
            assert "e0" in backends


class TestFirstContact:
    def test_serve_help_shows_the_default_strategy(self) -> None:
        """`kvroute serve --help` exits 0 and documents --strategy with its default, bounded-load."""
        result = _kvroute("serve", "--help")
        assert result.returncode == 0 and result.stderr == ""
        assert "--strategy TEXT Routing strategy plugin name [default: bounded-load]." in " ".join(
            result.stdout.split()
        )

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["serve", "--bogus"], "Error: No such option '--bogus'"),
            (["serve", "--port", "http"], "Error: Invalid value for '--port': 'http' is not a valid integer."),
            (["emulate", "--port", "x"], "Error: Invalid value for '--port': 'x' is not a valid integer."),
            (["check-parity"], "Error: Missing option '--backend'."),
        ],
    )
    def test_mistakes_exit_2_without_traceback(self, args: list[str], message: str) -> None:
        """A wrong flag or value for serve, emulate or check-parity prints usage and one error line, exit 2."""
        result = _kvroute(*args)
        assert result.returncode == 2
        assert message in result.stderr and f"Usage: kvroute {args[0]} [OPTIONS]" in result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""

    def test_bad_configuration_exits_1_without_traceback(self) -> None:
        """A configuration the proxy rejects is one error line and exit 1."""
        result = _kvroute("serve", "--backend", "ftp://x", "--check")
        assert result.returncode == 1
        assert result.stderr.startswith("Error: --backend 'ftp://x': 'url' must be an http:// or https:// URL")
        assert "Traceback" not in result.stderr

    def test_serve_logs_fleet_changes_on_stderr(self) -> None:
        """`kvroute serve --log-level info --check` prints the configuration on stdout and one fleet_changed JSON line
        per backend on stderr."""
        result = _kvroute(
            "serve",
            "--backend",
            "a=http://127.0.0.1:9",
            "--backend",
            "b=http://127.0.0.1:10",
            "--log-level",
            "info",
            "--check",
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["strategy"] == "bounded-load"
        lines = [json.loads(line) for line in result.stderr.splitlines()]
        changes = [
            (line["backend"], line["change"], line["level"]) for line in lines if line["event"] == "fleet_changed"
        ]
        assert changes == [("a", "added", "info"), ("b", "added", "info")]

    def test_serve_log_level_filters(self) -> None:
        """`kvroute serve --log-level warning --check` leaves the info-level fleet_changed lines out."""
        result = _kvroute("serve", "--backend", "http://127.0.0.1:9", "--log-level", "warning", "--check")
        assert result.returncode == 0, result.stderr
        assert "fleet_changed" not in result.stderr
