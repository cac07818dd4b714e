"""``kvroute serve --workers 2 --otlp-endpoint ...``: every worker process exports its own spans."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.contrib.tracing.receiver import HttpReceiver
from tests.helpers import free_port
from tests.server.gray_engine import GrayEngine
from tests.server.harness import MODEL, chat_body, http


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert proc.poll() is None, "kvroute serve exited before it was ready"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:  # refused, reset, or timed out while the workers start
            pass
        time.sleep(0.2)
    raise AssertionError(f"kvroute serve was not healthy within {within} s")


class TestWorkers:
    def test_every_worker_exports(self, tmp_path: Path) -> None:
        """Requests spread over two workers' connections yield spans from both, told apart by kvroute.worker and
        service.instance.id."""
        engine = GrayEngine(model=MODEL).start()
        receiver = HttpReceiver().start()
        port = free_port()
        script = shutil.which("kvroute", path=str(Path(sys.executable).parent))
        assert script is not None
        args = [script, "serve", "--workers", "2", "--port", str(port), "--backend", engine.url]
        args += ["--otlp-endpoint", receiver.url, "--log-level", "error", "--no-access-log"]
        log = (tmp_path / "serve.log").open("wb")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc)

            def workers(spans: list) -> set[str]:  # type: ignore[type-arg]
                return {s.resource.get("kvroute.worker") for s in spans if s.kind == "SPAN_KIND_SERVER"}

            for _ in range(200):  # each on a new connection: the kernel hands them to either worker
                status, _, _ = http("POST", url + "/v1/chat/completions", chat_body("hello"))
                assert status == 200
                if workers(receiver.spans) == {"0", "1"}:
                    break
                time.sleep(0.02)
            spans = receiver.wait_for(lambda spans: workers(spans) == {"0", "1"}, timeout=30)
            instances = {s.resource["service.instance.id"] for s in spans}
            assert len(instances) == 2
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            log.close()
            receiver.stop()
            engine.stop()
