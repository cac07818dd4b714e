"""Gray failures through the proxy: answers checked before they are relayed, per-attempt first-byte deadlines,
outlier ejection and return through a probe request, against fake engines that pass health checks."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvroute_server import BackendConfig, HealthConfig, ProxyApp, ServerConfig, ServerThread, TimeoutConfig
from kvroute_server.config import OutlierConfig
from tests.server.gray_engine import GrayEngine
from tests.server.harness import Servers, chat_body, http

pytestmark = pytest.mark.e2e


@pytest.fixture
def engines() -> Iterator[Callable[..., GrayEngine]]:
    """Start fake engines (``factory(fault, **options)``); every one is stopped at teardown."""
    started: list[GrayEngine] = []

    def factory(fault: str = "ok", **options: Any) -> GrayEngine:
        engine = GrayEngine(fault, **options).start()
        started.append(engine)
        return engine

    yield factory
    for engine in started:
        engine.stop()


def _proxy(servers: Servers, engines: list[GrayEngine], **config: Any) -> ServerThread:
    """A proxy over ``engines`` (ids g0, g1...), probing every 0.1 s, random strategy with a seed."""
    config.setdefault("health", HealthConfig(interval=0.1, timeout=1.0, unhealthy_threshold=2, healthy_threshold=1))
    config.setdefault("strategy", "random")
    config.setdefault("options", {"seed": 7})
    backends = tuple(BackendConfig(id=f"g{i}", url=e.url, models=("m",)) for i, e in enumerate(engines))
    server = ServerThread(ProxyApp(ServerConfig(backends=backends, access_log=False, **config))).start()
    servers.started.append(server)
    return server


def _metric(proxy: ServerThread, prefix: str) -> float:
    """The sum of the samples whose line starts with ``prefix`` in the proxy's /metrics."""
    text = http("GET", proxy.url + "/metrics")[2].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


class TestAnswerChecks:
    @pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
    def test_html_with_200_is_retried(self, servers: Servers, engines: Callable[..., GrayEngine], stream: bool) -> None:
        """A 200 answer with an HTML page is a failed attempt: retried elsewhere, never relayed."""
        bad, good = engines("html"), engines("ok")
        proxy = _proxy(servers, [bad, good], outliers=OutlierConfig(enabled=False))
        for i in range(12):
            status, headers, body = http("POST", proxy.url + "/v1/chat/completions", chat_body(f"h{i}", stream=stream))
            assert status == 200 and headers["x-kvroute-backend"] == "g1", body[:200]
            assert b"<html" not in body
        assert bad.completions
        assert _metric(proxy, 'kvroute_retries_total{backend="g0",reason="invalid_answer"}') == len(bad.completions)

    def test_stream_whose_first_event_is_not_data_is_retried(
        self, servers: Servers, engines: Callable[..., GrayEngine]
    ) -> None:
        """A stream whose first event carries no data line is a failed attempt, retried before anything is sent."""
        bad, good = engines("not_sse"), engines("ok")
        proxy = _proxy(servers, [bad, good], outliers=OutlierConfig(enabled=False))
        for i in range(12):
            status, headers, body = http("POST", proxy.url + "/v1/chat/completions", chat_body(f"n{i}", stream=True))
            assert status == 200 and headers["x-kvroute-backend"] == "g1"
            assert body.startswith(b"data: ") and body.endswith(b"data: [DONE]\n\n")
        assert _metric(proxy, 'kvroute_retries_total{backend="g0",reason="invalid_answer"}') == len(bad.completions) > 0

    def test_comment_before_the_first_data_event_is_relayed(
        self, servers: Servers, engines: Callable[..., GrayEngine]
    ) -> None:
        """A comment-only event before the first data event is no fault: the stream is relayed whole."""
        proxy = _proxy(servers, [engines("comment_first")])
        status, _, body = http("POST", proxy.url + "/v1/chat/completions", chat_body("c", stream=True))
        assert status == 200
        assert body.startswith(b": keep-alive\n\ndata: ") and body.endswith(b"data: [DONE]\n\n")

    @pytest.mark.parametrize(
        ("fault", "words"), [("no_done", "ended early"), ("cut", "failed after it started")], ids=["no-done", "closed"]
    )
    def test_stream_ending_without_done_ends_with_an_error_event(
        self, servers: Servers, engines: Callable[..., GrayEngine], fault: str, words: str
    ) -> None:
        """A stream that ends after its first event without [DONE] (cleanly, or by the connection closing) gets
        an SSE error event, then [DONE]."""
        proxy = _proxy(servers, [engines(fault)], outliers=OutlierConfig(enabled=False))
        status, _, body = http("POST", proxy.url + "/v1/chat/completions", chat_body("cut", stream=True))
        assert status == 200
        events = [e for e in body.split(b"\n\n") if e]
        assert events[0].startswith(b"data: {") and b"chat.completion.chunk" in events[0]
        error = json.loads(events[-2].removeprefix(b"data: "))["error"]
        assert error["code"] == "upstream_stream_error" and words in error["message"]
        assert events[-1] == b"data: [DONE]"
        assert _metric(proxy, 'kvroute_requests_total{backend="g0",outcome="stream_error"') == 1

    def test_whole_answer_cut_short_is_retried_never_relayed_cut(
        self, servers: Servers, engines: Callable[..., GrayEngine]
    ) -> None:
        """A non-streamed body cut short is retried elsewhere: the client only ever gets a whole answer."""
        bad, good = engines("cut"), engines("ok")
        proxy = _proxy(servers, [bad, good], outliers=OutlierConfig(enabled=False))
        for i in range(12):
            status, headers, body = http("POST", proxy.url + "/v1/chat/completions", chat_body(f"w{i}"))
            assert status == 200 and headers["x-kvroute-backend"] == "g1"
            assert json.loads(body)["choices"]
        assert bad.completions


class TestFirstByteDeadline:
    def test_hang_is_retried_on_the_next_candidate(self, servers: Servers, engines: Callable[..., GrayEngine]) -> None:
        """An engine that accepts and holds is cancelled at the deadline and the request answered by another."""
        hung, good = engines("hang"), engines("ok")
        proxy = _proxy(
            servers,
            [hung, good],
            timeouts=TimeoutConfig(first_byte=60.0, deadline_floor=0.3),
            outliers=OutlierConfig(consecutive_deadlines=0),
        )
        for i in range(8):
            status, headers, _ = http("POST", proxy.url + "/v1/chat/completions", chat_body(f"d{i}", stream=i % 2 == 0))
            assert status == 200 and headers["x-kvroute-backend"] == "g1"
        assert hung.completions
        retried = _metric(proxy, 'kvroute_retries_total{backend="g0",reason="first_byte_deadline"}')
        assert retried == len(hung.completions)

    def test_no_other_candidate_waits_the_hard_timeout(
        self, servers: Servers, engines: Callable[..., GrayEngine]
    ) -> None:
        """With no other backend to retry on, the attempt keeps the whole first-byte timeout (then 504)."""
        proxy = _proxy(servers, [engines("hang")], timeouts=TimeoutConfig(first_byte=1.0, deadline_floor=0.2))
        status, _, body = http("POST", proxy.url + "/v1/chat/completions", chat_body("alone"))
        assert status == 504 and json.loads(body)["error"]["code"] == "upstream_timeout"
        assert _metric(proxy, "kvroute_retries_total") == 0

    def test_several_expired_deadlines_eject(self, servers: Servers, engines: Callable[..., GrayEngine]) -> None:
        """A backend holding three expired attempts in a row is ejected for that cause and gets no more requests."""
        hung, a, b = engines("hang"), engines("ok"), engines("ok")
        proxy = _proxy(servers, [hung, a, b], timeouts=TimeoutConfig(first_byte=60.0, deadline_floor=0.2))
        i = 0
        while len(hung.completions) < 3 and i < 100:
            assert http("POST", proxy.url + "/v1/chat/completions", chat_body(f"e{i}"))[0] == 200
            i += 1
        assert _wait_for(lambda: _metric(proxy, 'kvroute_ejections_total{backend="g0",cause="first_byte_deadlines"}'))
        before = len(hung.completions)
        for j in range(20):
            assert http("POST", proxy.url + "/v1/chat/completions", chat_body(f"after{j}"))[0] == 200
        assert len(hung.completions) == before


class TestOutlierEjection:
    def test_500s_eject_and_the_probe_request_brings_it_back(
        self, servers: Servers, engines: Callable[..., GrayEngine]
    ) -> None:
        """Five 500s in a row eject an engine whose /health passes; it stays out while probe requests fail and
        returns once one succeeds."""
        bad, a, b = engines("500"), engines("ok"), engines("ok")
        proxy = _proxy(servers, [bad, a, b], outliers=OutlierConfig(base_ejection=0.3, max_ejection=0.6))
        i = 0
        while len(bad.completions) < 5 and i < 200:
            assert http("POST", proxy.url + "/v1/chat/completions", chat_body(f"f{i}"))[0] == 200
            i += 1
        assert _wait_for(lambda: _metric(proxy, 'kvroute_ejections_total{backend="g0",cause="consecutive_errors"}'))
        # Its health probes pass every 0.1 s; its probe requests (every back-off) fail: it stays out.
        time.sleep(1.0)
        assert _metric(proxy, 'kvroute_backend_healthy{backend="g0"}') == 0
        assert len(bad.completions) >= 6  # the probe requests reached it
        bad.fault = "ok"
        assert _wait_for(lambda: _metric(proxy, 'kvroute_backend_healthy{backend="g0"}') == 1)
        assert _metric(proxy, 'kvroute_restorations_total{backend="g0"}') == 1

    def test_streamed_probe_keeps_out_an_engine_that_fails_only_streams(
        self, servers: Servers, engines: Callable[..., GrayEngine]
    ) -> None:
        """An engine whose whole answers are fine but whose streams are garbage fails its probe's streamed half:
        it stays out through several back-offs."""
        bad, a, b = engines("not_sse"), engines("ok"), engines("ok")
        proxy = _proxy(servers, [bad, a, b], outliers=OutlierConfig(base_ejection=0.2, max_ejection=0.4))
        i = 0
        while len(bad.completions) < 5 and i < 200:
            assert http("POST", proxy.url + "/v1/chat/completions", chat_body(f"p{i}", stream=True))[0] == 200
            i += 1
        assert _wait_for(lambda: _metric(proxy, 'kvroute_backend_healthy{backend="g0"}') == 0)
        probed = len(bad.completions)
        assert _wait_for(lambda: len(bad.completions) >= probed + 4)  # two probes, each a whole and a stream
        assert _metric(proxy, 'kvroute_backend_healthy{backend="g0"}') == 0
        assert _metric(proxy, 'kvroute_restorations_total{backend="g0"}') == 0

    def test_passively_ejected_engine_is_counted_as_an_outlier(
        self, servers: Servers, engines: Callable[..., GrayEngine]
    ) -> None:
        """An engine that closes every whole answer half-way is ejected at once (passive) and brought back by its
        passing health probes, until its errors reach five in a row: then it is an outlier, held out."""
        bad, a, b = engines("cut"), engines("ok"), engines("ok")
        proxy = _proxy(servers, [bad, a, b], outliers=OutlierConfig(base_ejection=30.0))
        for i in range(200):
            assert http("POST", proxy.url + "/v1/chat/completions", chat_body(f"c{i}"))[0] == 200
            if _metric(proxy, 'kvroute_ejections_total{backend="g0",cause="consecutive_errors"}'):
                break
            time.sleep(0.05)  # probes (every 0.1 s) bring it back between passive ejections
        assert _metric(proxy, 'kvroute_ejections_total{backend="g0",cause="consecutive_errors"}') == 1
        assert _metric(proxy, 'kvroute_ejections_total{backend="g0",cause="passive"}') >= 1
        time.sleep(0.5)  # passing health probes no longer bring it back
        assert _metric(proxy, 'kvroute_backend_healthy{backend="g0"}') == 0

    def test_status_shows_the_cause(self, servers: Servers, engines: Callable[..., GrayEngine]) -> None:
        """/status.json names an outlier's cause, its back-off level and when it is probed again."""
        bad, a, b = engines("html"), engines("ok"), engines("ok")
        proxy = _proxy(servers, [bad, a, b], outliers=OutlierConfig(base_ejection=30.0))
        i = 0
        while len(bad.completions) < 5 and i < 200:
            assert http("POST", proxy.url + "/v1/chat/completions", chat_body(f"s{i}"))[0] == 200
            i += 1
        assert _wait_for(lambda: _metric(proxy, 'kvroute_backend_healthy{backend="g0"}') == 0)
        rows = {row["id"]: row for row in json.loads(http("GET", proxy.url + "/status.json")[2])["backends"]}
        outlier = rows["g0"]["outlier"]
        assert outlier["cause"] == "consecutive_errors" and outlier["level"] == 1
        assert 0 < outlier["returns_in_s"] <= 30
        assert rows["g0"]["ejections"] == {"consecutive_errors": 1}
        assert rows["g1"]["outlier"] is None


class TestRetryAvoidsSuspects:
    def test_retry_skips_backends_whose_last_attempt_failed(
        self, servers: Servers, engines: Callable[..., GrayEngine]
    ) -> None:
        """With two faulty engines of three and two attempts, a retry avoids the engine that just failed
        elsewhere: once each has failed once, every request is answered (not one in three lost)."""
        proxy = _proxy(
            servers,
            [engines("500"), engines("html"), engines("ok")],
            max_attempts=2,
            outliers=OutlierConfig(enabled=False),
        )
        statuses = [http("POST", proxy.url + "/v1/chat/completions", chat_body(f"r{i}"))[0] for i in range(30)]
        assert statuses.count(200) >= 29, statuses
