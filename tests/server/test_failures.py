"""Failures: retries before the first byte, SSE errors after it, ejection and return, disconnects, timeouts."""

from __future__ import annotations

import http.client as hc
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from kvroute_server import HealthConfig, ServerThread, TimeoutConfig
from tests.server.harness import MODEL, Servers, chat_body, http, in_loop

pytestmark = pytest.mark.e2e


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _faults(emulator: ServerThread, **faults: float) -> None:
    assert http("POST", emulator.url + "/emulator/faults", faults)[0] == 200


def _stats(emulator: ServerThread) -> dict[str, int]:
    return json.loads(http("GET", emulator.url + "/emulator/stats")[2])


def _backend_state(proxy: ServerThread, backend: str) -> bool:
    status, _, body = http("GET", proxy.url + "/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(f'kvroute_backend_healthy{{backend="{backend}"}}'):
            return line.endswith(" 1.0")
    raise AssertionError(f"no health gauge for {backend}")


class TestRetries:
    def test_5xx_before_any_byte_is_retried_elsewhere(self, servers: Servers) -> None:
        """A backend answering 500 is skipped: every request still succeeds and retries are counted."""
        bad, good = servers.emulators(2)
        proxy = servers.proxy([bad, good], strategy="random", options={"seed": 3})
        _faults(bad, error_next=-1)
        for i in range(20):
            status, headers, _ = http("POST", proxy.url + "/v1/chat/completions", chat_body(f"q{i}", stream=i % 2 == 0))
            assert status == 200 and headers["x-kvroute-backend"] == "e1"
        assert _stats(bad)["errors_injected"] > 0
        metrics = http("GET", proxy.url + "/metrics")[2].decode()
        assert 'kvroute_retries_total{backend="e0",reason="upstream_5xx"}' in metrics

    def test_every_backend_failing_returns_the_last_error(self, servers: Servers) -> None:
        """When every attempt gets a 5xx the client receives the backend's own error after bounded attempts."""
        fleet = servers.emulators(3)
        proxy = servers.proxy(fleet, max_attempts=2)
        for emulator in fleet:
            _faults(emulator, error_next=-1, error_status=503)
        status, _, body = http("POST", proxy.url + "/v1/chat/completions", chat_body("doomed"))
        assert status == 503
        assert json.loads(body)["error"]["code"] == "injected"
        assert sum(_stats(e)["errors_injected"] for e in fleet) == 2

    def test_connection_refused_is_retried_and_ejects(self, servers: Servers) -> None:
        """A backend that refuses connections is passively ejected and requests succeed elsewhere."""
        good = servers.emulator()
        dead = servers.emulator()
        dead_url = dead.url
        dead.kill()
        servers.started.remove(dead)
        proxy = servers.proxy(health=HealthConfig(interval=30.0, unhealthy_threshold=5, healthy_threshold=1))
        from kvroute_server import BackendConfig

        app = proxy.app
        in_loop(proxy, app.backends.add, BackendConfig(id="dead", url=dead_url))
        in_loop(proxy, app.backends.add, BackendConfig(id="good", url=good.url))
        for i in range(10):
            status, headers, _ = http("POST", proxy.url + "/v1/chat/completions", chat_body(f"r{i}"))
            assert status == 200 and headers["x-kvroute-backend"] == "good"
        assert not app.fleet.get("dead").healthy

    def test_die_mid_stream_sends_sse_error(self, servers: Servers) -> None:
        """A backend dying after the stream started ends it with a well-formed SSE error the SDK raises."""
        emulator = servers.emulator()
        proxy = servers.proxy([emulator])
        _faults(emulator, die_next=1, die_after_events=3)
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        received: list[str] = []
        with pytest.raises(openai.APIError) as raised:
            for chunk in client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=50, stream=True
            ):
                received.append(chunk.choices[0].delta.content or "")
        assert received  # the stream had started
        assert "stream failed" in str(raised.value.message)
        # The broken connection ejected the backend; the next probe round brings it back.
        assert _wait_for(lambda: _backend_state(proxy, "e0"))
        status, _, raw = http("POST", proxy.url + "/v1/chat/completions", chat_body("again", stream=True))
        assert status == 200 and raw.endswith(b"data: [DONE]\n\n")

    def test_die_before_first_event_is_retried(self, servers: Servers) -> None:
        """A backend dropping the connection before any event is retried on another backend invisibly."""
        bad, good = servers.emulators(2)
        proxy = servers.proxy([bad, good], strategy="random", options={"seed": 1})
        _faults(bad, die_next=-1, die_after_events=1)
        for i in range(10):
            status, _, body = http("POST", proxy.url + "/v1/chat/completions", chat_body(f"s{i}"))
            assert status == 200 and json.loads(body)["choices"]
        assert _stats(bad)["deaths_injected"] > 0


class TestKillAndRestart:
    def test_killed_backend_is_ejected_retried_and_restored(self, servers: Servers) -> None:
        """Killing a backend under load loses no request that had not started streaming; it returns after restart."""
        a, b = servers.emulators(2)
        proxy = servers.proxy(
            [a, b],
            strategy="least-outstanding",
            options={"seed": 1},
            health=HealthConfig(interval=0.1, timeout=0.5, unhealthy_threshold=1, healthy_threshold=2),
        )
        a_port = a.port
        outcomes: list[tuple[str, int, bytes]] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            stream = i % 2 == 0
            status, _, body = http(
                "POST", proxy.url + "/v1/chat/completions", chat_body(f"load {i}", max_tokens=40, stream=stream)
            )
            with lock:
                outcomes.append(("stream" if stream else "whole", status, body))

        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = [pool.submit(one, i) for i in range(120)]
            deadline = time.monotonic() + 30
            while sum(f.done() for f in futures) < 30 and time.monotonic() < deadline:
                time.sleep(0.005)
            a.kill()  # mid-run: 30 done, the rest queued or in flight
            servers.started.remove(a)
            for future in futures:
                future.result(timeout=60)
        assert len(outcomes) == 120
        assert all(status == 200 for _, status, _ in outcomes)
        # Non-streamed answers are buffered until complete, so all of them must be whole.
        assert all(json.loads(body)["choices"] for kind, _, body in outcomes if kind == "whole")
        # A stream either completed or had started and was ended with an SSE error event.
        for kind, _, body in outcomes:
            if kind == "stream":
                assert body.endswith(b"data: [DONE]\n\n")
        assert _wait_for(lambda: not _backend_state(proxy, "e0"))
        # The kill did hit requests on e0: retried (not yet streaming) or ended with an SSE error.
        metrics = http("GET", proxy.url + "/metrics")[2].decode()
        hit = [
            line
            for line in metrics.splitlines()
            if line.startswith(
                ('kvroute_retries_total{backend="e0"', 'kvroute_requests_total{backend="e0",outcome="stream_error"')
            )
        ]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in hit) > 0
        restarted = ServerThread(a.app.__class__(a.app.config), port=a_port).start()
        servers.started.append(restarted)
        assert _wait_for(lambda: _backend_state(proxy, "e0"))
        backends = {
            http("POST", proxy.url + "/v1/chat/completions", chat_body(f"after {i}"))[1]["x-kvroute-backend"]
            for i in range(10)
        }
        assert "e0" in backends

    def test_failed_probes_eject_and_passing_probes_restore(self, servers: Servers) -> None:
        """A backend whose /health fails is ejected (no traffic) and comes back when it passes again."""
        a, b = servers.emulators(2)
        proxy = servers.proxy(
            [a, b], health=HealthConfig(interval=0.05, timeout=0.5, unhealthy_threshold=2, healthy_threshold=2)
        )
        _faults(a, health_status=503)
        assert _wait_for(lambda: not _backend_state(proxy, "e0"))
        for i in range(10):
            assert http("POST", proxy.url + "/v1/chat/completions", chat_body(f"p{i}"))[1]["x-kvroute-backend"] == "e1"
        _faults(a, health_status=200)
        assert _wait_for(lambda: _backend_state(proxy, "e0"))
        metrics = http("GET", proxy.url + "/metrics")[2].decode()
        assert 'kvroute_ejections_total{backend="e0",cause="probe"} 1.0' in metrics
        assert 'kvroute_restorations_total{backend="e0"} 1.0' in metrics


class TestClientSide:
    @pytest.mark.parametrize("protocol", ["kvroute", "httptools"], ids=["kvroute-protocol", "uvicorn-protocol"])
    def test_client_disconnect_cancels_upstream(self, servers: Servers, protocol: str) -> None:
        """Closing the client connection mid-stream closes the upstream request too, under either HTTP protocol.

        kvroute's protocol calls the proxy back (the ``kvroute.disconnect`` extension); under uvicorn's
        the proxy learns it from ``receive()``.
        """
        emulator = servers.emulator(time_scale=0.2)  # 5,000 steps of 3 ms: far longer than the test
        proxy = servers.proxy([emulator], http=protocol)
        conn = hc.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(chat_body("endless", max_tokens=5000, stream=True)),
            {"content-type": "application/json"},
        )
        response = conn.getresponse()
        assert response.status == 200
        assert response.read1(1024).startswith(b"data: ")
        conn.close()
        assert _wait_for(lambda: _stats(emulator)["client_disconnects"] == 1)
        assert _wait_for(lambda: 'outcome="cancelled"' in http("GET", proxy.url + "/metrics")[2].decode())

    def test_first_byte_timeout_is_504(self, servers: Servers) -> None:
        """A backend slower than the first-byte timeout gives 504 in OpenAI's shape."""
        emulator = servers.emulator()
        proxy = servers.proxy([emulator], timeouts=TimeoutConfig(first_byte=0.2))
        _faults(emulator, delay_s=2.0)
        status, _, body = http("POST", proxy.url + "/v1/chat/completions", chat_body("slow"))
        assert status == 504 and json.loads(body)["error"]["code"] == "upstream_timeout"
