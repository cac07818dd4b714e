"""Applying vLLM's KV event batches to a `kvroute.adapters.KvEventSink`, in sequence order.

No sockets here (see `kvroute_vllm.subscriber`): `KvEventFeed` decides what each batch means
for the router's index and keeps the sequence numbers straight.

Sequence numbers (one counter per publisher, from 0):

* the next expected batch is applied;
* a batch past the expected one reveals a gap: `KvEventFeed.receive` returns it as a `Gap`,
  the caller fills it from the replay socket (`replayed`) or gives up on it (`skip_gap`),
  then offers the batch again;
* a replayed batch already applied is a duplicate and is skipped;
* a live batch whose number is not above the last live one means the publisher restarted
  (its counter starts again at 0): the backend's blocks are cleared, as the engine's were.

What is applied, per event:

* ``BlockStored``: blocks on the GPU (``medium`` absent or ``"GPU"``) of the full-attention
  KV cache group. The sink recomputes the router's own hashes from ``token_ids``, the LoRA
  name and the ``cache_salt`` found in the first block's extra keys; the engine's hashes are
  kept only to resolve later parents and removals. Blocks whose extra keys carry multimodal
  identifiers or prompt-embedding digests (which token ids do not determine) end the event:
  they and the blocks after them are skipped. Events naming a LoRA only by ``lora_id`` (old
  servers) are skipped: the router keys LoRA adapters by name.
* ``BlockRemoved``: GPU blocks of that group, by engine hash.
* ``AllBlocksCleared``: every block of the backend.

Engine hashes of data-parallel rank ``r > 0`` are offset by ``r << 64`` so that ranks never
share a key. While the sink hashes blocks of another size than the engine's (the strategy has
not learned the engine's block size yet), batches are held, in order, and applied once the
sizes agree (`resume`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvroute.adapters import KvEventSink
from kvroute.logs import get_logger
from kvroute_vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

__all__ = ["FeedStats", "Gap", "KvEventFeed"]

log = get_logger(__name__)

_GPU = (None, "GPU")
_FULL = (None, "full_attention")


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

    def __init__(self, backend: str, sink: KvEventSink, *, rank: int = 0, max_held: int = 10_000) -> None:
        self.backend = backend
        self.sink = sink
        self.rank = rank
        self.max_held = max_held
        self.stats = FeedStats()
        #: The sequence number of the next batch to apply (``None``: nothing seen yet).
        self.expected: int | None = None
        self._last_live: int | None = None
        self._held: deque[EventBatch] = deque()
        self._group: int | None = None
        self._warned: set[str] = set()

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
        (the next batch is 0). Joining a publisher whose buffer no longer reaches batch 0 is
        not a loss: the first batch replayed is where this feed starts.
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
            self._accept(batch)

    def skip_gap(self, gap: Gap) -> None:
        """Give up on a gap that could not be replayed."""
        if self.expected is None or self.expected == gap.start:
            self.stats.lost_batches += gap.end - gap.start
            log.warning("kv_events_lost", backend=self.backend, rank=self.rank, first=gap.start, count=gap.end - gap.start)
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

    def _accept(self, batch: EventBatch) -> None:
        if self.expected is not None and batch.seq < self.expected:
            self.stats.duplicates += 1
            return
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
        return all(e.block_size == size for e in batch.events if isinstance(e, BlockStored) and self._tracked(e))

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

    def _tracked(self, event: BlockStored) -> bool:
        if event.medium not in _GPU or event.kv_cache_spec_kind not in _FULL:
            return False
        if self._group is None:
            self._group = event.group_idx
        return event.group_idx == self._group

    def _apply(self, batch: EventBatch) -> None:
        self.stats.batches += 1
        rank = batch.data_parallel_rank if batch.data_parallel_rank is not None else self.rank
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event, rank)
            elif isinstance(event, BlockRemoved):
                if event.medium not in _GPU or (event.group_idx is not None and event.group_idx != self._group):
                    self.stats.skipped_events += 1
                    continue
                self.stats.blocks_removed += self.sink.blocks_removed(
                    self.backend, [_rank_key(h, rank) for h in event.block_hashes]
                )
            elif isinstance(event, AllBlocksCleared):
                self.sink.all_cleared(self.backend)
                self.stats.cleared += 1

    def _stored(self, event: BlockStored, rank: int) -> None:
        if not self._tracked(event):
            self.stats.skipped_events += 1
            return
        if event.lora_name is None and event.lora_id is not None:
            self.stats.skipped_events += 1
            self._warn_once("lora_id", "kv_events_lora_without_name", hint="this vLLM names LoRA adapters by id only")
            return
        size = event.block_size
        count = min(len(event.block_hashes), len(event.token_ids) // size)
        if count != len(event.block_hashes) or len(event.token_ids) % size:
            self._warn_once(
                "shape", "kv_events_malformed_store", hashes=len(event.block_hashes), tokens=len(event.token_ids), block_size=size
            )
        salt = None
        extra = event.extra_keys or ()
        for i in range(count):
            opaque, found = _split_extra(extra[i] if i < len(extra) else None, event.lora_name, event.parent_block_hash is None and i == 0)
            if opaque:
                count = i
                break
            salt = found if i == 0 else salt
        if count == 0:
            self.stats.skipped_events += 1
            return
        parent = None if event.parent_block_hash is None else _rank_key(event.parent_block_hash, rank)
        try:
            stored = self.sink.blocks_stored(
                self.backend,
                event.token_ids[: count * size],
                block_size=size,
                parent_engine_hash=parent,
                engine_hashes=[_rank_key(h, rank) for h in event.block_hashes[:count]],
                lora=event.lora_name,
                cache_salt=salt,
            )
        except ValueError as exc:
            self.stats.rejected_events += 1
            self._warn_once("rejected", "kv_event_rejected", error=str(exc))
            return
        if not stored:
            self.stats.orphan_events += 1
        self.stats.blocks_stored += len(stored)
