"""The ``vllm`` backend kind: options, health, models, load telemetry, event source discovery and the event task."""

from __future__ import annotations

import socket

import anyio
import pytest
import zmq
from kvroute_vllm import VllmAdapter, ZmqSource, ZmqSubscriber

from kvroute import Backend
from kvroute.adapters import HttpReply, kv_event_sink
from kvroute.plugins import PluginManager
from tests.contrib.vllm.vllm_fakes import (
    FakeHttp,
    FakeVllmPublisher,
    RecordingSink,
    captured_payloads,
    fixture_text,
    json_reply,
    model_router_hashes,
    wait_for,
)
from tests.helpers import free_port as _free_port

pytestmark = pytest.mark.anyio

URL = "http://127.0.0.1:8000"


def _adapter(**options: object) -> VllmAdapter:
    return VllmAdapter.create(Backend(id="b0", url=URL, kind="vllm"), **options)


def _sources(endpoint: str, replay: str | None, topic: str = "kv") -> dict[str, object]:
    """vLLM 0.32's /kv_event_sources answer (seen on a live server, see docs/e2e-vllm.md)."""
    return {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "buffer_steps": 10000,
            "hwm": 100000,
            "max_queue_size": 100000,
            "topic": topic,
        }
    }


def _metrics_http() -> FakeHttp:
    return FakeHttp({("GET", "/metrics"): HttpReply(200, fixture_text("metrics_busy.txt").encode())})


class TestVllmAdapter:
    def test_registered_as_kind_vllm(self) -> None:
        """The entry point registers kind 'vllm' whose factory builds this adapter."""
        registration = PluginManager().backend_kinds["vllm"]
        adapter = registration.factory(Backend(id="b", url=URL, kind="vllm"))
        assert isinstance(adapter, VllmAdapter) and registration.plugin.distribution == "kvroute-vllm"

    async def test_poll_load_reports_the_event_sources_ranks(self) -> None:
        """A server whose /kv_event_sources listed 3 ranks reports a data-parallel size of 3 in its load."""
        from kvroute_tokenizer_prefix import BlockIndex
        from kvroute_vllm import VllmEventFeed

        adapter = _adapter()
        assert (await adapter.poll_load(_metrics_http())).data_parallel_size is None
        adapter.feeds = [VllmEventFeed("b0", BlockIndex(128), rank=r, size=3) for r in range(3)]
        assert (await adapter.poll_load(_metrics_http())).data_parallel_size == 3

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"kv_events": "udp://x"}, "ZMQ endpoint"),
            ({"kv_replay": 5558}, "ZMQ endpoint"),
            ({"metrics_path": "metrics"}, "starting with '/'"),
            ({"kv_ranks": 0}, "kv_ranks"),
            ({"kv_rank": 1}, "unknown option"),
        ],
    )
    def test_bad_options_are_rejected_clearly(self, options: dict[str, object], message: str) -> None:
        """Options the adapter cannot use raise ValueError saying what was expected."""
        with pytest.raises(ValueError, match=message):
            _adapter(**options)

    async def test_probe_follows_health_status(self) -> None:
        """Healthy on 200; any other status (vLLM: 503 once its engine died) fails the probe with that status."""
        assert await _adapter().probe(FakeHttp({("GET", "/health"): HttpReply(200)})) is True
        with pytest.raises(ValueError, match=r"/health answered 503$"):
            await _adapter().probe(FakeHttp({("GET", "/health"): HttpReply(503)}))
        with pytest.raises(ValueError, match="answered 500: engine error"):
            await _adapter().probe(FakeHttp({("GET", "/health"): HttpReply(500, b"engine error")}))

    async def test_models(self) -> None:
        """Served model ids come from /v1/models."""
        body = {
            "object": "list",
            "data": [{"id": "tiny-llama", "object": "model", "owned_by": "vllm", "root": "/m", "max_model_len": 8192}],
        }
        http = FakeHttp({("GET", "/v1/models"): json_reply(body)})
        assert await _adapter().list_models(http) == ["tiny-llama"]

    async def test_poll_load_reads_the_captured_metrics(self) -> None:
        """The load telemetry equals what the captured /metrics body says, stamped with a fresh time."""
        adapter = _adapter()
        load = await adapter.poll_load(_metrics_http())
        assert (load.running, load.waiting, load.block_size) == (2, 1, 128)
        assert (load.prefix_cache_queries, load.prefix_cache_hits) == (11955.0, 3200.0)
        assert load.age() < 60 and adapter.metrics is not None and adapter.metrics.num_gpu_blocks == 72

    @pytest.mark.parametrize(
        ("reply", "message"), [(HttpReply(500, b"boom"), "answered 500"), (HttpReply(200, b"\xff"), "UTF-8")]
    )
    async def test_poll_load_failures_raise_value_error(self, reply: HttpReply, message: str) -> None:
        """An unreadable /metrics raises ValueError (the health checker counts a skipped poll, the old load goes
        stale)."""
        with pytest.raises(ValueError, match=message):
            await _adapter().poll_load(FakeHttp({("GET", "/metrics"): reply}))

    async def test_restart_is_noticed_from_process_start_time(self) -> None:
        """A new process_start_time_seconds between two scrapes counts as an engine restart."""
        adapter = _adapter()
        http = _metrics_http()
        await adapter.poll_load(http)
        await adapter.poll_load(http)
        assert adapter._epoch == 0
        text = fixture_text("metrics_busy.txt").replace(
            "process_start_time_seconds 1.79599349961e+09", "process_start_time_seconds 1.8e+09"
        )
        assert text != fixture_text("metrics_busy.txt")
        http.set("GET", "/metrics", HttpReply(200, text.encode()))
        await adapter.poll_load(http)
        assert adapter._epoch == 1

    async def test_sources_discovered_from_the_engine(self) -> None:
        """A bound wildcard endpoint is reached at the backend's host, with its replay endpoint and topic."""
        http = FakeHttp({("GET", "/kv_event_sources"): json_reply(_sources("tcp://*:40161", "tcp://*:41237"))})
        assert await _adapter().sources(http) == [
            ZmqSource("tcp://127.0.0.1:40161", "kv", "tcp://127.0.0.1:41237", bind=False)
        ]

    async def test_sources_of_an_engine_that_connects(self) -> None:
        """A reported address of this machine where nothing listens: the engine connects, kvroute binds it (or
        kv_bind)."""
        free = _free_port()
        http = FakeHttp({("GET", "/kv_event_sources"): json_reply(_sources(f"tcp://127.0.0.1:{free}", None))})
        assert await _adapter().sources(http) == [ZmqSource(f"tcp://127.0.0.1:{free}", "kv", None, bind=True)]
        assert (await _adapter(kv_bind="tcp://*:5557").sources(http))[0].endpoint == "tcp://*:5557"

    async def test_sources_disabled_or_unsupported(self) -> None:
        """Events off gives no source; a server without /kv_event_sources gives None (configure kv_events)."""
        off = FakeHttp({("GET", "/kv_event_sources"): json_reply({})})
        assert await _adapter().sources(off) == []
        assert await _adapter().sources(FakeHttp()) is None
        assert await _adapter(kv_events="off").sources(off) == []

    async def test_manual_sources_offset_ports_per_rank(self) -> None:
        """Given endpoints are used without asking the engine; data-parallel ranks get vLLM's port offsets."""
        adapter = _adapter(kv_events="tcp://*:5557", kv_replay="tcp://*:5600", kv_topic="kv", kv_ranks=2)
        http = FakeHttp()
        assert await adapter.sources(http) == [
            ZmqSource("tcp://127.0.0.1:5557", "kv", "tcp://127.0.0.1:5600", bind=False, rank=0),
            ZmqSource("tcp://127.0.0.1:5558", "kv", "tcp://127.0.0.1:5601", bind=False, rank=1),
        ]
        assert http.calls == []

    async def test_malformed_sources_are_errors(self) -> None:
        """An answer that is not vLLM's shape raises ValueError naming the problem."""
        http = FakeHttp(
            {("GET", "/kv_event_sources"): json_reply({"0": {"enable_kv_cache_events": True, "endpoint": 5}})}
        )
        with pytest.raises(ValueError, match="'endpoint' string"):
            await _adapter().sources(http)

    async def test_run_events_feeds_the_index(self) -> None:
        """The event task discovers the publisher, replays its history, follows it live, and marks the backend exact."""
        payloads = captured_payloads()[:10]
        sink = RecordingSink()
        async with FakeVllmPublisher() as pub:
            port = pub.endpoint.rsplit(":", 1)[1]
            replay_port = (pub.replay_endpoint or "").rsplit(":", 1)[1]
            http = _metrics_http()
            http.set("GET", "/kv_event_sources", json_reply(_sources(f"tcp://*:{port}", f"tcp://*:{replay_port}")))
            adapter = _adapter()
            await adapter.poll_load(http)
            for payload in payloads[:2]:
                pub.store(payload)
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    await tg.start(adapter.run_events, http, sink)
                    await wait_for(lambda: bool(adapter.feeds) and adapter.feeds[0].expected == 2)
                    for payload in payloads[2:]:
                        seq = pub.store(payload)
                        await pub.send_until(seq, lambda s=seq: adapter.feeds[0].expected == s + 1)
                    assert sink.exact == {"b0": True} and sink.capacity == {"b0": 72}
                    tg.cancel_scope.cancel()
        assert sink.exact == {"b0": False}  # cancelled: back to the strategy's own records
        assert set(sink.index.holders) == model_router_hashes(payloads)
        assert adapter.stats()["kv_events"][0]["batches"] == 10

    async def test_data_parallel_ranks_feed_their_own_slots(self) -> None:
        """Two ranks listed by /kv_event_sources, one publisher each: each rank's blocks land in its slot of the
        index, the load names 2 ranks, and the backend is exact once both are followed."""
        import msgpack
        from kvroute_tokenizer_prefix import BlockIndex, block_hashes

        index = BlockIndex(128)
        tokens = [list(range(256)), list(range(7, 263))]

        def payload(rank: int) -> bytes:
            stored = {
                "type": "BlockStored",
                "block_hashes": [11, 12],
                "parent_block_hash": None,
                "token_ids": tokens[rank],
                "block_size": 128,
                "medium": "GPU",
            }
            return msgpack.packb([0.0, [stored], rank])

        async with FakeVllmPublisher() as pub0, FakeVllmPublisher() as pub1:
            answer = {}
            for rank, pub in enumerate((pub0, pub1)):
                entry = _sources("tcp://*:" + pub.endpoint.rsplit(":", 1)[1], None)["0"]
                answer[str(rank)] = {**entry, "replay_endpoint": None}
            http = _metrics_http()
            http.set("GET", "/kv_event_sources", json_reply(answer))
            adapter = _adapter()
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    await tg.start(adapter.run_events, http, index)
                    await wait_for(
                        lambda: len(adapter.subscribers) == 2 and all(s.connected for s in adapter.subscribers)
                    )
                    for rank, pub in enumerate((pub0, pub1)):
                        seq = pub.store(payload(rank))
                        await pub.send_until(seq, lambda r=rank: adapter.feeds[r].stats.batches == 1)
                    assert (await adapter.poll_load(http)).data_parallel_size == 2
                    assert index.is_exact("b0") and index.is_exact(index.slot("b0", 1))
                    tg.cancel_scope.cancel()
        slot1 = index.slot("b0", 1)
        assert index.match(block_hashes(tokens[0], 128), ["b0", slot1]) == {"b0": 2, slot1: 0}
        assert index.match(block_hashes(tokens[1], 128), ["b0", slot1]) == {"b0": 0, slot1: 2}

    async def test_run_events_restart_clears(self) -> None:
        """When the engine's start time changes, the event task forgets the backend's blocks."""
        payloads = captured_payloads()
        sink = RecordingSink()
        async with FakeVllmPublisher() as pub:
            port = pub.endpoint.rsplit(":", 1)[1]
            http = _metrics_http()
            http.set("GET", "/kv_event_sources", json_reply(_sources(f"tcp://*:{port}", None)))
            adapter = _adapter()
            await adapter.poll_load(http)
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    await tg.start(adapter.run_events, http, sink)
                    await wait_for(lambda: bool(adapter.subscribers) and adapter.subscribers[0].connected)
                    await pub.send_until(pub.store(payloads[0]), lambda: adapter.feeds[0].expected == 1)
                    assert sink.index.blocks("b0") == 16
                    text = fixture_text("metrics_busy.txt").replace(
                        "process_start_time_seconds 1.79599349961e+09", "process_start_time_seconds 1.8e+09"
                    )
                    http.set("GET", "/metrics", HttpReply(200, text.encode()))
                    await adapter.poll_load(http)
                    await wait_for(lambda: sink.index.blocks("b0") == 0)
                    tg.cancel_scope.cancel()
        assert "all_cleared" in sink.names()

    async def test_socket_errors_are_retried(self) -> None:
        """An endpoint that cannot be bound yet is logged and retried; once free, the subscription starts."""
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        adapter = _adapter(kv_events=f"tcp://127.0.0.1:{port}")  # concrete: the engine connects, kvroute binds
        sink = RecordingSink()
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                await tg.start(adapter.run_events, FakeHttp(), sink)
                await wait_for(lambda: sink.exact.get("b0") is False)  # the bind failed: back to approximate
                assert not adapter.subscribers[0].connected
                holder.close()
                await wait_for(lambda: adapter.subscribers[0].connected)
                assert sink.exact["b0"] is True
                tg.cancel_scope.cancel()

    async def test_back_off_starts_over_after_a_healthy_subscription(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Failed subscriptions wait longer each time, but one that ran for a minute before failing waits ~1 s again."""
        real_time = anyio.current_time
        skipped = 0.0  # seconds the fake clock is ahead of the event loop's
        waits: list[float] = []

        async def sleep(seconds: float) -> None:  # records the back-off instead of waiting it
            nonlocal skipped
            waits.append(seconds)
            skipped += seconds
            await anyio.lowlevel.checkpoint()

        monkeypatch.setattr(anyio, "sleep", sleep)
        monkeypatch.setattr(anyio, "current_time", lambda: real_time() + skipped)
        lasted = iter([0.0, 0.0, 0.0, 60.0, 0.0])  # how long each subscription runs before it fails
        done = anyio.Event()

        async def run(self: ZmqSubscriber, feed: object, **callbacks: object) -> None:
            nonlocal skipped
            seconds = next(lasted, None)
            if seconds is None:
                done.set()
                await anyio.sleep_forever()
            skipped += seconds or 0.0
            raise zmq.ZMQError(zmq.EADDRINUSE)

        monkeypatch.setattr(ZmqSubscriber, "run", run)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(_adapter(kv_events="tcp://127.0.0.1:5557").run_events, FakeHttp(), RecordingSink())
                await done.wait()
                tg.cancel_scope.cancel()
        assert len(waits) == 5
        assert 0.8 <= waits[0] <= 1.2 and 1.6 <= waits[1] <= 2.4 and 3.2 <= waits[2] <= 4.8
        assert 0.8 <= waits[3] <= 1.2 and 1.6 <= waits[4] <= 2.4  # the healthy run reset the series

    async def test_run_events_without_sources_returns(self) -> None:
        """With kv_events off the task returns at once and never touches the sink."""
        sink = RecordingSink()
        with anyio.fail_after(5):
            await _adapter(kv_events="off").run_events(FakeHttp(), sink)
        assert sink.calls == []

    def test_tokenizer_prefix_offers_a_sink(self) -> None:
        """The tokenizer-prefix strategy's index is what the proxy hands to run_events."""
        strategy = PluginManager().create_strategy("tokenizer-prefix", {})
        assert kv_event_sink(strategy) is getattr(strategy, "index", None) is not None
