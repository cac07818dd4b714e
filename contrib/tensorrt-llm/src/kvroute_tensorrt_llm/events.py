"""TensorRT-LLM's KV cache events (``POST /kv_cache_events``) and applying them to a KV event sink.

The server answers a JSON list and drains its buffer (``kv_cache_config.event_buffer_max_size``
must be > 0). Each item is ``{"event_id", "data", "window_size"?, "attention_dp_rank"?}``;
``data.type`` is one of:

* ``created``: the cache was (re)created: every block of the backend is forgotten;
* ``stored``: ``{"parent_hash", "blocks": [{"block_hash", "tokens": [{"token_id", "token_extra_id"}],
  "cache_level", "priority", "lora_id"?, "mm_keys"?}]}``, blocks chained from ``parent_hash``;
* ``removed``: ``{"block_hashes": [...]}``;
* ``updated``: a block's ``cache_level`` or ``priority`` changed; a block moved off the GPU
  (``cache_level`` 0 -> 1, offloaded to host memory) counts as removed.

Hashes are unsigned 64-bit and may exceed the signed range (JSON integers are arbitrary
precision in Python; a negative value from a signed serializer is read modulo 2**64).
The router hashes the blocks' token ids itself; a block with a non-zero ``token_extra_id``
(prompt-tuning or multimodal), multimodal keys or a LoRA id (the router keys adapters by
name) ends the stored run: it and its successors are skipped. Only the largest attention
window is tracked (full attention when a model mixes window sizes); ranks of attention data
parallelism get their engine hashes offset by ``rank << 64``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from kvroute.adapters import KvEventSink
from kvroute.logs import get_logger

__all__ = ["Created", "EventFeed", "EventFormatError", "FeedStats", "Removed", "Stored", "StoredBlock", "Updated", "parse_events"]

log = get_logger(__name__)

_MASK64 = (1 << 64) - 1


class EventFormatError(ValueError):
    """A ``/kv_cache_events`` answer does not have the layout TensorRT-LLM documents."""


def _int(value: object, where: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise EventFormatError(f"{where}: expected an integer{' or null' if optional else ''}, got {value!r}.")
    return value


def _hash(value: object, where: str) -> int:
    h = _int(value, where)
    assert h is not None
    return h & _MASK64


@attrs.frozen
class StoredBlock:
    """One stored block: its engine hash, token ids and what else keys it."""

    block_hash: int
    token_ids: tuple[int, ...]
    opaque: bool = False
    cache_level: int | None = None
    lora_id: int | None = None


@attrs.frozen
class Created:
    """The KV cache was created (server start or re-creation)."""


@attrs.frozen
class Stored:
    """A chain of blocks was stored after ``parent_hash`` (``None``: from the root)."""

    parent_hash: int | None
    blocks: tuple[StoredBlock, ...]


@attrs.frozen
class Removed:
    """Blocks were evicted."""

    block_hashes: tuple[int, ...]


@attrs.frozen
class Updated:
    """A block's cache level or priority changed (``cache_level``: the new level, if it changed)."""

    block_hash: int
    cache_level: int | None = None


Event = Created | Stored | Removed | Updated


@attrs.frozen
class KvCacheEvent:
    """One item of the ``/kv_cache_events`` list."""

    event_id: int
    event: Event | None
    window_size: int | None = None
    rank: int = 0


def _stored_block(raw: object, where: str) -> StoredBlock:
    if not isinstance(raw, Mapping):
        raise EventFormatError(f"{where}: expected a block object, got {type(raw).__name__}.")
    tokens = raw.get("tokens")
    if not isinstance(tokens, list):
        raise EventFormatError(f"{where}.tokens: expected a list of {{token_id, token_extra_id}}, got {type(tokens).__name__}.")
    ids = []
    opaque = False
    for j, token in enumerate(tokens):
        if isinstance(token, Mapping):
            tid = _int(token.get("token_id"), f"{where}.tokens[{j}].token_id")
            extra = _int(token.get("token_extra_id", 0), f"{where}.tokens[{j}].token_extra_id", optional=True)
            opaque = opaque or bool(extra)
        else:
            tid = _int(token, f"{where}.tokens[{j}]")
        assert tid is not None
        ids.append(tid)
    mm = raw.get("mm_keys")
    return StoredBlock(
        block_hash=_hash(raw.get("block_hash"), f"{where}.block_hash"),
        token_ids=tuple(ids),
        opaque=opaque or bool(mm),
        cache_level=_int(raw.get("cache_level"), f"{where}.cache_level", optional=True),
        lora_id=_int(raw.get("lora_id"), f"{where}.lora_id", optional=True),
    )


def _event(data: object, where: str) -> Event | None:
    if not isinstance(data, Mapping):
        raise EventFormatError(f"{where}: expected an object with a 'type', got {type(data).__name__}.")
    kind = data.get("type")
    if kind == "created":
        return Created()
    if kind == "stored":
        blocks = data.get("blocks")
        if not isinstance(blocks, list):
            raise EventFormatError(f"{where}.blocks: expected a list, got {type(blocks).__name__}.")
        parent = data.get("parent_hash")
        return Stored(
            parent_hash=None if parent is None else _hash(parent, f"{where}.parent_hash"),
            blocks=tuple(_stored_block(b, f"{where}.blocks[{i}]") for i, b in enumerate(blocks)),
        )
    if kind == "removed":
        hashes = data.get("block_hashes")
        if not isinstance(hashes, list):
            raise EventFormatError(f"{where}.block_hashes: expected a list, got {type(hashes).__name__}.")
        return Removed(tuple(_hash(h, f"{where}.block_hashes[{i}]") for i, h in enumerate(hashes)))
    if kind == "updated":
        level = data.get("cache_level")
        new_level = None
        if isinstance(level, Mapping):
            new_level = _int(level.get("new_value"), f"{where}.cache_level.new_value", optional=True)
        elif level is not None:
            new_level = _int(level, f"{where}.cache_level", optional=True)
        return Updated(_hash(data.get("block_hash"), f"{where}.block_hash"), new_level)
    if isinstance(kind, str):
        return None  # a newer event type: skipped
    raise EventFormatError(f"{where}.type: expected a string, got {kind!r}.")


def parse_events(data: object) -> list[KvCacheEvent]:
    """Parse a ``/kv_cache_events`` answer; `EventFormatError` names the first thing that does not fit."""
    if not isinstance(data, list):
        raise EventFormatError(f"expected /kv_cache_events to answer a JSON list, got {type(data).__name__}.")
    out = []
    for i, item in enumerate(data):
        where = f"/kv_cache_events[{i}]"
        if not isinstance(item, Mapping):
            raise EventFormatError(f"{where}: expected an object with 'event_id' and 'data', got {type(item).__name__}.")
        event_id = _int(item.get("event_id"), f"{where}.event_id")
        assert event_id is not None
        out.append(
            KvCacheEvent(
                event_id=event_id,
                event=_event(item.get("data"), f"{where}.data"),
                window_size=_int(item.get("window_size"), f"{where}.window_size", optional=True),
                rank=_int(item.get("attention_dp_rank"), f"{where}.attention_dp_rank", optional=True) or 0,
            )
        )
    return out


@attrs.define
class FeedStats:
    """Counters of one backend's event feed."""

    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    cleared: int = 0
    lost_events: int = 0
    held: int = 0
    dropped_held: int = 0
    orphan_events: int = 0
    skipped: int = 0
    rejected: int = 0


def _key(engine_hash: int, rank: int) -> int:
    return engine_hash + (rank << 64) if rank else engine_hash


class EventFeed:
    """Apply one backend's TensorRT-LLM events to ``sink``, in order, holding them while block sizes disagree.

    ``engine_block_size`` (tokens per block) comes from the metrics when known; otherwise a
    stored block's token count tells it.
    """

    def __init__(self, backend: str, sink: KvEventSink, *, max_held: int = 100_000) -> None:
        self.backend = backend
        self.sink = sink
        self.max_held = max_held
        self.engine_block_size: int | None = None
        self.stats = FeedStats()
        self._last_id: dict[int, int] = {}
        self._window: int | None = None
        self._held: deque[KvCacheEvent] = deque()
        self._warned: set[str] = set()

    @property
    def holding(self) -> int:
        return len(self._held)

    def _size_of(self, event: Stored) -> int | None:
        if self.engine_block_size:
            return self.engine_block_size
        return len(event.blocks[0].token_ids) if event.blocks else None

    def _fits(self, item: KvCacheEvent) -> bool:
        if not isinstance(item.event, Stored) or not item.event.blocks:
            return True
        return self._size_of(item.event) == self.sink.block_size

    def receive(self, items: Iterable[KvCacheEvent]) -> None:
        """Events from one poll, in order."""
        for item in items:
            self.stats.events += 1
            last = self._last_id.get(item.rank)
            if last is not None and item.event_id <= last:
                # The counter started again: the server restarted, and its cache with it.
                log.warning("kv_events_restarted", backend=self.backend, rank=item.rank, event_id=item.event_id, last=last)
                self.sink.all_cleared(self.backend)
                self.stats.cleared += 1
                self._held.clear()
                self._last_id.clear()
            elif last is not None and item.event_id > last + 1:
                self.stats.lost_events += item.event_id - last - 1
                log.warning("kv_events_lost", backend=self.backend, rank=item.rank, after=last, count=item.event_id - last - 1)
            self._last_id[item.rank] = item.event_id
            if self._held or not self._fits(item):
                self._held.append(item)
                self.stats.held += 1
                if len(self._held) > self.max_held:
                    self._held.popleft()
                    self.stats.dropped_held += 1
                    self._warn_once(
                        "overflow", "kv_events_block_size_mismatch", router_block_size=self.sink.block_size,
                        engine_block_size=self.engine_block_size,
                        hint="leave the strategy's block_size unset or set it to the engine's tokens_per_block",
                    )
                continue
            self._apply(item)

    def resume(self) -> int:
        """Apply held events once the sink's block size equals the engine's; returns how many."""
        applied = 0
        while self._held and self._fits(self._held[0]):
            self._apply(self._held.popleft())
            applied += 1
        return applied

    def _warn_once(self, key: str, event: str, **context: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(event, backend=self.backend, **context)

    def _apply(self, item: KvCacheEvent) -> None:
        event = item.event
        if isinstance(event, Created):
            self.sink.all_cleared(self.backend)
            self.stats.cleared += 1
            self._last_id.clear()
            self._last_id[item.rank] = item.event_id
            return
        if item.window_size is not None:
            if self._window is None or item.window_size > self._window:
                self._window = item.window_size
            elif item.window_size < self._window:
                self.stats.skipped += 1
                return
        if isinstance(event, Stored):
            self._stored(event, item.rank)
        elif isinstance(event, Removed):
            self.stats.blocks_removed += self.sink.blocks_removed(self.backend, [_key(h, item.rank) for h in event.block_hashes])
        elif isinstance(event, Updated):
            if event.cache_level is not None and event.cache_level != 0:
                self.stats.blocks_removed += self.sink.blocks_removed(self.backend, [_key(event.block_hash, item.rank)])
        else:
            self.stats.skipped += 1

    def _stored(self, event: Stored, rank: int) -> None:
        size = self._size_of(event)
        if not size:
            return
        usable: list[StoredBlock] = []
        for block in event.blocks:
            if block.opaque or block.lora_id is not None or block.cache_level not in (None, 0) or len(block.token_ids) != size:
                if block.lora_id is not None:
                    self._warn_once("lora", "kv_events_lora_by_id", hint="TensorRT-LLM names LoRA adapters by id only")
                break
            usable.append(block)
        if not usable:
            self.stats.skipped += 1
            return
        tokens: list[int] = [t for b in usable for t in b.token_ids]
        try:
            stored = self.sink.blocks_stored(
                self.backend,
                tokens,
                block_size=size,
                parent_engine_hash=None if event.parent_hash is None else _key(event.parent_hash, rank),
                engine_hashes=[_key(b.block_hash, rank) for b in usable],
            )
        except ValueError as exc:
            self.stats.rejected += 1
            self._warn_once("rejected", "kv_event_rejected", error=str(exc))
            return
        if not stored:
            self.stats.orphan_events += 1
        self.stats.blocks_stored += len(stored)


def flatten(blocks: Sequence[StoredBlock]) -> list[int]:
    """The token ids of consecutive blocks, flat (tests, debugging)."""
    return [t for b in blocks for t in b.token_ids]
