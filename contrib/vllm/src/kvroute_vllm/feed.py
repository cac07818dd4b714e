"""Applying vLLM's KV event batches to a `kvroute.adapters.KvEventSink`, in sequence order.

No sockets here (see `kvroute_vllm.subscriber`): `VllmEventFeed` decides what each batch means
for the router's index and keeps the sequence numbers straight. What every engine's feed shares
(holding batches while block sizes differ, losses and the backend's `kvroute.adapters.ExactFlag`,
the counters) is `kvroute.adapters.KvEventFeed`'s.

Sequence numbers (one counter per publisher, from 0):

* the next expected batch is applied;
* a batch past the expected one reveals a gap: `VllmEventFeed.receive` returns it as a `Gap`,
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

Exactness (`kvroute.adapters.KvEventFeed.lose`): a feed is *complete* while nothing it was given
could have been skipped or lost since its blocks were last cleared; every loss has a reason. The
losses:
a batch's rank that makes no sense (``bad_rank``), a medium this adapter does not know (``unknown_medium``),
an offload naming a block by an engine hash no earlier event named (``unknown_offloaded_block``),
a gap the replay could not fill (``lost_batches``), joining a stream whose earlier batches are
gone (``history_incomplete``), a store that could not be applied (``lora_without_name``,
``malformed_store``, ``unknown_parent``, ``rejected_store``, ``lookahead_hashing``), a
kind this adapter does not know (``unknown_cache_kind``) or does not index with no indexed
group beside it (``cache_kind_not_indexed``), an event type it does not know
(``unknown_event_type``), held batches dropped (``held_batches_dropped``). A clear
(``AllBlocksCleared``, a publisher or engine restart) empties engine and index alike: the feed
is complete again.

Engine hashes are keyed per data-parallel rank (`kvroute.adapters.rank_key`) so that ranks never
share a key; when the server has several ranks (``size``, one publisher each), a sink whose methods
take ``rank`` (the tokenizer-prefix index) is given each batch's rank and keeps one cache per rank. A
server with one publisher is one cache whatever rank its batches name (a rank of a data-parallel
deployment whose ranks are served at separate URLs). A batch whose rank makes no sense (negative, or not below the
server's ranks, ``size``) is not applied: ``bad_rank``.

Tiers: with a sink whose methods take ``medium``, blocks stored or removed on a slower tier
(``medium`` ``"CPU"``, ``"DISK"``, an offloading connector's names: `kvroute.adapters.kv_events.tier_of`)
are applied on that tier, including a store that names the blocks by engine hash only (no token
ids: vLLM's offloading connector); an unknown medium is not applied (``unknown_medium``). Other
sinks get GPU blocks only, as before. While the sink hashes blocks of another size than the engine's (the strategy has
not learned the engine's block size yet), batches are held, in order, and applied once the
sizes agree (`resume`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import attrs

from kvroute.adapters import RANKS, ExactFlag, FeedStats, KvEventFeed, KvEventSink, rank_key
from kvroute.adapters.kv_events import GPU, accepts, tier_of
from kvroute.logs import get_logger
from kvroute_vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, UnknownEvent

__all__ = ["INDEXED_KINDS", "WINDOW_KINDS", "Gap", "VllmEventFeed", "VllmFeedStats"]

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
class VllmFeedStats(FeedStats):
    """The counters every feed keeps (`kvroute.adapters.FeedStats`), plus vLLM's sequence and filter counters."""

    batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    replayed: int = 0
    lost_batches: int = 0
    restarts: int = 0
    #: Events left out on purpose (another medium, another group, a kind not indexed, multimodal blocks).
    ignored_events: int = 0


def _split_extra(keys: Sequence[Any] | None, lora: str | None, first_of_sequence: bool) -> tuple[bool, str | None]:
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


class VllmEventFeed(KvEventFeed[EventBatch]):
    """One publisher's (one engine rank's) event stream, applied to ``sink`` for ``backend``."""

    unit: ClassVar[str] = "batches"
    logger: ClassVar[Any] = log
    stats: VllmFeedStats

    def __init__(
        self,
        backend: str,
        sink: KvEventSink,
        *,
        rank: int = 0,
        size: int | None = None,
        max_held: int = 10_000,
        exact_flag: ExactFlag | None = None,
    ) -> None:
        super().__init__(backend, sink, rank=rank, max_held=max_held, exact_flag=exact_flag, stats=VllmFeedStats())
        self.rank: int = rank
        #: The server's data-parallel ranks (a batch's rank must be below it); ``None``: not known.
        self.size = size
        #: Whether the sink keeps ranks apart and tiers (its methods take ``rank``, ``medium``).
        self._ranked = accepts(sink.blocks_stored, "rank") and accepts(sink.blocks_removed, "rank")
        self._tiered = accepts(sink.blocks_stored, "medium") and accepts(sink.blocks_removed, "medium")
        #: The sequence number of the next batch to apply (``None``: nothing seen yet).
        self.expected: int | None = None
        self._last_live: int | None = None
        self._group: int | None = None
        self._has_group = False
        self._opaque: set[int] = set()

    def engine_cleared(self, reason: str) -> None:
        """The engine dropped every block: so does the sink (multimodal chains left out are forgotten too)."""
        self._opaque.clear()
        super().engine_cleared(reason)

    # -- sequence ----------------------------------------------------------------------

    def receive(self, batch: EventBatch) -> Gap | None:
        """A batch from the live stream: applied, skipped as a duplicate, or a `Gap` to fill first."""
        seq = batch.seq
        if self._last_live is not None and seq <= self._last_live:
            self.stats.restarts += 1
            log.warning(
                "kv_events_publisher_restarted", backend=self.backend, rank=self.rank, seq=seq, last=self._last_live
            )
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
                self._lost(self.expected, batch.seq)
            self._accept(batch)

    def skip_gap(self, gap: Gap) -> None:
        """Give up on a gap that could not be replayed."""
        if self.expected is None or self.expected == gap.start:
            self._lost(gap.start, gap.end)
            self.expected = gap.end

    def _lost(self, first: int, end: int) -> None:
        self.stats.lost_batches += end - first
        log.warning("kv_events_lost", backend=self.backend, rank=self.rank, first=first, count=end - first)
        self.lose("lost_batches", first=first, count=end - first)

    def reset(self) -> None:
        """Forget the sequence (a new subscription replays from the start); the sink is left as it is."""
        self.expected = None
        self._last_live = None
        self._drop_held()

    def restart(self) -> None:
        """The engine restarted (or will be re-read from its first batch): forget its blocks and sequence."""
        self.expected = 0
        self._last_live = None
        self._drop_held()
        self.engine_cleared("engine_restarted")

    def _accept(self, batch: EventBatch) -> None:
        if self.expected is not None and batch.seq < self.expected:
            self.stats.duplicates += 1
            return
        if self.expected is None and batch.seq > 0:
            self.lose("history_incomplete", first_seq=batch.seq)
        self.expected = batch.seq + 1
        self.offer(batch)

    # -- block size ----------------------------------------------------------------------

    def _fits(self, batch: EventBatch) -> bool:
        size = self.sink.block_size
        return all(
            e.block_size == size
            for e in batch.events
            if isinstance(e, BlockStored) and self._classify(e, pick=False) == "track"
        )

    def _engine_block_size(self, batch: EventBatch) -> int | None:
        return next((e.block_size for e in batch.events if isinstance(e, BlockStored)), None)

    # -- applying ------------------------------------------------------------------------

    def _classify(self, event: BlockStored, *, pick: bool) -> str:
        """``track``, ``ignore`` (another medium or group), ``window`` (a kind not indexed) or ``unknown``."""
        if event.medium not in _GPU and not self._tiered:
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

    def _where_to(self, rank: int, medium: str | None) -> dict[str, Any] | None:
        """The sink's keywords for ``rank`` and ``medium`` (``None``: not applied, another medium for this sink,
        or an unknown one: a loss)."""
        tier = tier_of(medium)
        out: dict[str, Any] = {}
        if tier is None:
            self._warn_once(
                f"medium:{medium}",
                "kv_events_unknown_medium",
                medium=medium,
                hint="a KV cache tier this adapter does not know; its blocks are not indexed",
            )
            self.lose("unknown_medium", medium=str(medium)[:64])
            return None
        if tier != GPU:
            if not self._tiered:
                return None
            out["medium"] = tier
        if self._ranked and self.size is not None:  # one stream of a data-parallel server's several
            out["rank"] = rank
        return out

    def _rank_of(self, batch: EventBatch) -> int | None:
        """The batch's rank, ``None`` (a loss, ``bad_rank``) when it is negative or not below the server's ranks."""
        rank = batch.data_parallel_rank if batch.data_parallel_rank is not None else self.rank
        if 0 <= rank < RANKS and (self.size is None or rank < self.size):
            return rank
        self._warn_once(
            f"rank:{rank}",
            "kv_events_bad_rank",
            data_parallel_rank=rank,
            ranks=self.size,
            hint="the batch names a data-parallel rank this server does not have; it was not applied",
        )
        self.lose("bad_rank", data_parallel_rank=rank, ranks=self.size)
        return None

    def _apply(self, batch: EventBatch) -> None:
        self.stats.batches += 1
        rank = self._rank_of(batch)
        if rank is None:
            self.stats.skipped_events += len(batch.events)
            return
        not_indexed: Counter[str] = Counter()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event, rank, not_indexed)
            elif isinstance(event, BlockRemoved):
                keys = [rank_key(h, rank) for h in event.block_hashes]
                self._opaque.difference_update(keys)
                where = self._where_to(rank, event.medium)
                if where is None or (event.group_idx is not None and event.group_idx != self._group):
                    self.stats.skipped_events += 1
                    self.stats.ignored_events += where is not None or tier_of(event.medium) is not None
                    continue
                self.stats.blocks_removed += self.sink.blocks_removed(self.backend, keys, **where)
            elif isinstance(event, AllBlocksCleared):
                self.engine_cleared("all_blocks_cleared")
            elif isinstance(event, UnknownEvent):
                self.stats.skipped_events += 1
                self._warn_once(
                    f"type:{event.type}",
                    "kv_events_unknown_event_type",
                    type=event.type,
                    hint="a newer vLLM than this adapter knows; the event was skipped",
                )
                self.lose("unknown_event_type", type=event.type)
        if not_indexed and not self._has_group:
            self.lose("cache_kind_not_indexed", kinds=dict(not_indexed))

    def _stored(self, event: BlockStored, rank: int, not_indexed: Counter[str]) -> None:
        where = self._where_to(rank, event.medium)
        if where is None:
            self.stats.skipped_events += 1
            self.stats.ignored_events += tier_of(event.medium) is not None
            return
        if "medium" in where and not event.token_ids and event.block_hashes:
            self._offloaded(event, rank, where)
            return
        what = self._classify(event, pick=True)
        if what != "track":
            self.stats.skipped_events += 1
            if what == "unknown":
                kind = str(event.kv_cache_spec_kind)
                self._warn_once(
                    f"kind:{kind}",
                    "kv_events_unknown_cache_kind",
                    kind=kind,
                    group_idx=event.group_idx,
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
                "lookahead",
                "kv_events_lookahead_hashing",
                hint="the engine hashes tokens past each block; the router's prefix hashes cannot name these blocks",
            )
            self.lose("lookahead_hashing")
            return
        size = event.block_size
        count = min(len(event.block_hashes), len(event.token_ids) // size)
        if count != len(event.block_hashes) or len(event.token_ids) % size:
            self._warn_once(
                "shape",
                "kv_events_malformed_store",
                hashes=len(event.block_hashes),
                tokens=len(event.token_ids),
                block_size=size,
            )
            self.lose("malformed_store", hashes=len(event.block_hashes), tokens=len(event.token_ids))
        keys = [rank_key(h, rank) for h in event.block_hashes]
        parent = None if event.parent_block_hash is None else rank_key(event.parent_block_hash, rank)
        if parent is not None and parent in self._opaque:
            self._opaque.update(keys)  # continues a chain left out on purpose (multimodal)
            self.stats.skipped_events += 1
            self.stats.ignored_events += 1
            return
        salt = None
        extra = event.extra_keys or ()
        for i in range(count):
            opaque, found = _split_extra(
                extra[i] if i < len(extra) else None, event.lora_name, event.parent_block_hash is None and i == 0
            )
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
                **where,
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

    def _offloaded(self, event: BlockStored, rank: int, where: dict[str, Any]) -> None:
        """Blocks copied to a slower tier, named by engine hash only (no token ids): the sink moves the known ones."""
        if event.group_idx is not None and self._has_group and event.group_idx != self._group:
            self.stats.skipped_events += 1
            self.stats.ignored_events += 1
            return
        keys = [rank_key(h, rank) for h in event.block_hashes]
        try:
            stored = self.sink.blocks_stored(self.backend, (), block_size=event.block_size, engine_hashes=keys, **where)
        except ValueError as exc:
            self.stats.rejected_events += 1
            self._warn_once("rejected", "kv_event_rejected", error=str(exc))
            self.lose("rejected_store", error=str(exc))
            return
        self.stats.blocks_stored += len(stored)
        if len(stored) < len(keys):
            self.lose("unknown_offloaded_block", blocks=len(keys) - len(stored))
