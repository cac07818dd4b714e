"""The ZMQ subscriber against a publisher on loopback that frames and replays like vLLM's."""

from __future__ import annotations

import anyio
import pytest
from kvroute_tokenizer_prefix import BlockIndex
from kvroute_vllm import VllmEventFeed, ZmqSource, ZmqSubscriber, engine_binds, resolve_endpoint

from tests.contrib.vllm.vllm_fakes import FakeVllmPublisher, captured_payloads, model_router_hashes, wait_for

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> object:
    """asyncio, and uvloop (the proxy's loop when installed): pyzmq's asyncio sockets must work on both."""
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
        return ("asyncio", {"use_uvloop": True})
    return "asyncio"


class TestEndpoints:
    @pytest.mark.parametrize(
        ("endpoint", "binds"),
        [
            ("tcp://*:5557", True),
            ("tcp://[::]:5557", True),
            ("ipc:///tmp/kv", True),
            ("inproc://kv", True),
            ("tcp://10.0.0.2:5557", False),
            ("tcp://router.local:5557", False),
        ],
    )
    def test_engine_binds_like_vllm(self, endpoint: str, binds: bool) -> None:
        """vLLM binds wildcard, IPv6-any, ipc and inproc endpoints and connects to concrete ones."""
        assert engine_binds(endpoint) is binds

    @pytest.mark.parametrize(
        ("endpoint", "url", "expected"),
        [
            ("tcp://*:5557", "http://10.1.2.3:8000", "tcp://10.1.2.3:5557"),
            ("tcp://[::]:5557", "http://[fd00::7]:8000", "tcp://[fd00::7]:5557"),
            ("ipc:///tmp/kv", "http://10.1.2.3:8000", "ipc:///tmp/kv"),
            ("tcp://10.9.9.9:5557", "http://10.1.2.3:8000", "tcp://10.9.9.9:5557"),
        ],
    )
    def test_wildcards_resolve_to_the_backend_host(self, endpoint: str, url: str, expected: str) -> None:
        """A bound wildcard is reached at the backend's own host; other endpoints stay as they are."""
        assert resolve_endpoint(endpoint, url) == expected


async def _follow(subscriber: ZmqSubscriber, feed: VllmEventFeed, body: object) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(subscriber.run, feed)
        try:
            await body  # type: ignore[misc]
        finally:
            tg.cancel_scope.cancel()


class TestZmqSubscriber:
    async def test_history_then_live_then_gap(self) -> None:
        """Buffered batches arrive through the first replay, live ones follow, and a batch never sent live is
        replayed."""
        payloads = captured_payloads()[:10]
        index = BlockIndex(128)
        feed = VllmEventFeed("a", index)
        async with FakeVllmPublisher() as pub:
            for payload in payloads[:3]:
                pub.store(payload)
            subscriber = ZmqSubscriber(ZmqSource(pub.endpoint, "kv", pub.replay_endpoint))

            async def scenario() -> None:
                await wait_for(lambda: feed.expected == 3)
                seq = pub.store(payloads[3])
                await pub.send_until(seq, lambda: feed.expected == 4)
                pub.store(payloads[4])  # lost on the wire
                for payload in payloads[5:]:
                    seq = pub.store(payload)
                    await pub.send_until(seq, lambda s=seq: feed.expected == s + 1)

            with anyio.fail_after(30):
                await _follow(subscriber, feed, scenario())
        assert pub.replay_requests[0] == 0 and 4 in pub.replay_requests
        assert feed.stats.gaps >= 1 and feed.stats.lost_batches == 0
        assert set(index.holders) == model_router_hashes(payloads)
        assert subscriber.replays >= 2 and subscriber.decode_errors == 0

    async def test_first_replay_unanswered_then_caught_up(self) -> None:
        """When the first replay gets no answer (engine still starting), the first live batch past 0 triggers one."""
        payloads = captured_payloads()[:4]
        index = BlockIndex(128)
        feed = VllmEventFeed("a", index)
        async with FakeVllmPublisher(ignore_replays=1) as pub:
            for payload in payloads[:3]:
                pub.store(payload)
            subscriber = ZmqSubscriber(ZmqSource(pub.endpoint, "kv", pub.replay_endpoint), replay_timeout=0.3)

            async def scenario() -> None:
                await wait_for(lambda: subscriber.replay_failures == 1)
                assert feed.expected is None
                seq = pub.store(payloads[3])
                await pub.send_until(seq, lambda: feed.expected == 4)

            with anyio.fail_after(30):
                await _follow(subscriber, feed, scenario())
        assert pub.replay_requests[:2] == [0, 0] and feed.stats.lost_batches == 0
        assert set(index.holders) == model_router_hashes(payloads)

    async def test_without_replay_a_gap_is_counted(self) -> None:
        """With no replay endpoint the subscriber skips a gap, counts it, and keeps applying."""
        payloads = captured_payloads()
        feed = VllmEventFeed("a", BlockIndex(128))
        async with FakeVllmPublisher(replay=False) as pub:
            subscriber = ZmqSubscriber(ZmqSource(pub.endpoint, "kv", None))

            async def scenario() -> None:
                await pub.send_until(pub.store(payloads[0]), lambda: feed.expected == 1)
                pub.store(payloads[1])
                pub.store(payloads[2])
                await pub.send_until(pub.store(payloads[3]), lambda: feed.expected == 4)

            with anyio.fail_after(30):
                await _follow(subscriber, feed, scenario())
        assert feed.stats.lost_batches == 2 and feed.stats.batches == 2

    async def test_bind_mode_when_the_engine_connects(self) -> None:
        """When the engine's endpoint is concrete, the subscriber binds it and the engine's PUB connects."""
        payloads = captured_payloads()
        index = BlockIndex(128)
        feed = VllmEventFeed("a", index)
        subscriber = ZmqSubscriber(ZmqSource("tcp://127.0.0.1:*", "kv", None, bind=True))
        async with anyio.create_task_group() as tg:
            tg.start_soon(subscriber.run, feed)
            with anyio.fail_after(30):
                await wait_for(lambda: subscriber.bound_endpoint is not None)
                assert subscriber.bound_endpoint is not None
                async with FakeVllmPublisher(connect_to=subscriber.bound_endpoint, replay=False) as pub:
                    await pub.send_until(pub.store(payloads[0]), lambda: feed.expected == 1)
            tg.cancel_scope.cancel()
        assert set(index.holders) == model_router_hashes(payloads[:1])

    async def test_undecodable_messages_are_counted_and_skipped(self) -> None:
        """A message that is not vLLM's framing is logged and counted; the stream goes on."""
        payloads = captured_payloads()
        feed = VllmEventFeed("a", BlockIndex(128))
        async with FakeVllmPublisher(replay=False) as pub:
            subscriber = ZmqSubscriber(ZmqSource(pub.endpoint, "kv", None))

            async def scenario() -> None:
                with anyio.fail_after(10):
                    while not subscriber.decode_errors:
                        await pub.pub.send_multipart([b"kv", b"\0" * 8, b"\xc1not msgpack"])
                        await anyio.sleep(0.02)
                await pub.send_until(pub.store(payloads[0]), lambda: feed.expected == 1)

            with anyio.fail_after(30):
                await _follow(subscriber, feed, scenario())
        assert subscriber.decode_errors >= 1 and feed.stats.batches == 1
