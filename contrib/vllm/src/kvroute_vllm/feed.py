"""Applying vLLM's KV event batches to a `kvroute.adapters.KvEventSink`, in sequence order.

No sockets here (see `kvroute_vllm.subscriber`): `KvEventFeed` decides what each batch means
for the router's index, keeps the sequence numbers straight, and says when the index can no
longer be called exact (`ExactFlag`).

Sequence numbers (one counter per publisher, from 0):

* the next expected batch is applied;
* a batch past the expected one reveals a gap: `KvEventFeed.receive` returns it as a `Gap`,
  the caller fills it from the replay socket (`replayed`) or gives up on it (`skip_gap`),
  then offers the batch again;
* a replayed batch already applied is a duplicate and is skipped;
* a live batch whose number is not above the last live one means the publisher restarted
  (its counter starts again at 0): the backend's blocks are cleared, as the engine's were.

What is applied, per event:

* ``BlockStored``: blocks on the GPU (``medium`` absent or ``"GPU"``) of one KV cache group
  whose kind is prefix-cacheable the way the router's index models it (`INDEXED_KINDS`: a
  hit needs every block from the start of the prompt): ``full_attention``,
  ``mla_attention`` (DeepSeek-style models) and ``sink_full_attention``; events without a
  kind (vLLM before 0.22) count as full attention. The first such group seen is followed;
  other groups of those kinds hold the same prefixes and are ignored. The sink recomputes
  the router's own hashes from ``token_ids``, the LoRA name and the ``cache_salt`` found in
  the first block's extra keys; the engine's hashes are kept only to resolve later parents
  and removals. Blocks whose extra keys carry multimodal identifiers or prompt-embedding
  digests (which token ids do not determine, and which a router hashing token ids never
  asks for) end the event: they and their descendants are left out on purpose.
* ``BlockRemoved``: GPU blocks of the followed group, by engine hash.
* ``AllBlocksCleared``: every block of the backend.

Kinds that are not indexed (`WINDOW_KINDS`: sliding window, sliding-window MLA, chunked local
attention, mamba state, encoder-only and cross attention) are ignored: in a hybrid model the
followed full-attention group bounds every prefix hit, so nothing is lost; a model with no
indexed group at all (a pure sliding-window model) leaves the index without its blocks, and the
backend is marked inexact (``cache_kind_not_indexed``). Any other kind (vLLM's own ``unknown``,
or one added after vLLM 0.33) is warned about once per kind and marks the backend inexact.

Exactness: a feed is *complete* while nothing it was given could have been skipped or lost
since its blocks were last cleared. Every loss records a reason in ``stats.inexact_reasons``,
logs ``kv_index_inexact`` (with backend, rank and reason) when the feed stops being complete,
and updates the backend's `ExactFlag`, which calls ``set_exact(backend, False)``. The losses:
a gap the replay could not fill (``lost_batches``), joining a stream whose earlier batches are
gone (``history_incomplete``), a store that could not be applied (``lora_without_name``,
``malformed_store``, ``unknown_parent``, ``rejected_store``, ``lookahead_hashing``), a
kind this adapter does not know (``unknown_cache_kind``) or does not index with no indexed
group beside it (``cache_kind_not_indexed``), an event type it does not know
(``unknown_event_type``), held batches dropped (``held_batches_dropped``). A clear
(``AllBlocksCleared``, a publisher or engine restart) empties engine and index alike: the feed
is complete again.

Engine hashes of data-parallel rank ``r > 0`` are offset by ``r << 64`` so that ranks never
share a key. While the sink hashes blocks of another size than the engine's (the strategy has
not learned the engine's block size yet), batches are held, in order, and applied once the
sizes agree (`resume`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvroute.adapters import KvEventSink, set_backend_exact
from kvroute.logs import get_logger
from kvroute_vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, UnknownEvent

__all__ = ["INDEXED_KINDS", "WINDOW_KINDS", "ExactFlag", "FeedStats", "Gap", "KvEventFeed"]

log = get_logger(__name__)

_GPU = (None, "GPU")

#: KV cache group kinds whose blocks the index holds: prefix-cacheable, a hit needs every block from the start.
INDEXED_KINDS: frozenset[str | None] = frozenset({None, "full_attention", "mla_attention", "sink_full_attention"})
#: Kinds vLLM 0.22-0.33 label and the index does not hold (a hit does not need the whole prefix, or no prefix cache).
WINDOW_KINDS: frozenset[str] = frozenset(
    {
        "sliding_window",
        "sliding_window_mla",
        "chunked_local_attention",
        "mamba",
        "encoder_only_attention",
        "cross_attention",
    }
)


@attrs.frozen
class Gap:
    """Batches ``start`` (inclusive) to ``end`` (exclusive) were not received."""

    start: int
    end: int


@attrs.define
class FeedStats:
    """Counters of one feed (exported by the adapter's ``stats()``)."""

    batches: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    cleared: int = 0
    duplicates: int = 0
    gaps: int = 0
    replayed: int = 0
    lost_batches: int = 0
    restarts: int = 0
    held: int = 0
    dropped_held: int = 0
    orphan_events: int = 0
    skipped_events: int = 0
    rejected_events: int = 0
    #: Events left out on purpose (another medium, another group, a kind not indexed, multimodal blocks).
    ignored_events: int = 0
    #: Times the feed stopped being complete (each logged as ``kv_index_inexact``).
    inexact: int = 0
    #: Every loss, by reason (see the module docstring).
    inexact_reasons: dict[str, int] = attrs.field(factory=dict)


class ExactFlag:
    """Whether one backend's index may be called exact, from the state of all its feeds (one per rank).

    Exact means: every feed is subscribed and none has lost anything since its last clear. The
    value goes to the sink (``set_exact``, with the reason when the sink takes one) only when it
    changes. A flag a feed makes for itself (no adapter) counts that feed as subscribed.

    Switching a sink back to exact makes it forget the backend's blocks (the tokenizer-prefix
    index drops its approximate records), so every other feed is asked to rebuild from its
    replay buffer (``needs_resync``).
    """

    def __init__(self, backend: str, sink: KvEventSink) -> None:
        self.backend = backend
        self.sink = sink
        #: The value last given to the sink (``None``: not yet).
        self.reported: bool | None = None
        self._feeds: list[KvEventFeed] = []
        self._subscribed: dict[int, bool] = {}

    def add(self, feed: KvEventFeed, *, subscribed: bool = False) -> None:
        self._feeds.append(feed)
        self._subscribed[id(feed)] = subscribed

    @property
    def value(self) -> bool:
        return bool(self._feeds) and all(self._subscribed[id(f)] and f.lost_reason is None for f in self._feeds)

    def reason(self) -> str | None:
        for feed in self._feeds:
            if not self._subscribed[id(feed)]:
                return "not_subscribed"
            if feed.lost_reason is not None:
                return feed.lost_reason
        return None

    def subscribed(self, feed: KvEventFeed, yes: bool) -> None:
        """``feed``'s subscription started (``True``) or ended."""
        self._subscribed[id(feed)] = yes
        self.update(feed)

    def close(self) -> None:
        """No feed runs any more: the backend goes back to the strategy's own records."""
        for feed in self._feeds:
            self._subscribed[id(feed)] = False
        self.update(None)

    def update(self, cause: KvEventFeed | None) -> None:
        """Give the sink the current value if it changed (``cause``: the feed whose state changed)."""
        value = self.value
        if value == self.reported:
            return
        self.reported = value
        set_backend_exact(self.sink, self.backend, value, reason=None if value else self.reason())
        if value:
            for feed in self._feeds:
                if feed is not cause:
                    feed.needs_resync = True


def _rank_key(engine_hash: int, rank: int) -> int:
    return engine_hash + (rank << 64) if rank else engine_hash


def _split_extra(
    keys: Sequence[Any] | None, lora: str | None, first_of_sequence: bool
) -> tuple[bool, str | None]:
    """(opaque, cache_salt) of one block's untagged extra keys."""
    if not keys:
        return False, None
    rest = list(keys)
    if lora is not None and lora in rest:
        rest.remove(lora)
    salt = None
    for key in rest:
        if isinstance(key, str) and first_of_sequence and salt is None:
            salt = key
        else:
            return True, None  # a multimodal (identifier, offset) pair, an embeddings digest, or unknown
    return False, salt


class KvEventFeed:
    """One publisher's (one engine rank's) event stream, applied to ``sink`` for ``backend``."""

    def __init__(
        self,
        backend: str,
        sink: KvEventSink,
        *,
        rank: int = 0,
        max_held: int = 10_000,
        exact_flag: ExactFlag | None = None,
    ) -> None:
        self.backend = backend
        self.sink = sink
        self.rank = rank
        self.max_held = max_held
        self.stats = FeedStats()
        #: The sequence number of the next batch to apply (``None``: nothing seen yet).
        self.expected: int | None = None
        #: Why the index may miss this stream's blocks (``None``: nothing lost since the last clear).
        self.lost_reason: str | None = None
        #: Set when the sink forgot this backend's blocks: rebuild from the replay buffer.
        self.needs_resync = False
        #: The backend's exactness; a feed given none makes its own and counts as subscribed.
        self.exact_flag = exact_flag if exact_flag is not None else ExactFlag(backend, sink)
        self.exact_flag.add(self, subscribed=exact_flag is None)
        self._last_live: int | None = None
        self._held: deque[EventBatch] = deque()
        self._group: int | None = None
        self._has_group = False
        self._opaque: set[int] = set()
        self._warned: set[str] = set()

    # -- exactness -----------------------------------------------------------------------

    def lose(self, reason: str, **context: Any) -> None:
        """Something this stream carried may be missing from the index: record it, the backend is not exact."""
        self.stats.inexact_reasons[reason] = self.stats.inexact_reasons.get(reason, 0) + 1
        if self.lost_reason is None:
            self.lost_reason = reason
            self.stats.inexact += 1
            log.warning("kv_index_inexact", backend=self.backend, rank=self.rank, reason=reason, **context)
            self.exact_flag.update(self)

    def _cleared(self) -> None:
        self._opaque.clear()
        if self.lost_reason is not None:
            log.info("kv_index_exact_again", backend=self.backend, rank=self.rank, after=self.lost_reason)
            self.lost_reason = None
            self.exact_flag.update(self)

    # -- sequence ----------------------------------------------------------------------

    def receive(self, batch: EventBatch) -> Gap | None:
        """A batch from the live stream: applied, skipped as a duplicate, or a `Gap` to fill first."""
        seq = batch.seq
        if self._last_live is not None and seq <= self._last_live:
            self.stats.restarts += 1
            log.warning("kv_events_publisher_restarted", backend=self.backend, rank=self.rank, seq=seq, last=self._last_live)
            self.restart()
        if self.expected is not None and seq > self.expected:
            self.stats.gaps += 1
            return Gap(self.expected, seq)
        self._last_live = seq
        self._accept(batch)
        return None

    def replayed(self, batches: Iterable[EventBatch], *, complete: bool = False) -> None:
        """Batches from the replay socket, in order (duplicates skipped, holes counted as lost).

        ``complete``: the replay ended with the end marker, so the next live batch follows the
        last one replayed; an empty complete replay means the publisher has sent nothing yet
        (the next batch is 0). A first batch past 0 means the engine published earlier batches
        that its buffer no longer holds: the feed starts there, and the index may miss their
        blocks (``history_incomplete``).
        """
        batches = list(batches)
        if complete and not batches and self.expected is None:
            self.expected = 0
        for batch in batches:
            self.stats.replayed += 1
            if self.expected is not None and batch.seq > self.expected:
                self.stats.lost_batches += batch.seq - self.expected
                log.warning(
                    "kv_events_lost", backend=self.backend, rank=self.rank, first=self.expected, count=batch.seq - self.expected
                )
                self.lose("lost_batches", first=self.expected, count=batch.seq - self.expected)
            self._accept(batch)

    def skip_gap(self, gap: Gap) -> None:
        """Give up on a gap that could not be replayed."""
        if self.expected is None or self.expected == gap.start:
            self.stats.lost_batches += gap.end - gap.start
            log.warning("kv_events_lost", backend=self.backend, rank=self.rank, first=gap.start, count=gap.end - gap.start)
            self.lose("lost_batches", first=gap.start, count=gap.end - gap.start)
            self.expected = gap.end

    def reset(self) -> None:
        """Forget the sequence (a new subscription replays from the start); the sink is left as it is."""
        self.expected = None
        self._last_live = None
        self._held.clear()

    def restart(self) -> None:
        """The engine restarted (or will be re-read from its first batch): forget its blocks and sequence."""
        self.sink.all_cleared(self.backend)
        self.stats.cleared += 1
        self.expected = 0
        self._last_live = None
        self._held.clear()
        self._cleared()

    def _accept(self, batch: EventBatch) -> None:
        if self.expected is not None and batch.seq < self.expected:
            self.stats.duplicates += 1
            return
        if self.expected is None and batch.seq > 0:
            self.lose("history_incomplete", first_seq=batch.seq)
        self.expected = batch.seq + 1
        if self._held or not self._fits(batch):
            self._hold(batch)
            return
        self._apply(batch)

    # -- block size ----------------------------------------------------------------------

    @property
    def holding(self) -> int:
        """Batches waiting for the sink's block size to equal the engine's."""
        return len(self._held)

    def _fits(self, batch: EventBatch) -> bool:
        size = self.sink.block_size
        return all(
            e.block_size == size for e in batch.events if isinstance(e, BlockStored) and self._classify(e, pick=False) == "track"
        )

    def _hold(self, batch: EventBatch) -> None:
        if not self._held:
            engine = next((e.block_size for e in batch.events if isinstance(e, BlockStored)), None)
            log.info(
                "kv_events_held", backend=self.backend, engine_block_size=engine, router_block_size=self.sink.block_size
            )
        self._held.append(batch)
        self.stats.held += 1
        while len(self._held) > self.max_held:
            self._held.popleft()
            self.stats.dropped_held += 1
            self._warn_once(
                "held_overflow",
                "kv_events_block_size_mismatch",
                router_block_size=self.sink.block_size,
                hint="the strategy hashes blocks of another size than the engine: leave its block_size unset or set it "
                "to the engine's; events are being dropped",
            )
            self.lose("held_batches_dropped")

    def resume(self) -> int:
        """Apply held batches now that the block sizes agree; returns how many were applied."""
        applied = 0
        while self._held and self._fits(self._held[0]):
            self._apply(self._held.popleft())
            applied += 1
        return applied

    # -- applying ------------------------------------------------------------------------

    def _warn_once(self, key: str, event: str, **context: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(event, backend=self.backend, **context)

    def _classify(self, event: BlockStored, *, pick: bool) -> str:
        """``track``, ``ignore`` (another medium or group), ``window`` (a kind not indexed) or ``unknown``."""
        if event.medium not in _GPU:
            return "ignore"
        kind = event.kv_cache_spec_kind
        if kind in WINDOW_KINDS:
            return "window"
        if kind not in INDEXED_KINDS:
            return "unknown"
        if not self._has_group:
            if not pick:
                return "track"
            self._has_group = True
            self._group = event.group_idx
            log.info("kv_events_group", backend=self.backend, rank=self.rank, group_idx=event.group_idx, kind=kind)
        return "track" if event.group_idx == self._group else "ignore"

    def _apply(self, batch: EventBatch) -> None:
        self.stats.batches += 1
        rank = batch.data_parallel_rank if batch.data_parallel_rank is not None else self.rank
        not_indexed: Counter[str] = Counter()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event, rank, not_indexed)
            elif isinstance(event, BlockRemoved):
                keys = [_rank_key(h, rank) for h in event.block_hashes]
                self._opaque.difference_update(keys)
                if event.medium not in _GPU or (event.group_idx is not None and event.group_idx != self._group):
                    self.stats.skipped_events += 1
                    self.stats.ignored_events += 1
                    continue
                self.stats.blocks_removed += self.sink.blocks_removed(self.backend, keys)
            elif isinstance(event, AllBlocksCleared):
                self.sink.all_cleared(self.backend)
                self.stats.cleared += 1
                self._cleared()
            elif isinstance(event, UnknownEvent):
                self.stats.skipped_events += 1
                self._warn_once(
                    f"type:{event.type}", "kv_events_unknown_event_type", type=event.type,
                    hint="a newer vLLM than this adapter knows; the event was skipped",
                )
                self.lose("unknown_event_type", type=event.type)
        if not_indexed and not self._has_group:
            self.lose("cache_kind_not_indexed", kinds=dict(not_indexed))

    def _stored(self, event: BlockStored, rank: int, not_indexed: Counter[str]) -> None:
        what = self._classify(event, pick=True)
        if what != "track":
            self.stats.skipped_events += 1
            if what == "unknown":
                kind = str(event.kv_cache_spec_kind)
                self._warn_once(
                    f"kind:{kind}", "kv_events_unknown_cache_kind", kind=kind, group_idx=event.group_idx,
                    hint="a KV cache group kind this adapter does not know; its blocks are not indexed",
                )
                self.lose("unknown_cache_kind", kind=kind)
            else:
                self.stats.ignored_events += 1
                if what == "window":
                    not_indexed[str(event.kv_cache_spec_kind)] += 1
            return
        if event.lora_name is None and event.lora_id is not None:
            self.stats.skipped_events += 1
            self._warn_once("lora_id", "kv_events_lora_without_name", hint="this vLLM names LoRA adapters by id only")
            self.lose("lora_without_name")
            return
        if event.lookahead:
            self.stats.skipped_events += 1
            self._warn_once(
                "lookahead", "kv_events_lookahead_hashing",
                hint="the engine hashes tokens past each block; the router's prefix hashes cannot name these blocks",
            )
            self.lose("lookahead_hashing")
            return
        size = event.block_size
        count = min(len(event.block_hashes), len(event.token_ids) // size)
        if count != len(event.block_hashes) or len(event.token_ids) % size:
            self._warn_once(
                "shape", "kv_events_malformed_store", hashes=len(event.block_hashes), tokens=len(event.token_ids), block_size=size
            )
            self.lose("malformed_store", hashes=len(event.block_hashes), tokens=len(event.token_ids))
        keys = [_rank_key(h, rank) for h in event.block_hashes]
        parent = None if event.parent_block_hash is None else _rank_key(event.parent_block_hash, rank)
        if parent is not None and parent in self._opaque:
            self._opaque.update(keys)  # continues a chain left out on purpose (multimodal)
            self.stats.skipped_events += 1
            self.stats.ignored_events += 1
            return
        salt = None
        extra = event.extra_keys or ()
        for i in range(count):
            opaque, found = _split_extra(extra[i] if i < len(extra) else None, event.lora_name, event.parent_block_hash is None and i == 0)
            if opaque:
                self._opaque.update(keys[i:])
                count = i
                break
            salt = found if i == 0 else salt
        if count == 0:
            self.stats.skipped_events += 1
            self.stats.ignored_events += 1
            return
        try:
            stored = self.sink.blocks_stored(
                self.backend,
                event.token_ids[: count * size],
                block_size=size,
                parent_engine_hash=parent,
                engine_hashes=keys[:count],
                lora=event.lora_name,
                cache_salt=salt,
            )
        except ValueError as exc:
            self.stats.rejected_events += 1
            self._warn_once("rejected", "kv_event_rejected", error=str(exc))
            self.lose("rejected_store", error=str(exc))
            return
        if not stored:
            self.stats.orphan_events += 1
            self.lose("unknown_parent", parent=event.parent_block_hash)
        self.stats.blocks_stored += len(stored)
