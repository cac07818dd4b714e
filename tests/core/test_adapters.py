"""The shared adapter base in kvroute.adapters: the OpenAI-compatible adapter, engine metrics, and the KV event feed."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from kvroute import Backend, EngineLoad, loops
from kvroute.adapters import (
    RANKS,
    Backoff,
    Closes,
    EngineMetrics,
    ExactFlag,
    HttpReply,
    KeepAlive,
    KvEventFeed,
    KvEventSink,
    ListsModels,
    OpenAIAdapter,
    PollsLoad,
    Probes,
    StreamsEvents,
    check_path,
    keep_alive,
    prometheus_subset,
    rank_key,
    set_backend_capacity,
    set_backend_exact,
)

BACKEND = Backend(id="b0", url="http://127.0.0.1:1")


class FakeHttp:
    """An `HttpGetter` answering one reply per path (404 for any other), recording the paths asked."""

    def __init__(self, replies: dict[str, HttpReply]) -> None:
        self.replies = replies
        self.asked: list[str] = []

    async def get(self, path: str) -> HttpReply:
        self.asked.append(path)
        return self.replies.get(path, HttpReply(404))


class Sink:
    """A `KvEventSink` that records what it is told (``set_exact`` with its reason, clears, stores)."""

    def __init__(self, block_size: int = 4) -> None:
        self.block_size = block_size
        self.exact: list[tuple[bool, str | None]] = []
        self.cleared = 0
        self.stored: list[tuple[int, ...]] = []
        self.capacity: dict[str, int] = {}

    def set_exact(self, backend: str, exact: bool = True, *, reason: str | None = None) -> None:
        self.exact.append((exact, reason))

    def blocks_stored(self, backend: str, token_ids: Sequence[int], *, block_size: int, **kw: Any) -> list[int]:
        self.stored.append(tuple(token_ids))
        return list(range(len(token_ids) // block_size))

    def blocks_removed(self, backend: str, engine_hashes: Iterable[int] = ()) -> int:
        return 0

    def all_cleared(self, backend: str) -> None:
        self.cleared += 1

    def set_capacity(self, backend: str, blocks: int) -> None:
        self.capacity[backend] = blocks


class PlainSink(Sink):
    """A sink whose ``set_exact`` takes no ``reason`` and which has no ``set_capacity``."""

    set_capacity = None  # type: ignore[assignment]

    def set_exact(self, backend: str, exact: bool = True) -> None:  # type: ignore[override]
        self.exact.append((exact, None))


@attrs.frozen
class Item:
    """One event of the toy engine below: tokens stored in blocks of ``block_size`` (0: stores nothing)."""

    tokens: tuple[int, ...] = ()
    block_size: int = 0


class ToyFeed(KvEventFeed[Item]):
    """The smallest engine feed: items fit when they store nothing or use the sink's block size."""

    unit: ClassVar[str] = "items"

    def __init__(self, sink: KvEventSink, **kwargs: Any) -> None:
        super().__init__("b0", sink, **kwargs)
        self.applied: list[Item] = []

    def receive(self, item: Item) -> None:
        self.offer(item)

    def _fits(self, item: Item) -> bool:
        return not item.block_size or item.block_size == self.sink.block_size

    def _engine_block_size(self, item: Item) -> int | None:
        return item.block_size or None

    def _apply(self, item: Item) -> None:
        self.applied.append(item)
        if item.tokens:
            self.stats.blocks_stored += len(
                self.sink.blocks_stored(self.backend, item.tokens, block_size=item.block_size)
            )


@attrs.define
class EngineAdapter(OpenAIAdapter):
    """An engine adapter as a third party writes one: the base plus an option of its own."""

    metrics_path: str = attrs.field(
        default="/metrics", converter=lambda v: check_path(v, "metrics_path", allow_empty=True)
    )


class TestOpenAIAdapter:
    def test_create_checks_option_names(self) -> None:
        """create() accepts the adapter's options and names the unknown ones with the known ones (not a TypeError)."""
        assert OpenAIAdapter.create(BACKEND, health_path="/ready").health_path == "/ready"
        with pytest.raises(
            ValueError, match=r"unknown option\(s\) 'health' \(expected some of: health_path, models_path\)"
        ):
            OpenAIAdapter.create(BACKEND, health="/ready")

    def test_subclass_options_join_the_base_ones(self) -> None:
        """A subclass's own fields are options of its create(), next to the inherited paths, and converted."""
        assert EngineAdapter.option_names() == {"health_path", "models_path", "metrics_path"}
        adapter = EngineAdapter.create(BACKEND, metrics_path="", models_path="/models")
        assert isinstance(adapter, EngineAdapter) and (adapter.metrics_path, adapter.models_path) == ("", "/models")
        with pytest.raises(ValueError, match="'metrics_path' must be a path starting with '/' or empty"):
            EngineAdapter.create(BACKEND, metrics_path="metrics")

    @pytest.mark.parametrize(
        ("value", "allow_empty", "message"),
        [("health", False, "starting with '/'"), ("", False, "'p'"), (3, True, "or empty")],
    )
    def test_check_path_refuses(self, value: object, allow_empty: bool, message: str) -> None:
        """A path option that does not start with '/' (nor is empty where allowed) is refused, saying what it got."""
        with pytest.raises(ValueError, match=message):
            check_path(value, "p", allow_empty=allow_empty)

    def test_path_options_are_checked(self) -> None:
        """The base's own paths are checked too."""
        with pytest.raises(ValueError, match="'models_path' must be a path"):
            OpenAIAdapter(BACKEND, models_path="v1/models")

    @pytest.mark.anyio
    async def test_probe_carries_the_engine_reason(self) -> None:
        """200 is healthy; another status raises ValueError with the status and the start of the engine's answer."""
        adapter = OpenAIAdapter(BACKEND)
        assert await adapter.probe(FakeHttp({"/health": HttpReply(200)})) is True
        with pytest.raises(ValueError, match=r"^/health answered 503: LLM is unavailable$"):
            await adapter.probe(FakeHttp({"/health": HttpReply(503, b"  LLM is unavailable\n")}))
        with pytest.raises(ValueError, match=r"^/health answered 500$"):
            await adapter.probe(FakeHttp({"/health": HttpReply(500)}))
        with pytest.raises(ValueError) as caught:
            await adapter.probe(FakeHttp({"/health": HttpReply(503, b"x" * 1000)}))
        assert str(caught.value).count("x") == 200

    @pytest.mark.anyio
    async def test_list_models(self) -> None:
        """Model ids come from models_path; a non-200 names the path and the status."""
        adapter = OpenAIAdapter(BACKEND, models_path="/models")
        body = b'{"object": "list", "data": [{"id": "a"}, {"id": ""}, {"id": "b"}, "junk"]}'
        assert await adapter.list_models(FakeHttp({"/models": HttpReply(200, body)})) == ["a", "b"]
        with pytest.raises(ValueError, match=r"^/models answered 404, expected 200\.$"):
            await adapter.list_models(FakeHttp({}))

    def test_declares_only_what_it_has(self) -> None:
        """The base probes and lists models; it claims no load, events or resources, so hosts fall back for those."""
        adapter = EngineAdapter(BACKEND)
        assert isinstance(adapter, Probes) and isinstance(adapter, ListsModels)
        assert not isinstance(adapter, PollsLoad | StreamsEvents | Closes)

    def test_raise_for_status(self) -> None:
        """A 200 reply is returned as it is; any other raises ValueError naming the path."""
        ok = HttpReply(200, b"{}")
        assert ok.raise_for_status("/x") is ok
        with pytest.raises(ValueError, match=r"^/x answered 204, expected 200\.$"):
            HttpReply(204).raise_for_status("/x")


@attrs.frozen
class _EngineSpecific(EngineMetrics):
    capacity: int | None = None


class TestEngineMetrics:
    def test_to_load_carries_the_shared_fields(self) -> None:
        """to_load copies the six load fields and the stamp; an engine's own fields stay out."""
        metrics = _EngineSpecific(
            running=1,
            waiting=2,
            kv_usage=0.5,
            prefix_cache_queries=30.0,
            prefix_cache_hits=10.0,
            block_size=16,
            capacity=99,
        )
        load = metrics.to_load(observed_at=7.0)
        assert load == EngineLoad(
            running=1,
            waiting=2,
            kv_usage=0.5,
            prefix_cache_queries=30.0,
            prefix_cache_hits=10.0,
            block_size=16,
            observed_at=7.0,
        )

    def test_to_load_is_stamped_now_by_default(self) -> None:
        """Without a stamp the load is as old as the call."""
        assert EngineMetrics(running=3).to_load().age() < 60

    def test_every_load_field_has_a_metric(self) -> None:
        """EngineMetrics names every EngineLoad field but the stamp, so to_load can never leave one out."""
        load_fields = {a.name for a in attrs.fields(EngineLoad)} - {"observed_at"}
        assert {a.name for a in attrs.fields(EngineMetrics)} == load_fields


class TestPrometheusSubset:
    def test_keeps_only_the_named_families(self) -> None:
        """Samples and HELP/TYPE lines of the named families are kept; other families and comments are dropped."""
        text = (
            '# HELP a_total A.\n# TYPE a counter\na_total{x="1"} 3\n# HELP b B.\n# TYPE b gauge\nb 1\n'
            "# random comment a\nc_a 2\n"
        )
        assert prometheus_subset(text, {"a", "a_total"}) == '# HELP a_total A.\n# TYPE a counter\na_total{x="1"} 3\n'
        assert prometheus_subset(text, set()) == "\n"


class TestRankKey:
    @given(st.integers(), st.integers(0, RANKS - 1), st.integers(), st.integers(0, RANKS - 1))
    def test_distinct_for_every_pair(self, h1: int, r1: int, h2: int, r2: int) -> None:
        """Two (hash, rank) pairs share a key only when they are the same pair: negative and wide hashes included."""
        assert (rank_key(h1, r1) == rank_key(h2, r2)) == ((h1, r1) == (h2, r2))

    def test_wide_hashes_do_not_collide_across_ranks(self) -> None:
        """A digest wider than 64 bits on rank 0 and a small hash on rank 1 stay apart (an offset of rank << 64 would
        not)."""
        assert rank_key(2**64 + 5, 0) != rank_key(5, 1)

    @pytest.mark.parametrize("rank", [-1, RANKS])
    def test_rank_out_of_range(self, rank: int) -> None:
        """A rank the key cannot tell apart is refused, saying the range."""
        with pytest.raises(ValueError, match=f"from 0 to {RANKS - 1}, got {rank}"):
            rank_key(1, rank)


class TestSinkHelpers:
    def test_capacity_given_when_the_sink_takes_it(self) -> None:
        """set_backend_capacity calls set_capacity when the sink has it and the size is known, and says whether it
        did."""
        sink = Sink()
        assert set_backend_capacity(sink, "b0", 72) is True and sink.capacity == {"b0": 72}
        assert set_backend_capacity(sink, "b1", None) is False and set_backend_capacity(sink, "b1", 0) is False
        assert set_backend_capacity(PlainSink(), "b0", 72) is False

    def test_reason_only_to_sinks_that_take_it(self) -> None:
        """set_backend_exact passes reason= to a sink that accepts it and leaves it out for one that does not."""
        sink, plain = Sink(), PlainSink()
        set_backend_exact(sink, "b0", False, reason="lost")
        set_backend_exact(plain, "b0", False, reason="lost")
        assert (sink.exact, plain.exact) == ([(False, "lost")], [(False, None)])


class TestExactFlag:
    def test_reported_only_on_change_with_the_reason(self) -> None:
        """The sink hears the value when it changes: not_subscribed first, exact once all subscribe, the loss's reason
        after."""
        sink = Sink()
        flag = ExactFlag("b0", sink)
        a, b = ToyFeed(sink, rank=0, exact_flag=flag), ToyFeed(sink, rank=1, exact_flag=flag)
        flag.subscribed(a, True)
        flag.subscribed(a, True)
        assert sink.exact == [(False, "not_subscribed")]
        flag.subscribed(b, True)
        assert sink.exact[-1] == (True, None) and a.needs_resync and not b.needs_resync
        b.lose("lost_items")
        a.lose("another")
        assert sink.exact[1:] == [(True, None), (False, "lost_items")]
        flag.close()
        assert len(sink.exact) == 3 and not flag.value

    def test_reported_false_means_nothing_to_say(self) -> None:
        """A flag that starts as reported inexact tells the sink nothing until the backend is exact."""
        sink = Sink()
        flag = ExactFlag("b0", sink, reported=False)
        feed = ToyFeed(sink, exact_flag=flag)
        feed.lose("early")
        flag.close()
        assert sink.exact == []


class TestKvEventFeed:
    def test_exact_between_subscribe_and_unsubscribe(self) -> None:
        """A feed given a flag makes the backend exact only once subscribed, and gives it back on unsubscribe."""
        sink = Sink()
        feed = ToyFeed(sink, exact_flag=ExactFlag("b0", sink, reported=False))
        assert not feed.exact and sink.exact == []
        feed.subscribe()
        assert feed.exact and sink.exact == [(True, None)]
        feed.unsubscribe()
        assert not feed.exact and sink.exact[-1] == (False, "not_subscribed")

    def test_first_loss_logs_and_tells_the_sink(self) -> None:
        """Every loss is counted by reason; only the first since the last clear logs kv_index_inexact and turns exact
        off."""
        sink = Sink()
        feed = ToyFeed(sink, rank=2)
        with capture_logs() as logs:
            feed.lose("gap", count=3)
            feed.lose("gap", count=1)
            feed.lose("malformed")
        assert feed.stats.inexact_reasons == {"gap": 2, "malformed": 1} and feed.stats.inexact == 1
        assert feed.lost_reason == "gap" and sink.exact == [(False, "gap")] and not feed.exact
        inexact = [e for e in logs if e["event"] == "kv_index_inexact"]
        assert inexact == [
            {
                "event": "kv_index_inexact",
                "backend": "b0",
                "rank": 2,
                "reason": "gap",
                "count": 3,
                "log_level": "warning",
            }
        ]

    def test_feed_without_rank_logs_no_rank(self) -> None:
        """A feed carrying every rank (rank None) names only the backend in its log lines."""
        with capture_logs() as logs:
            ToyFeed(Sink()).lose("gap")
        assert "rank" not in logs[0]

    def test_engine_clear_makes_it_complete_again(self) -> None:
        """After the engine's cache is emptied, the sink is cleared, the feed is complete and the backend exact
        again."""
        sink = Sink()
        feed = ToyFeed(sink)
        feed.lose("gap")
        with capture_logs() as logs:
            feed.engine_cleared("cache_reset")
        assert (sink.cleared, feed.stats.cleared, feed.stats.resyncs, feed.lost_reason) == (1, 1, 1, None)
        assert sink.exact == [(False, "gap"), (True, None)] and feed.exact
        assert {"event": "kv_index_exact", "reason": "cache_reset", "after": "gap"}.items() <= logs[0].items()

    def test_clear_while_complete_is_quiet(self) -> None:
        """A clear with nothing lost empties the sink but logs nothing and counts no resync."""
        sink = Sink()
        feed = ToyFeed(sink)
        with capture_logs() as logs:
            feed.engine_cleared("cache_reset")
        assert (sink.cleared, feed.stats.resyncs, logs, sink.exact) == (1, 0, [], [])

    def test_resync_is_not_an_engine_clear(self) -> None:
        """A resync clears the sink and trusts the events again, without counting as the engine's clear."""
        sink = Sink()
        feed = ToyFeed(sink)
        feed.lose("poll_timeout")
        feed.resync()
        assert (sink.cleared, feed.stats.cleared, feed.stats.resyncs, feed.exact) == (1, 0, 1, True)

    def test_inexact_for_counts_from_the_last_loss(self) -> None:
        """inexact_for is the time since the last loss while incomplete, None once complete."""
        now = [10.0]
        feed = ToyFeed(Sink(), clock=lambda: now[0])
        assert feed.inexact_for is None
        feed.lose("a")
        now[0] += 5
        feed.lose("b")
        now[0] += 2
        assert feed.inexact_for == 2
        feed.resync()
        assert feed.inexact_for is None

    def test_items_wait_in_order_while_block_sizes_differ(self) -> None:
        """An item of another block size is held, and so is every item behind it; resume applies them in order once
        sizes agree."""
        sink = Sink(block_size=4)
        feed = ToyFeed(sink)
        first, second, third = Item((1,) * 8, 8), Item(), Item((2,) * 8, 8)
        with capture_logs() as logs:
            for item in (first, second, third):
                feed.receive(item)
        assert (feed.holding, feed.applied, feed.stats.held) == (3, [], 3)
        assert [(e["event"], e["engine_block_size"], e["router_block_size"]) for e in logs] == [
            ("kv_events_held", 8, 4)
        ]
        assert feed.resume() == 0
        sink.block_size = 8
        assert feed.resume() == 3 and feed.applied == [first, second, third] and feed.holding == 0
        assert feed.stats.blocks_stored == 2 and feed.lost_reason is None

    def test_held_overflow_is_a_loss(self) -> None:
        """Past max_held the oldest held items are dropped: counted, warned once, lost as held_<unit>_dropped."""
        sink = Sink(block_size=4)
        feed = ToyFeed(sink, max_held=2)
        with capture_logs() as logs:
            for _ in range(5):
                feed.receive(Item((1,) * 8, 8))
        assert (feed.holding, feed.stats.dropped_held) == (2, 3)
        assert feed.stats.inexact_reasons == {"held_items_dropped": 3} and sink.exact == [(False, "held_items_dropped")]
        assert [e["event"] for e in logs].count("kv_events_block_size_mismatch") == 1

    def test_report(self) -> None:
        """report() gives the counters with holding, exact and the reason the feed is not complete."""
        feed = ToyFeed(Sink())
        feed.lose("gap")
        report = feed.report()
        assert (report["holding"], report["exact"], report["lost_reason"], report["inexact_reasons"]) == (
            0,
            False,
            "gap",
            {"gap": 1},
        )
        assert set(attrs.asdict(feed.stats)) <= set(report)


class TestLoopsReexport:
    def test_adapter_authors_get_the_loop_helpers_from_kvroute_adapters(self) -> None:
        """kvroute.adapters offers the background-loop helpers of kvroute.loops under the same names."""
        assert (Backoff, KeepAlive, keep_alive) == (loops.Backoff, loops.KeepAlive, loops.keep_alive)
