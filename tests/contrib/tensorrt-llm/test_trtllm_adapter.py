"""The ``tensorrt-llm`` backend kind against a server replaying trtllm-serve's documented answers over HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from kvroute_tensorrt_llm import TensorRTLLMAdapter
from kvroute_tokenizer_prefix import BlockIndex, block_hashes

from kvroute import Backend
from kvroute.adapters import HttpReply
from kvroute.plugins import PluginManager

pytestmark = pytest.mark.anyio


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


class TestTensorRTLLMAdapter:
    def test_registered_as_kind_tensorrt_llm(self) -> None:
        """The entry point registers kind 'tensorrt-llm' whose factory builds this adapter."""
        registration = PluginManager().backend_kinds["tensorrt-llm"]
        assert isinstance(registration.factory(Backend(id="t", url="http://h:1", kind="tensorrt-llm")), TensorRTLLMAdapter)

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"kv_events_interval": 0}, "between 0.01 and 60"),
            ({"kv_events": "maybe"}, "true or false"),
            ({"metrics_path": "metrics"}, "starting with '/'"),
            ({"kv_events_url": "/x"}, "unknown option"),
        ],
    )
    def test_bad_options(self, options: dict[str, Any], message: str) -> None:
        """Unusable options raise ValueError saying what was expected."""
        with pytest.raises(ValueError, match=message):
            _adapter(**options)

    async def test_health_and_models(self, trtllm: Any) -> None:
        """200 is healthy; 503 fails the probe with the engine's reason 'LLM is unavailable'; models come from /v1/models."""
        server, http = trtllm
        adapter = _adapter(server.url)
        assert await adapter.probe(http) is True
        server.health_status = 503
        with pytest.raises(ValueError, match="/health answered 503: LLM is unavailable"):
            await adapter.probe(http)
        assert await adapter.list_models(http) == ["llama"]

    async def test_load_over_successive_polls(self, trtllm: Any) -> None:
        """Each poll drains the stats: an empty answer keeps the last values with a fresh time; nulls keep fields."""
        server, http = trtllm
        adapter = _adapter(server.url)
        first = await adapter.poll_load(http)
        assert first is not None and (first.running, first.waiting, first.block_size) == (1, 0, 32)
        second = await adapter.poll_load(http)  # [] from the server
        assert second is not None and (second.running, second.kv_usage) == (first.running, first.kv_usage)
        assert second.observed_at >= first.observed_at
        third = await adapter.poll_load(http)  # nulls
        assert third is not None and (third.running, third.waiting, third.prefix_cache_hits) == (3, 0, 320)
        assert server.calls.count("metrics") == 3
        assert server.calls.count("prometheus") == 1  # 404 once, then not asked again for a while

    async def test_nothing_reported_yet_is_no_load(self, trtllm: Any) -> None:
        """A server that never reported an iteration gives no telemetry rather than zeros."""
        server, http = trtllm
        server.metrics = []
        assert await _adapter(server.url).poll_load(http) is None

    async def test_prometheus_gauges_win(self, trtllm: Any) -> None:
        """When the server mounts Prometheus, its current gauges override the last iteration's counts."""
        server, http = trtllm
        server.prometheus = (Path(__file__).parent / "fixtures" / "prometheus.txt").read_text()
        load = await _adapter(server.url).poll_load(http)
        assert load is not None and (load.running, load.waiting, load.kv_usage, load.block_size) == (4, 2, 0.125, 32)
        assert load.prefix_cache_hits == 4 * 32  # counters still come from the JSON stats

    async def test_metrics_error_is_value_error(self, trtllm: Any) -> None:
        """A non-200 /metrics raises ValueError (the poll is skipped and the old load goes stale)."""
        server, http = trtllm
        with pytest.raises(ValueError, match="answered 404"):
            await _adapter(server.url, metrics_path="/nope").poll_load(http)

    async def test_events_feed_the_index(self, trtllm: Any) -> None:
        """The event task polls /kv_cache_events, marks the backend exact and keeps the index equal to the engine's blocks."""
        server, http = trtllm
        adapter = _adapter(server.url, kv_events_interval=0.01)
        await adapter.poll_load(http)
        index = BlockIndex(32)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                await tg.start(adapter.run_events, http, index)
                await _until(lambda: not server.events and adapter.feed is not None and adapter.feed.stats.events == 7)
                assert index.is_exact("t0")
                tg.cancel_scope.cancel()
        assert not index.is_exact("t0")
        assert index.match(block_hashes(list(range(1000, 1096)), 32), ["t0"]) == {"t0": 2}
        assert index.capacity("t0") == 101256
        assert adapter.stats()["kv_events"]["blocks_stored"] == 4  # 2 + 1 + 1, of which 2 were removed later

    async def test_events_unsupported_or_unreachable(self, trtllm: Any) -> None:
        """404 ends the task; other failures are retried without leaving exact mode; a client that cannot POST ends it."""
        server, http = trtllm
        server.events_status = 404
        with anyio.fail_after(10):
            await _adapter(server.url).run_events(http, BlockIndex(32))
            await _adapter(server.url).run_events(_GetOnly(), BlockIndex(32))
        server.events_status = 500
        index = BlockIndex(32)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(_adapter(server.url, kv_events_interval=0.01).run_events, http, index)
                await _until(lambda: server.calls.count("kv_cache_events") >= 3)
                server.events_status = 200
                await _until(lambda: index.is_exact("t0"))
                server.events_status = 500  # a transient failure: the server keeps its events, the index stays exact
                calls = server.calls.count("kv_cache_events")
                await _until(lambda: server.calls.count("kv_cache_events") >= calls + 2)
                assert index.is_exact("t0")
                tg.cancel_scope.cancel()

    async def test_events_off(self, trtllm: Any) -> None:
        """kv_events=false: the task returns without asking the server."""
        server, http = trtllm
        await _adapter(server.url, kv_events="false").run_events(http, BlockIndex(32))
        assert "kv_cache_events" not in server.calls
