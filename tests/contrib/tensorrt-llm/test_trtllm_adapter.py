"""The ``tensorrt-llm`` backend kind against a server replaying trtllm-serve's answers over HTTP, holding them as it
does."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from kvroute_tensorrt_llm import TensorRTLLMAdapter
from kvroute_tokenizer_prefix import BlockIndex, block_hashes
from structlog.testing import capture_logs

from kvroute import Backend
from kvroute.adapters import HttpReply
from kvroute.backend import EngineLoad
from kvroute.plugins import PluginManager
from kvroute_server.fleet.adapter_http import BackendHttp

pytestmark = pytest.mark.anyio

FIXTURES = Path(__file__).parent / "fixtures"
#: The proxy's probe timeout (``health.timeout``): the health checker polls load under it.
HEALTH_TIMEOUT = 2.0
#: How long the fake server holds a drained answer: TensorRT-LLM's loop waits two seconds after the last item.
HOLD = 2.3


def _adapter(url: str = "http://127.0.0.1:1", **options: Any) -> TensorRTLLMAdapter:
    return TensorRTLLMAdapter.create(Backend(id="t0", url=url, kind="tensorrt-llm"), **options)


class _GetOnly:
    """A client that cannot POST (like a proxy's plain getter)."""

    async def get(self, path: str) -> HttpReply:
        return HttpReply(200, b"[]")


async def _until(condition: Any, limit_s: float = 10.0) -> None:
    with anyio.fail_after(limit_s):
        while not condition():  # noqa: ASYNC110 - polling state owned by the code under test
            await anyio.sleep(0.01)


def _proxy_client(http: Any, timeout: float = HEALTH_TIMEOUT) -> BackendHttp:
    """The proxy's own client for the backend, with the probe timeout it gives load polls."""
    return BackendHttp(http.session, http.base, timeout)


async def _poll_like_the_health_checker(adapter: TensorRTLLMAdapter, http: Any) -> EngineLoad | None:
    """One load poll as the proxy makes it: its client times out and its scope fails after the probe timeout."""
    try:
        with anyio.fail_after(HEALTH_TIMEOUT):
            return await adapter.poll_load(_proxy_client(http))
    except (TimeoutError, OSError):
        return None


@pytest.fixture
async def closing() -> AsyncIterator[list[TensorRTLLMAdapter]]:
    """Adapters to close at the end (a /metrics call may still be held by the server)."""
    adapters: list[TensorRTLLMAdapter] = []
    yield adapters
    for adapter in adapters:
        await adapter.aclose()


class TestTensorRTLLMAdapter:
    def test_registered_as_kind_tensorrt_llm(self) -> None:
        """The entry point registers kind 'tensorrt-llm' whose factory builds this adapter."""
        registration = PluginManager().backend_kinds["tensorrt-llm"]
        assert isinstance(
            registration.factory(Backend(id="t", url="http://h:1", kind="tensorrt-llm")), TensorRTLLMAdapter
        )

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"kv_events_interval": 0}, "between 0.01 and 60"),
            ({"kv_events_timeout": 0}, "'kv_events_timeout' must be a number of seconds"),
            ({"metrics_timeout": "soon"}, "'metrics_timeout' must be a number of seconds"),
            ({"kv_events_resync": -1}, "(0: never)"),
            ({"kv_events": "maybe"}, "true or false"),
            ({"metrics_path": "metrics"}, "starting with '/'"),
            ({"kv_events_url": "/x"}, "unknown option"),
        ],
    )
    def test_bad_options(self, options: dict[str, Any], message: str) -> None:
        """Unusable options raise ValueError saying what was expected."""
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            _adapter(**options)

    async def test_health_and_models(self, trtllm: Any) -> None:
        """200 is healthy; 503 fails the probe with the engine's reason 'LLM is unavailable'; models come from
        /v1/models."""
        server, http = trtllm
        adapter = _adapter(server.url)
        assert await adapter.probe(http) is True
        server.health_status = 503
        with pytest.raises(ValueError, match="/health answered 503: LLM is unavailable"):
            await adapter.probe(http)
        assert await adapter.list_models(http) == ["llama"]

    async def test_load_over_successive_polls(self, trtllm: Any, closing: list[TensorRTLLMAdapter]) -> None:
        """Each poll drains the stats: an empty answer keeps the last values with a fresh time; nulls keep fields."""
        server, http = trtllm
        adapter = _adapter(server.url)
        closing.append(adapter)
        first = await adapter.poll_load(http)
        assert first is not None and (first.running, first.waiting, first.block_size) == (1, 0, 32)
        second = await adapter.poll_load(http)  # [] from the server
        assert second is not None and (second.running, second.kv_usage) == (first.running, first.kv_usage)
        assert second.observed_at > first.observed_at
        third = await adapter.poll_load(http)  # nulls
        assert third is not None and (third.running, third.waiting, third.prefix_cache_hits) == (3, 0, 320)
        assert server.calls.count("metrics") == 3
        assert server.calls.count("prometheus") == 1  # 404 once, then not asked again for a while
        assert adapter.stats()["load_polling"]["source"] == "json"

    async def test_nothing_reported_yet_is_no_load(self, trtllm: Any, closing: list[TensorRTLLMAdapter]) -> None:
        """A server that never reported an iteration gives no telemetry rather than zeros."""
        server, http = trtllm
        server.metrics = []
        adapter = _adapter(server.url)
        closing.append(adapter)
        assert await adapter.poll_load(http) is None

    async def test_metrics_held_while_traffic_flows(self, trtllm: Any, closing: list[TensorRTLLMAdapter]) -> None:
        """/metrics held past the probe timeout still delivers what it drained; the load polls stay within the
        timeout."""
        server, http = trtllm
        server.metrics = server.metrics[:1]
        server.metrics_hold = HOLD
        adapter = _adapter(server.url)
        closing.append(adapter)
        load = None
        with anyio.fail_after(4 * HOLD):
            while load is None:
                load = await _poll_like_the_health_checker(adapter, http)
                await anyio.sleep(0.2)
        assert (load.running, load.block_size) == (1, 32)
        assert server.lost == []
        assert adapter.stats()["load_polling"]["held_polls"] >= 1

    async def test_metrics_timeout_is_counted(self, trtllm: Any, closing: list[TensorRTLLMAdapter]) -> None:
        """A /metrics call held past metrics_timeout is given up, counted and logged; the poll raises TimeoutError."""
        server, http = trtllm
        server.metrics_hold = 1.0
        adapter = _adapter(server.url, metrics_timeout=0.2)
        closing.append(adapter)
        with capture_logs() as logs, pytest.raises(TimeoutError):
            await adapter.poll_load(http)
        assert adapter.load_stats.timeouts == 1
        assert any(log["event"] == "trtllm_metrics_timeout" and log["backend"] == "t0" for log in logs)

    async def test_prometheus_instead_of_json(self, trtllm: Any, closing: list[TensorRTLLMAdapter]) -> None:
        """With return_perf_metrics the server's collector drains the JSON stats: its Prometheus gauges are read
        instead."""
        server, http = trtllm
        server.prometheus = (FIXTURES / "prometheus.txt").read_text()
        server.metrics = [[], [], []]  # what /metrics mostly answers then
        adapter = _adapter(server.url)
        closing.append(adapter)
        load = await adapter.poll_load(http)
        assert load is not None and (load.running, load.waiting, load.kv_usage, load.block_size) == (4, 2, 0.125, 32)
        assert (load.prefix_cache_hits, load.prefix_cache_queries) == (128 * 32, (128 + 384) * 32)
        assert adapter.metrics is not None and adapter.metrics.max_blocks == 8192
        assert "metrics" not in server.calls
        assert adapter.stats()["load_polling"]["source"] == "prometheus"

    async def test_json_until_prometheus_has_iteration_gauges(
        self, trtllm: Any, closing: list[TensorRTLLMAdapter]
    ) -> None:
        """A Prometheus endpoint without iteration gauges yet leaves the load to JSON /metrics, then takes over."""
        server, http = trtllm
        text = (FIXTURES / "prometheus.txt").read_text()
        server.prometheus = text.split("# HELP trtllm_kv_cache_hit_rate")[0]  # request metrics only
        adapter = _adapter(server.url)
        closing.append(adapter)
        load = await adapter.poll_load(http)
        assert load is not None and load.running == 1 and adapter.load_stats.source == "json"
        server.prometheus = text
        load = await adapter.poll_load(http)
        assert load is not None and load.running == 4 and adapter.load_stats.source == "prometheus"
        assert server.calls.count("metrics") == 1

    async def test_metrics_error_is_value_error(self, trtllm: Any, closing: list[TensorRTLLMAdapter]) -> None:
        """A non-200 /metrics raises ValueError (the poll is skipped and the old load goes stale)."""
        server, http = trtllm
        adapter = _adapter(server.url, metrics_path="/nope")
        closing.append(adapter)
        with pytest.raises(ValueError, match="answered 404"):
            await adapter.poll_load(http)

    async def test_events_feed_the_index(self, trtllm: Any, closing: list[TensorRTLLMAdapter]) -> None:
        """The event task polls /kv_cache_events, marks the backend exact and keeps the index equal to the engine's
        blocks."""
        server, http = trtllm
        adapter = _adapter(server.url, kv_events_interval=0.01)
        closing.append(adapter)
        await adapter.poll_load(http)
        index = BlockIndex(32)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                await tg.start(adapter.run_events, http, index)
                await _until(lambda: not server.events and adapter.feed is not None and adapter.feed.stats.events == 9)
                assert index.is_exact("t0") and adapter.stats()["kv_events"]["exact"]
                tg.cancel_scope.cancel()
        assert not index.is_exact("t0")
        assert index.match(block_hashes(list(range(1000, 1096)), 32), ["t0"]) == {"t0": 2}
        assert index.capacity("t0") == 101256
        stats = adapter.stats()
        assert stats["kv_events"]["blocks_stored"] == 4  # 2 + 1 + 1, of which 2 were removed later
        assert stats["kv_events"]["lost_reason"] is None and stats["metrics"]["max_blocks"] == 101256

    async def test_events_held_while_traffic_flows(self, trtllm: Any) -> None:
        """/kv_cache_events held past the client's usual timeout still delivers the events it drained."""
        server, http = trtllm
        server.events_hold = HOLD
        adapter = _adapter(server.url, kv_events_interval=0.01)
        index = BlockIndex(32)
        with anyio.fail_after(6 * HOLD):
            async with anyio.create_task_group() as tg:
                await tg.start(adapter.run_events, _proxy_client(http), index)
                await _until(lambda: adapter.feed is not None and adapter.feed.stats.blocks_stored >= 2, 5 * HOLD)
                tg.cancel_scope.cancel()
        assert server.lost == []
        assert index.match(block_hashes(list(range(1000, 1064)), 32), ["t0"]) == {"t0": 2}

    async def test_timeout_after_a_drain_marks_inexact(self, trtllm: Any) -> None:
        """A poll given up while the server held a drained answer loses events: inexact (counted, logged), then
        resynced."""
        server, http = trtllm
        adapter = _adapter(server.url, kv_events_interval=0.01, kv_events_timeout=0.3, kv_events_resync=0.5)
        index = BlockIndex(32)
        with anyio.fail_after(20), capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                await tg.start(adapter.run_events, http, index)
                await _until(lambda: index.is_exact("t0"))
                server.events_hold = 1.0  # the next answers are drained, then held past the timeout
                await _until(lambda: not index.is_exact("t0"))
                assert adapter.feed is not None and adapter.feed.stats.inexact_reasons.get("poll_timeout", 0) >= 1
                await _until(lambda: bool(server.lost))
                server.events_hold = 0.0
                await _until(lambda: index.is_exact("t0"))  # kv_events_resync later: cleared and trusted again
                tg.cancel_scope.cancel()
        assert adapter.feed.stats.resyncs == 1
        inexact = [log for log in logs if log["event"] == "kv_index_inexact"]
        assert inexact and {"backend": "t0", "reason": "poll_timeout"}.items() <= inexact[0].items()
        assert any(log["event"] == "kv_index_exact" and log["reason"] == "resync" for log in logs)

    async def test_malformed_event_over_http(self, trtllm: Any) -> None:
        """A V2 drain with one malformed event applies the others and leaves the backend inexact."""
        server, http = trtllm
        server.events = [[], *json.loads((FIXTURES / "kv_events_v2_malformed.json").read_text())]
        adapter = _adapter(server.url, kv_events_interval=0.01)
        index = BlockIndex(32)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                await tg.start(adapter.run_events, http, index)
                await _until(lambda: adapter.feed is not None and adapter.feed.stats.events == 4)
                assert not index.is_exact("t0")
                tg.cancel_scope.cancel()
        assert index.match(block_hashes(list(range(2000, 2064)), 32), ["t0"]) == {"t0": 1}
        assert index.match(block_hashes(list(range(3000, 3032)), 32), ["t0"]) == {"t0": 1}
        assert adapter.stats()["kv_events"]["inexact_reasons"] == {"malformed_event": 1}

    async def test_events_unsupported_or_unreachable(self, trtllm: Any) -> None:
        """404 ends the task; failures before the first answer are retried; after it, an error answer may have cost
        events."""
        server, http = trtllm
        server.events_status = 404
        with anyio.fail_after(10):
            await _adapter(server.url).run_events(http, BlockIndex(32))
            await _adapter(server.url).run_events(_GetOnly(), BlockIndex(32))
        server.events_status = 500
        index = BlockIndex(32)
        adapter = _adapter(server.url, kv_events_interval=0.01)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(adapter.run_events, http, index)
                await _until(lambda: server.calls.count("kv_cache_events") >= 3)
                assert adapter.feed is not None and adapter.feed.stats.inexact == 0
                server.events_status = 200
                await _until(lambda: index.is_exact("t0"))
                server.events_status = 500  # the server may have drained its buffer before failing
                await _until(lambda: not index.is_exact("t0"))
                tg.cancel_scope.cancel()
        assert adapter.feed.stats.inexact_reasons.get("poll_status", 0) >= 1

    async def test_failed_polls_back_off_and_an_answer_starts_over(self, trtllm: Any) -> None:
        """Failed polls wait longer each time (background_loop_failed); an answer ends the series (recovered), so the
        next failure waits one interval again."""
        server, http = trtllm
        server.events_status = 500
        adapter = _adapter(server.url, kv_events_interval=0.01)
        with anyio.fail_after(20), capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                await tg.start(adapter.run_events, http, BlockIndex(32))
                await _until(lambda: server.calls.count("kv_cache_events") >= 3)
                server.events_status = 200
                await _until(lambda: any(log["event"] == "background_loop_recovered" for log in logs))
                server.events_status = 500
                await _until(lambda: sum(log["event"] == "background_loop_failed" for log in logs) >= 4)
                tg.cancel_scope.cancel()
        lines = [log for log in logs if log["event"].startswith("background_loop_")]
        assert {"loop": "trtllm_kv_events", "backend": "t0", "attempt": 1}.items() <= lines[0].items()
        recovered = next(i for i, log in enumerate(lines) if log["event"] == "background_loop_recovered")
        assert [log["attempt"] for log in lines[:recovered]] == list(range(1, recovered + 1))
        assert lines[recovered]["after"] == recovered and lines[recovered + 1]["attempt"] == 1
        assert lines[recovered + 1]["wait_s"] <= 0.012  # one interval, jittered

    async def test_events_off(self, trtllm: Any) -> None:
        """kv_events=false: the task returns without asking the server."""
        server, http = trtllm
        await _adapter(server.url, kv_events="false").run_events(http, BlockIndex(32))
        assert "kv_cache_events" not in server.calls
