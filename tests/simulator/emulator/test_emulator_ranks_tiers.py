"""The emulator's data-parallel ranks and CPU tier, over loopback HTTP and ZMQ, read with the vLLM adapter's parser."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import zmq
from kvroute_vllm import VllmAdapter
from kvroute_vllm.events import BlockRemoved, BlockStored, EventBatch, decode_message, decode_replay_reply
from prometheus_client.parser import text_string_to_metric_families

from kvroute import Backend
from kvroute.adapters import RANKS, HttpReply
from kvroute_server import ServerThread
from kvroute_simulator.emulator import EmulatorApp, EmulatorConfig
from kvroute_simulator.emulator.kv_events import KvEventsConfig, parse_kv_events_config
from tests.contrib.vllm.vllm_fakes import RecordingSink, wait_for
from tests.server.harness import http

EVENTS = KvEventsConfig(endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv")


def _words(tag: str, count: int = 64) -> str:
    return " ".join(f"{tag}{i}" for i in range(count))


def _chat(url: str, text: str, rank: object = None) -> tuple[int, dict[str, Any]]:
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 3}
    status, _, raw = http("POST", url + "/v1/chat/completions", body, headers=headers)
    return status, json.loads(raw)


def _stats(url: str) -> dict[str, Any]:
    return json.loads(http("GET", url + "/emulator/stats")[2])


def _replay(endpoint: str, topic: bytes = b"kv") -> list[EventBatch]:
    """Every batch a rank's replay socket holds, decoded by the vLLM adapter's own parser."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while (batch := decode_replay_reply(dealer.recv_multipart(), topic)) is not None:
            out.append(batch)
        return out
    finally:
        dealer.close(linger=0)
        ctx.term()


@pytest.fixture
def dp2() -> Iterator[ServerThread]:
    """An emulator with two data-parallel ranks publishing KV events on loopback."""
    config = EmulatorConfig(model="m", time_scale=0.01, num_gpu_blocks=256, data_parallel_size=2, kv_events=EVENTS)
    server = ServerThread(EmulatorApp(config)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def tiered() -> Iterator[ServerThread]:
    """One rank with 8 GPU blocks and a 64-block CPU tier, publishing KV events."""
    config = EmulatorConfig(model="m", time_scale=0.01, num_gpu_blocks=8, num_cpu_blocks=64, kv_events=EVENTS)
    server = ServerThread(EmulatorApp(config)).start()
    try:
        yield server
    finally:
        server.stop()


class TestDataParallelRanks:
    def test_header_routes_to_the_rank(self, dp2: ServerThread) -> None:
        """X-data-parallel-rank: 1 sends the request to rank 1, whose own cache then hits; rank 0's does not."""
        assert _chat(dp2.url, _words("a"), rank=1)[0] == 200
        _, again = _chat(dp2.url, _words("a"), rank=1)
        _, other = _chat(dp2.url, _words("a"), rank=0)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        ranks = _stats(dp2.url)["ranks"]
        assert [r["requests"] for r in ranks] == [1, 2]
        assert [r["routed"] for r in ranks] == [1, 2]
        assert [r["hit_tokens"] for r in ranks] == [0, 64]

    def test_out_of_range_rank_is_refused(self, dp2: ServerThread) -> None:
        """A rank outside 0..size-1 gets 400 with vLLM's message; nothing reaches an engine."""
        for rank in (2, -1):
            status, body = _chat(dp2.url, "hello", rank=rank)
            assert status == 400
            assert body["error"]["message"] == f"data_parallel_rank {rank} is out of range [0, 2)."
        assert _stats(dp2.url)["requests"] == 0

    def test_non_integer_rank_is_ignored(self, dp2: ServerThread) -> None:
        """A header that is not an integer is ignored, as vLLM ignores it: the balancer places the request."""
        assert _chat(dp2.url, "hello", rank="one")[0] == 200
        ranks = _stats(dp2.url)["ranks"]
        assert [r["balanced"] for r in ranks] == [1, 0] and [r["routed"] for r in ranks] == [0, 0]

    def test_event_sources_list_every_rank(self, dp2: ServerThread) -> None:
        """/kv_event_sources lists one publisher per rank, each with its own endpoint and replay endpoint."""
        sources = json.loads(http("GET", dp2.url + "/kv_event_sources")[2])["sources"]
        assert [s["data_parallel_rank"] for s in sources] == [0, 1]
        assert len({s["endpoint"] for s in sources}) == 2 and all(s["topic"] == "kv" for s in sources)
        assert all(s["endpoint"].startswith("tcp://127.0.0.1:") for s in sources)
        assert all(s["replay_endpoint"].startswith("tcp://127.0.0.1:") for s in sources)

    def test_events_carry_the_rank(self, dp2: ServerThread) -> None:
        """A request on rank 1 is published by rank 1's socket, in batches the adapter decodes with rank 1."""
        sources = json.loads(http("GET", dp2.url + "/kv_event_sources")[2])["sources"]
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.setsockopt(zmq.RCVTIMEO, 200)
        try:
            sub.connect(sources[1]["endpoint"])
            live: list[EventBatch] = []
            for i in range(25):  # a SUB socket misses what is published before it joined: send until one arrives
                _chat(dp2.url, _words(f"live{i}-"), rank=1)
                try:
                    live.append(decode_message(sub.recv_multipart(), b"kv"))
                    break
                except zmq.Again:
                    continue
        finally:
            sub.close(linger=0)
            ctx.term()
        assert live and live[0].data_parallel_rank == 1
        replayed = _replay(sources[1]["replay_endpoint"])
        assert replayed and all(b.data_parallel_rank == 1 for b in replayed)
        assert [b.seq for b in replayed] == list(range(len(replayed)))
        stored = [e for b in replayed for e in b.events if isinstance(e, BlockStored)]
        assert stored and all(e.medium == "GPU" and len(e.token_ids) == 16 * len(e.block_hashes) for e in stored)
        assert _replay(sources[0]["replay_endpoint"]) == []

    def test_metrics_per_rank(self, dp2: ServerThread) -> None:
        """/metrics has every family per rank (label engine) and counts a rank's hits on that rank only."""
        _chat(dp2.url, _words("m"), rank=1)
        _chat(dp2.url, _words("m"), rank=1)
        text = http("GET", dp2.url + "/metrics")[2].decode()
        samples = {
            (s.name, s.labels.get("engine")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert samples[("vllm:num_requests_running", "0")] == 0 and ("vllm:num_requests_running", "1") in samples
        assert samples[("vllm:prefix_cache_hits_total", "1")] == 64
        assert samples[("vllm:prefix_cache_hits_total", "0")] == 0
        assert ("vllm:cache_config_info", "1") in samples

    def test_balancer_spreads_concurrent_requests(self) -> None:
        """Without a header, requests waiting at once spread over the ranks (lowest 4 x waiting + running)."""
        config = EmulatorConfig(model="m", time_scale=20.0, num_gpu_blocks=256, data_parallel_size=2)
        server = ServerThread(EmulatorApp(config)).start()
        try:
            # Slowed down twenty times, each request stays in its rank for ~1 s: the others arrive meanwhile.
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: _chat(server.url, _words(f"c{i}-", 400)), range(4)))
            ranks = _stats(server.url)["ranks"]
        finally:
            server.stop()
        assert sum(r["balanced"] for r in ranks) == 4 and all(r["balanced"] >= 1 for r in ranks)


class TestCpuTier:
    def test_eviction_and_cpu_hit(self, tiered: ServerThread) -> None:
        """A block the GPU evicts is published GPU-removed then CPU-stored; asking for it again is a CPU hit."""
        for tag in "abcd":
            _chat(tiered.url, _words(tag))
        _, again = _chat(tiered.url, _words("a"))
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        engine = _stats(tiered.url)["engine"]
        assert engine["cpu_hit_tokens"] == 64 and engine["gpu_hit_tokens"] == 0 and engine["reload_time"] > 0
        source = json.loads(http("GET", tiered.url + "/kv_event_sources")[2])["sources"][0]
        events = [e for b in _replay(source["replay_endpoint"]) for e in b.events]
        first = next(e for e in events if isinstance(e, BlockStored))
        head = first.block_hashes[0]  # the first block of prompt "a"

        def where(kind: type, medium: str) -> list[int]:
            return [
                i
                for i, e in enumerate(events)
                if isinstance(e, kind) and e.medium == medium and head in e.block_hashes  # type: ignore[attr-defined]
            ]

        gpu_removed, cpu_stored = where(BlockRemoved, "GPU"), where(BlockStored, "CPU")
        cpu_removed, gpu_stored = where(BlockRemoved, "CPU"), where(BlockStored, "GPU")
        assert gpu_removed and cpu_stored and gpu_removed[0] < cpu_stored[0]
        offloaded = events[cpu_stored[0]]
        assert isinstance(offloaded, BlockStored) and offloaded.token_ids[:16] == first.token_ids[:16]
        assert offloaded.parent_block_hash is None
        # The hit copies the block back: CPU-removed, then GPU-stored again.
        assert cpu_removed and cpu_removed[0] > cpu_stored[0] and gpu_stored[-1] > cpu_removed[0]
        text = http("GET", tiered.url + "/metrics")[2].decode()
        assert 'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 64.0' in text

    def test_no_tier_no_external_metrics(self) -> None:
        """Without a CPU tier /metrics has no external prefix cache families (as vLLM without a connector)."""
        server = ServerThread(EmulatorApp(EmulatorConfig(model="m", time_scale=0.01, num_gpu_blocks=64))).start()
        try:
            text = http("GET", server.url + "/metrics")[2].decode()
            sources = json.loads(http("GET", server.url + "/kv_event_sources")[2])
        finally:
            server.stop()
        assert "external_prefix_cache" not in text and sources == {"sources": []}


class TestKvEventsConfig:
    def test_parses_vllm_keys(self) -> None:
        """--kv-events-config takes vLLM's JSON keys."""
        config = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "topic": "t"}')
        assert config.endpoint == "tcp://*:0" and config.topic == "t" and config.replay_endpoint is None

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            ("[1]", "must be a JSON object"),
            ('{"endpoint": "http://x"}', "'endpoint' must be a ZMQ endpoint"),
            ('{"bogus": 1}', "unknown key(s) bogus"),
            ('{"buffer_steps": 0}', "'buffer_steps' must be a positive integer"),
        ],
    )
    def test_refuses_bad_config(self, text: str, message: str) -> None:
        """A bad --kv-events-config is refused with a message naming what is wrong."""
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_kv_events_config(text)


class _LoopbackHttp:
    """An `HttpGetter` over real loopback HTTP (urllib in a worker thread)."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def get(self, path: str) -> HttpReply:
        status, _, body = await anyio.to_thread.run_sync(lambda: http("GET", self.url + path))
        return HttpReply(status, body)


class TestVllmAdapterOnEmulator:
    @pytest.mark.anyio
    async def test_adapter_follows_each_rank(self, dp2: ServerThread) -> None:
        """The vLLM adapter finds both ranks at /kv_event_sources and indexes rank 1's blocks under rank 1."""
        adapter = VllmAdapter.create(Backend(id="b0", url=dp2.url, kind="vllm"))
        sink = RecordingSink(block_size=16)
        getter = _LoopbackHttp(dp2.url)
        await adapter.poll_load(getter)
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                await tg.start(adapter.run_events, getter, sink)
                await wait_for(lambda: len(adapter.subscribers) == 2 and all(s.connected for s in adapter.subscribers))
                await wait_for(lambda: all(f.expected is not None for f in adapter.feeds), 15)
                await anyio.to_thread.run_sync(lambda: _chat(dp2.url, _words("adapter"), rank=1))
                await wait_for(lambda: any(n == "blocks_stored" for n in sink.names()), 15)
                tg.cancel_scope.cancel()
        assert [s.source.rank for s in adapter.subscribers] == [0, 1]
        stored = [kw for name, _, kw in sink.calls if name == "blocks_stored"]
        keys = [k for kw in stored for k in kw["engine_hashes"]]
        assert keys and all(k % RANKS == 1 for k in keys)
