"""What vLLM releases really send, replayed from their own publisher code (fixtures/capture_publisher.py).

Covers: KV cache kinds (MLA indexed, sliding window decided, unknown kinds
warned and inexact), batch and replay shapes of the supported releases, the endpoints
``/kv_event_sources`` reports (bind or connect), and an exact flag that is true only while no
event could have been skipped or lost.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import msgpack
import pytest
from kvroute_tokenizer_prefix import BlockIndex, block_hashes
from kvroute_vllm import (
    INDEXED_KINDS,
    WINDOW_KINDS,
    BlockStored,
    EventBatch,
    VllmAdapter,
    VllmEventFeed,
    ZmqSource,
    ZmqSubscriber,
    decode_batch,
    decode_message,
    decode_replay_reply,
    locate_publisher,
)
from structlog.testing import capture_logs

from kvroute import Backend
from kvroute.adapters import ExactFlag
from tests.contrib.vllm.vllm_fakes import (
    FakeHttp,
    FakeVllmPublisher,
    RecordingSink,
    captured_payloads,
    json_reply,
    model_router_hashes,
    publisher_capture,
    wait_for,
)
from tests.helpers import free_port as unused_port

BS = 16
RELEASES = ["0.23.0", "0.25.0", "0.31.0", "0.32.0", "0.33.0"]
#: The ten kinds of vLLM 0.23-0.33's KVCacheSpecKind, and what the feed does with each (None: older servers, no kind).
VLLM_KINDS: dict[str | None, str] = {
    None: "indexed",
    "full_attention": "indexed",
    "mla_attention": "indexed",
    "sink_full_attention": "indexed",
    "sliding_window": "not indexed",
    "sliding_window_mla": "not indexed",
    "chunked_local_attention": "not indexed",
    "mamba": "not indexed",
    "encoder_only_attention": "not indexed",
    "cross_attention": "not indexed",
    "unknown": "unknown",
}


def _live(capture: str, scenario: str) -> list[EventBatch]:
    return [decode_message(frames, b"kv") for frames in publisher_capture(capture)["scenarios"][scenario]["live"]]


def _feed(sink: RecordingSink | None = None, **kwargs: Any) -> tuple[VllmEventFeed, RecordingSink]:
    sink = sink or RecordingSink(block_size=BS)
    return VllmEventFeed("b0", sink, **kwargs), sink


def _tokens(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


def _store(hashes: list[int], tokens: list[int], parent: int | None = None, **fields: object) -> dict[str, object]:
    """A BlockStored as vLLM 0.25+ encodes it (a map tagged by type; fields equal to their default left out)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **fields,
    }


def _batch(seq: int, *events: dict[str, object]) -> EventBatch:
    return decode_batch(seq, msgpack.packb([1.0, list(events), 0]))


def _inexact_logs(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "kv_index_inexact"]


class TestPublisherCaptures:
    @pytest.mark.parametrize("release", RELEASES)
    def test_live_messages_of_each_release_decode(self, release: str) -> None:
        """Each release's live messages (positional events up to 0.23, tagged maps after) decode to the MLA stores
        sent."""
        batches = _live(release, "mla")
        assert [b.seq for b in batches] == [0, 1, 2]
        first = batches[0].events[0]
        assert isinstance(first, BlockStored)
        assert (first.block_size, first.group_idx, first.kv_cache_spec_kind, first.parent_block_hash) == (
            BS,
            0,
            "mla_attention",
            None,
        )
        assert list(first.token_ids) == _tokens(1000, 2) and first.block_hashes[0] > 2**63

    def test_map_shaped_batch_decodes_like_the_array_batch(self) -> None:
        """A build whose EventBatch is a msgpack map gives the same batches as the released array layout."""
        for scenario in ("mla", "hybrid_sliding_window", "unknown_kinds"):
            as_map = publisher_capture("0.33.0-map-batch")["scenarios"][scenario]["live"]
            assert all(isinstance(msgpack.unpackb(m[2], strict_map_key=False), dict) for m in as_map)
            mapped = [decode_message(m, b"kv") for m in as_map]
            assert [(b.seq, b.events, b.data_parallel_rank) for b in mapped] == [
                (b.seq, b.events, b.data_parallel_rank) for b in _live("0.33.0", scenario)
            ]

    @pytest.mark.parametrize(
        ("release", "frames"), [("0.23.0", 3), ("0.25.0", 3), ("0.31.0", 4), ("0.32.0", 4), ("0.33.0", 4)]
    )
    def test_replay_replies_of_each_release_decode(self, release: str, frames: int) -> None:
        """Replay replies without the topic frame (before 0.26) and with it decode to the live batches, then the end
        marker."""
        scenario = publisher_capture(release)["scenarios"]["mla"]
        assert {len(r) for r in scenario["replay_reply"]} == {frames}
        *replies, end = [decode_replay_reply(r, b"kv") for r in scenario["replay_reply"]]
        assert end is None
        assert [(b.seq, b.events) for b in replies if b is not None] == [
            (b.seq, b.events) for b in _live(release, "mla")
        ]

    def test_replay_reply_on_another_topic_is_refused(self) -> None:
        """A four-frame reply naming another topic is an EventFormatError that says which topic it got."""
        reply = publisher_capture("0.33.0")["scenarios"]["mla"]["replay_reply"][0]
        with pytest.raises(ValueError, match="topic b'other'"):
            decode_replay_reply(reply, b"other")


class TestCacheKinds:
    def test_mla_model_is_indexed(self) -> None:
        """vLLM's own MLA stores (DeepSeek-style) enter the index and removals leave it; nothing is lost."""
        feed, sink = _feed()
        batches = _live("0.33.0", "mla")
        for batch in batches[:2]:
            assert feed.receive(batch) is None
        prompt = block_hashes(_tokens(1000, 2) + _tokens(2000, 1), BS)
        assert sink.index.match(prompt, ["b0"]) == {"b0": 3}
        assert (feed.stats.blocks_stored, feed.stats.skipped_events, feed.lost_reason) == (3, 0, None)
        feed.receive(batches[2])
        assert sink.index.match(prompt, ["b0"]) == {"b0": 2} and "set_exact" not in sink.names()

    def test_hybrid_model_follows_the_full_attention_group(self) -> None:
        """With a full-attention group beside it, the sliding-window group's stores and removals are ignored, not
        lost."""
        feed, sink = _feed()
        for batch in _live("0.33.0", "hybrid_sliding_window"):
            feed.receive(batch)
        assert sink.index.match(block_hashes(_tokens(1000, 2), BS), ["b0"]) == {"b0": 2}
        assert (feed.stats.ignored_events, feed.lost_reason, feed.stats.inexact_reasons) == (2, None, {})

    def test_sliding_window_only_model_is_inexact(self) -> None:
        """A model whose only group is sliding-window attention leaves the index without its blocks: inexact, said
        once."""
        feed, sink = _feed()
        with capture_logs() as logs:
            feed.receive(_live("0.33.0", "sliding_window_only")[0])
        assert (feed.stats.blocks_stored, sink.exact, sink.reasons) == (
            0,
            {"b0": False},
            {"b0": "cache_kind_not_indexed"},
        )
        assert [(e["backend"], e["reason"]) for e in _inexact_logs(logs)] == [("b0", "cache_kind_not_indexed")]

    def test_unknown_kinds_warn_once_each_and_make_the_index_inexact(self) -> None:
        """vLLM's 'unknown' and a kind added later: one warning per kind, every skipped store counted, one inexact
        log."""
        feed, sink = _feed()
        batches = _live("0.33.0", "unknown_kinds")
        with capture_logs() as logs:
            for batch in batches[:3]:
                feed.receive(batch)
        warned = [e["kind"] for e in logs if e["event"] == "kv_events_unknown_cache_kind"]
        assert warned == ["unknown", "compressed_latent_attention"]
        assert feed.stats.inexact_reasons == {"unknown_cache_kind": 3} and feed.stats.inexact == 1
        assert (
            len(_inexact_logs(logs)) == 1 and sink.exact == {"b0": False} and sink.reasons["b0"] == "unknown_cache_kind"
        )
        assert sink.index.match(block_hashes(_tokens(1000, 1), BS), ["b0"]) == {
            "b0": 1
        }  # the full-attention store still counts
        feed.receive(batches[3])  # AllBlocksCleared: engine and index are empty alike
        assert sink.exact == {"b0": True} and feed.lost_reason is None

    @pytest.mark.parametrize(("kind", "decision"), list(VLLM_KINDS.items()))
    def test_every_vllm_kind_has_a_decision(self, kind: str | None, decision: str) -> None:
        """Each of vLLM's kinds is indexed, ignored as a window-like group (inexact when alone) or unknown (inexact)."""
        assert (kind in INDEXED_KINDS, kind in WINDOW_KINDS) == (decision == "indexed", decision == "not indexed")
        feed, sink = _feed()
        fields = {"group_idx": 0} if kind is None else {"group_idx": 0, "kv_cache_spec_kind": kind}
        feed.receive(_batch(0, _store([7], _tokens(0, 1), **fields)))
        stored, lost = sink.index.blocks("b0"), feed.lost_reason
        assert (stored, lost) == {
            "indexed": (1, None),
            "not indexed": (0, "cache_kind_not_indexed"),
            "unknown": (0, "unknown_cache_kind"),
        }[decision]


class _RejectingSink(RecordingSink):
    def blocks_stored(self, backend: str, token_ids: Any, **kw: Any) -> list[int]:
        raise ValueError("refused by the sink")


def _lora_without_name(feed: VllmEventFeed) -> None:
    feed.receive(_batch(0, _store([1], _tokens(0, 1), lora_id=3)))


def _gap_with_failed_replay(feed: VllmEventFeed) -> None:
    feed.receive(_batch(0, _store([1], _tokens(0, 1))))
    gap = feed.receive(_batch(3, _store([2], _tokens(100, 1))))
    assert gap is not None
    feed.replayed([], complete=False)  # the replay socket did not answer
    feed.skip_gap(gap)


def _unknown_kind(feed: VllmEventFeed) -> None:
    feed.receive(_batch(0, _store([1], _tokens(0, 1), group_idx=0, kv_cache_spec_kind="paged_sparse_attention")))


def _window_only(feed: VllmEventFeed) -> None:
    feed.receive(_batch(0, _store([1], _tokens(0, 1), group_idx=0, kv_cache_spec_kind="sliding_window")))


def _unknown_event_type(feed: VllmEventFeed) -> None:
    feed.receive(_batch(0, {"type": "BlockMigrated", "block_hashes": [1]}))


def _history_incomplete(feed: VllmEventFeed) -> None:
    feed.replayed([_batch(40, _store([1], _tokens(0, 1)))], complete=True)  # the buffer no longer reaches batch 0


def _unknown_parent(feed: VllmEventFeed) -> None:
    feed.receive(_batch(0, _store([5], _tokens(0, 1), parent=99)))


def _malformed_store(feed: VllmEventFeed) -> None:
    feed.receive(_batch(0, _store([1, 2], _tokens(0, 1))))


def _lookahead(feed: VllmEventFeed) -> None:
    feed.receive(_batch(0, _store([1], _tokens(0, 1), lookahead_token_ids=[[5, 6]])))


def _held_dropped(feed: VllmEventFeed) -> None:
    feed.sink.index.reset(8)  # type: ignore[attr-defined]  # the strategy hashes blocks of another size
    for seq in range(3):
        feed.receive(_batch(seq, _store([seq + 1], _tokens(seq * 100, 1))))


LOSS_PATHS: dict[str, Callable[[VllmEventFeed], None]] = {
    "lora_without_name": _lora_without_name,
    "lost_batches": _gap_with_failed_replay,
    "unknown_cache_kind": _unknown_kind,
    "cache_kind_not_indexed": _window_only,
    "unknown_event_type": _unknown_event_type,
    "history_incomplete": _history_incomplete,
    "unknown_parent": _unknown_parent,
    "malformed_store": _malformed_store,
    "lookahead_hashing": _lookahead,
    "held_batches_dropped": _held_dropped,
}


class TestExactness:
    @pytest.mark.parametrize("reason", list(LOSS_PATHS))
    def test_each_loss_path_makes_the_index_inexact(self, reason: str) -> None:
        """Every way an event can be skipped or lost sets exact to false with its reason, counts it and logs
        kv_index_inexact."""
        feed, sink = _feed(max_held=1)
        with capture_logs() as logs:
            LOSS_PATHS[reason](feed)
        assert sink.exact == {"b0": False} and sink.reasons == {"b0": reason}
        assert feed.stats.inexact == 1 and feed.stats.inexact_reasons.get(reason, 0) >= 1
        assert [(e["backend"], e["reason"], e["log_level"]) for e in _inexact_logs(logs)] == [("b0", reason, "warning")]

    def test_sink_without_a_reason_keyword_goes_inexact_too(self) -> None:
        """A sink whose set_exact takes no reason (the tokenizer-prefix BlockIndex today) is still told, without one."""
        index = BlockIndex(BS)
        index.set_exact("b0", True)
        feed = VllmEventFeed("b0", index)
        _unknown_kind(feed)
        assert not index.is_exact("b0") and feed.lost_reason == "unknown_cache_kind"

    def test_rejected_store_makes_the_index_inexact(self) -> None:
        """A store the sink refuses (ValueError) is a loss like any other."""
        feed, sink = _feed(_RejectingSink(block_size=BS))
        feed.receive(_batch(0, _store([1], _tokens(0, 1))))
        assert sink.reasons == {"b0": "rejected_store"} and feed.stats.rejected_events == 1

    def test_deliberate_skips_are_not_losses(self) -> None:
        """CPU-tier blocks, another group of an indexed kind and multimodal blocks (with their descendants) keep the
        index exact."""
        feed, sink = _feed()
        feed.receive(_batch(0, _store([1], _tokens(0, 1), group_idx=0, kv_cache_spec_kind="full_attention")))
        feed.receive(
            _batch(
                1,
                _store([2], _tokens(0, 1), medium="CPU"),
                _store([3], _tokens(0, 1), group_idx=1, kv_cache_spec_kind="mla_attention"),
            )
        )
        feed.receive(
            _batch(2, _store([4, 5], _tokens(50, 2), parent=1, group_idx=0, extra_keys=[None, [["img-hash", 0]]]))
        )
        feed.receive(
            _batch(3, _store([6], _tokens(500, 1), parent=5, group_idx=0))
        )  # continues after the image: not an orphan
        assert (feed.lost_reason, feed.stats.orphan_events, "set_exact" in sink.names()) == (None, 0, False)
        assert sink.index.blocks("b0") == 2 and feed.stats.ignored_events == 3

    def test_flag_needs_every_rank_subscribed(self) -> None:
        """With two ranks the backend is exact only once both subscribe; a rank losing events makes it inexact."""
        sink = RecordingSink(block_size=BS)
        flag = ExactFlag("b0", sink)
        rank0, rank1 = (VllmEventFeed("b0", sink, rank=r, exact_flag=flag) for r in (0, 1))
        flag.subscribed(rank0, True)
        assert (sink.exact, sink.reasons) == ({"b0": False}, {"b0": "not_subscribed"})
        flag.subscribed(rank1, True)
        assert sink.exact == {"b0": True} and rank0.needs_resync and not rank1.needs_resync
        rank1.receive(_batch(0, _store([1], _tokens(0, 1), lora_id=2)))
        assert (sink.exact, sink.reasons) == ({"b0": False}, {"b0": "lora_without_name"})
        flag.close()
        assert sink.exact == {"b0": False}

    @pytest.mark.anyio
    async def test_resync_rebuilds_from_the_replay_buffer(self) -> None:
        """When the sink forgot the backend's blocks (another rank made it exact again), the subscriber replays from
        0."""
        payloads = captured_payloads()[:3]
        sink = RecordingSink()
        feed = VllmEventFeed("b0", sink)
        async with FakeVllmPublisher() as pub:
            for payload in payloads:
                pub.store(payload)
            subscriber = ZmqSubscriber(ZmqSource(pub.endpoint, "kv", pub.replay_endpoint), wake_every=0.05)
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(subscriber.run, feed)
                    await wait_for(lambda: feed.expected == 3)
                    sink.index.set_exact("b0", True)  # what a switch back to exact does: the index drops the backend
                    assert sink.index.blocks("b0") == 0
                    feed.needs_resync = True
                    await wait_for(
                        lambda: len(pub.replay_requests) == 2 and not feed.needs_resync and feed.expected == 3
                    )
                    tg.cancel_scope.cancel()
        assert pub.replay_requests == [0, 0] and feed.lost_reason is None
        assert set(sink.index.holders) == model_router_hashes(payloads)

    @pytest.mark.anyio
    async def test_gap_with_failed_replay_through_the_subscriber(self) -> None:
        """On the wire: a batch never sent live and a replay socket that does not answer end in an inexact backend."""
        payloads = captured_payloads()
        sink = RecordingSink()
        flag = ExactFlag("b0", sink)
        feed = VllmEventFeed("b0", sink, exact_flag=flag)
        async with FakeVllmPublisher(ignore_replays=100) as pub:
            subscriber = ZmqSubscriber(ZmqSource(pub.endpoint, "kv", pub.replay_endpoint), replay_timeout=0.2)
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: subscriber.run(feed, on_connected=lambda: flag.subscribed(feed, True)))
                    await pub.send_until(pub.store(payloads[0]), lambda: feed.expected == 1)
                    assert sink.exact == {"b0": True}
                    pub.store(payloads[1])  # lost on the wire
                    await pub.send(pub.store(payloads[2]))  # once: vLLM never sends a sequence number twice
                    await wait_for(lambda: feed.expected == 3)
                    tg.cancel_scope.cancel()
        assert (sink.exact, sink.reasons) == ({"b0": False}, {"b0": "lost_batches"})
        assert feed.stats.lost_batches == 1 and subscriber.replay_failures >= 1


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A loopback port something listens on (as a publisher vLLM bound)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.fixture(name="free_port")
def free_port_fixture() -> int:
    """A loopback port nothing listens on."""
    return unused_port()


def _reported(endpoint: str, replay: str | None, form: str) -> object:
    """``/kv_event_sources`` in each form: 0.31-0.33's config keyed by rank (as captured), or the list forms of newer
    builds."""
    config = dict(publisher_capture("0.33.0")["scenarios"]["mla"]["kv_event_sources"]["0"])
    config.update(endpoint=endpoint, replay_endpoint=replay)
    entry = {"data_parallel_rank": 0, "endpoint": endpoint, "replay_endpoint": replay, "topic": "kv"}
    return {"dict": {"0": config}, "list": [entry], "envelope": {"sources": [entry]}}[form]


def _adapter(url: str = "http://127.0.0.1:8000", **options: object) -> VllmAdapter:
    return VllmAdapter.create(Backend(id="b0", url=url, kind="vllm"), **options)


class TestReportedEndpoints:
    def test_captured_sources_report_the_resolved_address(self) -> None:
        """vLLM 0.31-0.33 configured with tcp://*:0 report tcp://<node-ip>:<port>: a concrete address the engine
        bound."""
        for release in ("0.31.0", "0.32.0", "0.33.0"):
            scenario = publisher_capture(release)["scenarios"]["mla"]
            reported = scenario["kv_event_sources"]["0"]
            assert scenario["configured_endpoint"] == "tcp://*:0" and reported["endpoint"].startswith(
                "tcp://127.0.0.1:"
            )
            assert (
                reported["replay_endpoint"].startswith("tcp://127.0.0.1:")
                and reported["enable_kv_cache_events"] is True
            )

    @pytest.mark.anyio
    @pytest.mark.parametrize("form", ["dict", "list", "envelope"])
    async def test_resolved_wildcard_port_is_connected_to(self, form: str) -> None:
        """A resolved tcp://127.0.0.1:<port> for a '*:0' config: kvroute connects (never binds), events flow, exact."""
        payloads = captured_payloads()[:3]
        sink = RecordingSink()
        async with FakeVllmPublisher(bind="tcp://127.0.0.1:0") as pub:
            http = FakeHttp(
                {("GET", "/kv_event_sources"): json_reply(_reported(pub.endpoint, pub.replay_endpoint, form))}
            )
            adapter = _adapter()
            assert await adapter.sources(http) == [ZmqSource(pub.endpoint, "kv", pub.replay_endpoint, bind=False)]
            pub.store(payloads[0])
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    await tg.start(adapter.run_events, http, sink)
                    await wait_for(lambda: bool(adapter.feeds) and adapter.feeds[0].expected == 1)
                    for payload in payloads[1:]:
                        seq = pub.store(payload)
                        await pub.send_until(seq, lambda s=seq: adapter.feeds[0].expected == s + 1)
                    assert sink.exact == {"b0": True} and adapter.stats()["kv_events"][0]["exact"] is True
                    tg.cancel_scope.cancel()
        assert set(sink.index.holders) == model_router_hashes(payloads)

    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("reported", "url", "kv_bind", "expected"),
        [
            ("tcp://*:5557", "http://10.1.2.3:8000", None, ("tcp://10.1.2.3:5557", False)),
            ("tcp://[::]:5557", "http://[fd00::7]:8000", None, ("tcp://[fd00::7]:5557", False)),
            ("tcp://0.0.0.0:41001", "http://10.1.2.3:8000", None, ("tcp://10.1.2.3:41001", False)),
            ("ipc:///tmp/kv-events", "http://10.1.2.3:8000", None, ("ipc:///tmp/kv-events", False)),
            ("inproc://kv", "http://10.1.2.3:8000", None, ("inproc://kv", False)),
            ("tcp://10.0.0.9:41001", "http://10.1.2.3:8000", None, ("tcp://10.0.0.9:41001", False)),
            ("tcp://10.0.0.9:5557", "http://10.1.2.3:8000", "tcp://*:5557", ("tcp://*:5557", True)),
            ("tcp://10.1.2.3:41001", "http://10.1.2.3:8000", "tcp://*:5557", ("tcp://10.1.2.3:41001", False)),
        ],
    )
    async def test_remote_and_wildcard_forms(
        self, reported: str, url: str, kv_bind: str | None, expected: tuple[str, bool]
    ) -> None:
        """Wildcards are reached at the backend's host; a concrete address elsewhere is the engine's unless kv_bind says
        it connects."""
        assert await locate_publisher(reported, url, kv_bind=kv_bind) == expected

    @pytest.mark.anyio
    async def test_local_address_someone_listens_on_is_connected_to(self, listening_port: int) -> None:
        """An address of this machine with a listener: the engine bound it, kvroute connects."""
        reported = f"tcp://127.0.0.1:{listening_port}"
        assert await locate_publisher(reported, "http://127.0.0.1:8000") == (reported, False)

    @pytest.mark.anyio
    async def test_local_address_nobody_listens_on_is_bound(self, free_port: int) -> None:
        """An address of this machine without a listener: the engine connects to the router, kvroute binds it (or
        kv_bind)."""
        reported = f"tcp://127.0.0.1:{free_port}"
        assert await locate_publisher(reported, "http://127.0.0.1:8000") == (reported, True)
        assert await locate_publisher(reported, "http://127.0.0.1:8000", kv_bind="tcp://*:6000") == (
            "tcp://*:6000",
            True,
        )

    @pytest.mark.anyio
    async def test_unresolved_port_is_an_error(self) -> None:
        """A server reporting 'tcp://*:0' as configured cannot be reached: the error says why and what to do."""
        http = FakeHttp({("GET", "/kv_event_sources"): json_reply(_reported("tcp://*:0", None, "dict"))})
        with pytest.raises(ValueError, match=r"\['0'\].*without the port it bound"):
            await _adapter().sources(http)
        with pytest.raises(ValueError, match="no fixed port"):
            _adapter(kv_events="tcp://*:0")

    @pytest.mark.anyio
    async def test_body_forms_give_the_same_sources_in_rank_order(self) -> None:
        """The rank-keyed object, the bare list and the {"sources": [...]} envelope describe the same publishers."""
        entries = [
            {"data_parallel_rank": 1, "endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:5601", "topic": "kv"},
            {"data_parallel_rank": 0, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600", "topic": "kv"},
        ]
        forms = [
            {str(e["data_parallel_rank"]): {**e, "enable_kv_cache_events": True, "publisher": "zmq"} for e in entries},
            entries,
            {"sources": entries},
        ]
        expected = [
            ZmqSource("tcp://127.0.0.1:5557", "kv", "tcp://127.0.0.1:5600", bind=False, rank=0),
            ZmqSource("tcp://127.0.0.1:5558", "kv", "tcp://127.0.0.1:5601", bind=False, rank=1),
        ]
        for body in forms:
            assert await _adapter().sources(FakeHttp({("GET", "/kv_event_sources"): json_reply(body)})) == expected


class TestOldReplayFormat:
    @pytest.mark.anyio
    async def test_three_frame_replies_fill_history_and_gaps(self) -> None:
        """Replies without a topic frame (vLLM before 0.26) replay the history and fill a gap: nothing lost, exact."""
        payloads = captured_payloads()[:6]
        sink = RecordingSink()
        flag = ExactFlag("b0", sink)
        feed = VllmEventFeed("b0", sink, exact_flag=flag)
        async with FakeVllmPublisher(replay_topic=False) as pub:
            for payload in payloads[:3]:
                pub.store(payload)
            subscriber = ZmqSubscriber(ZmqSource(pub.endpoint, "kv", pub.replay_endpoint))
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: subscriber.run(feed, on_connected=lambda: flag.subscribed(feed, True)))
                    await wait_for(lambda: feed.expected == 3)
                    pub.store(payloads[3])  # lost on the wire
                    for payload in payloads[4:]:
                        seq = pub.store(payload)
                        await pub.send_until(seq, lambda s=seq: feed.expected == s + 1)
                    tg.cancel_scope.cancel()
        assert (subscriber.replay_failures, subscriber.decode_errors, feed.stats.lost_batches) == (0, 0, 0)
        assert sink.exact == {"b0": True} and set(sink.index.holders) == model_router_hashes(payloads)
