"""TensorRT-LLM's KV cache events (``POST /kv_cache_events``) and applying them to a KV event sink.

The server answers a JSON list and drains its buffer (``kv_cache_config.event_buffer_max_size``
must be > 0). Each item is ``{"event_id", "data", "window_size", "attention_dp_rank"?,
"hash_algo"?, "layer_group_id"?}`` (the last two from the V2 KV cache manager's serializer);
``data.type`` is one of:

* ``created``: the cache was (re)created: every block of the backend is forgotten;
* ``stored``: ``{"parent_hash", "blocks": [{"type": "stored_block", "block_hash", "tokens":
  [{"type": "unique_token", "token_id", "token_extra_id"}], "cache_level", "priority",
  "mm_keys"?, "cache_salt"?, "lora_id"?}]}``, blocks chained from ``parent_hash``;
* ``removed``: ``{"block_hashes": [...]}``;
* ``updated``: ``{"block_hash", "cache_level": {"type": "event_diff", "new_value", "old_value"} | null,
  "priority": ...}``; a block moved off the GPU (new cache level not 0) counts as removed.

Two encodings of a hash, by ``hash_algo``: integers (``v1_block_key``, the default of the V1
manager, and ``v2_sha256_64``; unsigned 64-bit, a negative value from a signed serializer is
read modulo 2**64) and hex strings (``v2_sha256``, the V2 manager's digests). Parsed hashes are
Python ints; a hex hash ``s`` becomes ``~int(s, 16)`` (negative), so the two encodings never
share a value. A token id may also be a hex string (a multimodal token of the V2 manager).

What the router indexes: it hashes the blocks' token ids itself (with the block's
``cache_salt`` on the first block of a chain, as the engine does). A block stops the stored run
(it and its successors are skipped) when it is keyed on something token ids do not carry: a
non-zero ``token_extra_id``, a multimodal token or key, a ``lora_id`` (the router keys adapters
by name), or, for ``v1_block_key`` hashes, an engine hash that differs from the one recomputed
from its tokens (`kvroute_tensorrt_llm.hashing`): V1 serializers never send ``lora_id``, so a
LoRA (or salted, or prompt-tuned) block looks like a base-model block except for its hash.
Only one KV stream is followed: the largest attention window, and within it the first layer
group seen (the V2 manager repeats each block once per layer group). Ranks of attention data
parallelism keep their engine hashes apart.

Exactness (`kvroute.adapters.KvEventFeed`, whose holding, losses, exact flag and counters this
feed shares): the backend is exact only while no event can have been skipped or lost since its
blocks were last cleared. A gap in a rank's event ids (``event_gap``), a malformed or unknown
event (``malformed_event``, ``unknown_event``), a poll that failed after the server may have
drained its buffer (the adapter's `TrtllmEventFeed.lose`), held events dropped
(``held_events_dropped``) each turn it off, with a ``kv_index_inexact`` log line and counters. It
comes back, with the backend's blocks cleared (an empty index claims nothing the engine lacks),
when the engine reports a new cache (``created``, or event ids starting again) or when the adapter
resyncs (`TrtllmEventFeed.resync`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import attrs

from kvroute.adapters import RANKS, ExactFlag, FeedStats, KvEventFeed, KvEventSink, rank_key
from kvroute.logs import get_logger
from kvroute_tensorrt_llm.hashing import v1_block_hash

__all__ = [
    "Created",
    "EventFormatError",
    "KvCacheEvent",
    "Malformed",
    "Removed",
    "Stored",
    "StoredBlock",
    "TrtllmEventFeed",
    "TrtllmFeedStats",
    "UnknownEvent",
    "Updated",
    "parse_events",
]

log = get_logger(__name__)

_MASK64 = (1 << 64) - 1
_HEX = re.compile(r"[0-9a-fA-F]+")
#: Hash algorithms whose integer hashes are the engine's V1 block-key hash (None: an older serializer).
_V1_ALGOS = (None, "v1_block_key")
#: Mismatching V1 hashes, with none matching, after which the check is taken to be wrong for this engine.
_HASH_CHECK_TRIALS = 32


class EventFormatError(ValueError):
    """A ``/kv_cache_events`` answer, or one event in it, does not have the layout TensorRT-LLM documents."""


def _int(value: object, where: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise EventFormatError(f"{where}: expected an integer{' or null' if optional else ''}, got {value!r}.")
    return value


def _hash(value: object, where: str) -> int:
    """An engine hash: an integer (read as unsigned 64-bit) or a hex string (as ``~int(value, 16)``)."""
    if isinstance(value, str):
        if not _HEX.fullmatch(value):
            raise EventFormatError(f"{where}: expected an integer or a hex string, got {value!r}.")
        return ~int(value, 16)
    h = _int(value, where)
    assert h is not None
    return h & _MASK64


@attrs.frozen
class StoredBlock:
    """One stored block: its engine hash, token ids and what else keys it.

    ``opaque``: token ids do not determine the block (extra ids, multimodal tokens or keys);
    a multimodal (hex) token id is kept as -1 so that the block still counts its tokens.
    """

    block_hash: int
    token_ids: tuple[int, ...]
    opaque: bool = False
    cache_level: int | None = None
    lora_id: int | None = None
    cache_salt: str | None = None


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


@attrs.frozen
class UnknownEvent:
    """An event of a type this adapter does not know (a newer server)."""

    kind: str


@attrs.frozen
class Malformed:
    """An event that does not have the documented layout; ``error`` says what did not fit."""

    error: str


Event = Created | Stored | Removed | Updated | UnknownEvent | Malformed


@attrs.frozen
class KvCacheEvent:
    """One item of the ``/kv_cache_events`` list (``event_id`` ``None``: not readable)."""

    event_id: int | None
    event: Event
    window_size: int | None = None
    rank: int = 0
    layer_group: int | None = None
    hash_algo: str | None = None


def _token(raw: object, where: str) -> tuple[int, bool]:
    """(token id, opaque) of one serialized token."""
    extra: int | None = 0
    if isinstance(raw, Mapping):
        tid = raw.get("token_id")
        extra = _int(raw.get("token_extra_id", 0), f"{where}.token_extra_id", optional=True)
    else:
        tid = raw  # a bare id
    if isinstance(tid, str):
        if not _HEX.fullmatch(tid):
            raise EventFormatError(f"{where}.token_id: expected an integer or a hex string, got {tid!r}.")
        return -1, True  # a multimodal token: its content is not a token id
    value = _int(tid, f"{where}.token_id")
    assert value is not None
    return value, bool(extra)


def _stored_block(raw: object, where: str) -> StoredBlock:
    if not isinstance(raw, Mapping):
        raise EventFormatError(f"{where}: expected a block object, got {type(raw).__name__}.")
    tokens = raw.get("tokens")
    if not isinstance(tokens, list):
        raise EventFormatError(
            f"{where}.tokens: expected a list of {{token_id, token_extra_id}}, got {type(tokens).__name__}."
        )
    ids = []
    opaque = False
    for j, token in enumerate(tokens):
        tid, odd = _token(token, f"{where}.tokens[{j}]")
        ids.append(tid)
        opaque = opaque or odd
    mm = raw.get("mm_keys")
    if mm is not None and not isinstance(mm, list):
        raise EventFormatError(f"{where}.mm_keys: expected a list or null, got {type(mm).__name__}.")
    salt = raw.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise EventFormatError(f"{where}.cache_salt: expected a string or null, got {salt!r}.")
    return StoredBlock(
        block_hash=_hash(raw.get("block_hash"), f"{where}.block_hash"),
        token_ids=tuple(ids),
        opaque=opaque or bool(mm),
        cache_level=_int(raw.get("cache_level"), f"{where}.cache_level", optional=True),
        lora_id=_int(raw.get("lora_id"), f"{where}.lora_id", optional=True),
        cache_salt=salt,
    )


def _event(data: object, where: str) -> Event:
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
        return UnknownEvent(kind)
    raise EventFormatError(f"{where}.type: expected a string, got {kind!r}.")


def _item(raw: object, where: str) -> KvCacheEvent:
    if not isinstance(raw, Mapping):
        raise EventFormatError(f"{where}: expected an object with 'event_id' and 'data', got {type(raw).__name__}.")
    event_id = _int(raw.get("event_id"), f"{where}.event_id")
    try:
        rank = _int(raw.get("attention_dp_rank"), f"{where}.attention_dp_rank", optional=True) or 0
        if not 0 <= rank < RANKS:
            raise EventFormatError(f"{where}.attention_dp_rank: expected 0 to {RANKS - 1}, got {rank}.")
        algo = raw.get("hash_algo")
        if algo is not None and not isinstance(algo, str):
            raise EventFormatError(f"{where}.hash_algo: expected a string or null, got {algo!r}.")
        return KvCacheEvent(
            event_id=event_id,
            event=_event(raw.get("data"), f"{where}.data"),
            window_size=_int(raw.get("window_size"), f"{where}.window_size", optional=True),
            rank=rank,
            layer_group=_int(raw.get("layer_group_id"), f"{where}.layer_group_id", optional=True),
            hash_algo=algo,
        )
    except EventFormatError as exc:
        return KvCacheEvent(event_id=event_id, event=Malformed(str(exc)))


def parse_events(data: object) -> list[KvCacheEvent]:
    """Parse a ``/kv_cache_events`` answer, one event at a time.

    An event that does not fit becomes a `Malformed` item (with its ``event_id`` when that
    much is readable) and costs only itself; `EventFormatError` only when the answer is not a list.
    """
    if not isinstance(data, list):
        raise EventFormatError(f"expected /kv_cache_events to answer a JSON list, got {type(data).__name__}.")
    out = []
    for i, raw in enumerate(data):
        where = f"/kv_cache_events[{i}]"
        try:
            out.append(_item(raw, where))
        except EventFormatError as exc:
            out.append(KvCacheEvent(event_id=None, event=Malformed(str(exc))))
    return out


@attrs.define
class TrtllmFeedStats(FeedStats):
    """The counters every feed keeps (`kvroute.adapters.FeedStats`), plus TensorRT-LLM's."""

    #: Events received, event ids skipped over, malformed events, events of unknown types.
    events: int = 0
    lost_events: int = 0
    malformed: int = 0
    unknown: int = 0
    #: Blocks whose engine hash says they are keyed on more than their tokens (LoRA, salt...).
    keyed_blocks: int = 0


_UNSET: Any = object()


class TrtllmEventFeed(KvEventFeed[KvCacheEvent]):
    """Apply one backend's TensorRT-LLM events to ``sink``, in order, and keep its exact flag honest.

    One feed carries every attention-DP rank (each item names its own). ``engine_block_size``
    (tokens per block) comes from the metrics when known; otherwise a stored block's token count
    tells it. The backend is exact from `start` (the first answer) to `stop`.
    """

    logger: ClassVar[Any] = log
    stats: TrtllmFeedStats

    def __init__(
        self, backend: str, sink: KvEventSink, *, max_held: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        # Not subscribed until the first answer; the sink holds the backend as inexact until then.
        flag = ExactFlag(backend, sink, reported=False)
        super().__init__(backend, sink, max_held=max_held, exact_flag=flag, stats=TrtllmFeedStats(), clock=clock)
        self.engine_block_size: int | None = None
        self._last_id: dict[int, int] = {}
        self._window: int | None = None
        self._group: int | None = _UNSET
        #: V1 hash check: None until a hash matched (or enough did not), then on (True) or off (False).
        self._hash_check: bool | None = None
        self._hash_misses = 0

    def start(self) -> None:
        """The first answer arrived: clear the backend and mark it exact."""
        self.resync("subscribed")
        self.subscribe()

    def stop(self) -> None:
        """The feed ends: the backend goes back to the strategy's own records."""
        self.unsubscribe()

    # -- events -------------------------------------------------------------------------

    def _size_of(self, event: Stored) -> int | None:
        if self.engine_block_size:
            return self.engine_block_size
        return len(event.blocks[0].token_ids) if event.blocks else None

    def _fits(self, item: KvCacheEvent) -> bool:
        if not isinstance(item.event, Stored) or not item.event.blocks:
            return True
        return self._size_of(item.event) == self.sink.block_size

    def _engine_block_size(self, item: KvCacheEvent) -> int | None:
        return self._size_of(item.event) if isinstance(item.event, Stored) else self.engine_block_size

    def receive(self, items: Iterable[KvCacheEvent]) -> None:
        """Events from one poll, in order."""
        for item in items:
            self.stats.events += 1
            if item.event_id is not None:
                self._sequence(item.rank, item.event_id)
            self.offer(item)

    def _sequence(self, rank: int, event_id: int) -> None:
        last = self._last_id.get(rank)
        if last is not None and event_id <= last:
            # The counter started again: the server restarted, and its cache with it.
            log.warning("kv_events_restarted", backend=self.backend, rank=rank, event_id=event_id, last=last)
            self._drop_held()
            self._last_id.clear()
            self.engine_cleared("engine_restarted")
        elif last is not None and event_id > last + 1:
            count = event_id - last - 1
            self.stats.lost_events += count
            self.lose("event_gap", rank=rank, after=last, count=count)
        self._last_id[rank] = event_id

    def _follows(self, item: KvCacheEvent) -> bool:
        """Whether the event belongs to the stream the index follows (largest window, first layer group)."""
        window = item.window_size
        if window is not None:
            if self._window is None or window > self._window:
                self._window = window
                self._group = item.layer_group
                return True
            if window < self._window:
                return False
        if self._group is _UNSET:
            self._group = item.layer_group
        return bool(item.layer_group == self._group)

    def _apply(self, item: KvCacheEvent) -> None:
        event = item.event
        if isinstance(event, Malformed):
            self.stats.malformed += 1
            self.lose("malformed_event", event_id=item.event_id, error=event.error)
            return
        if isinstance(event, UnknownEvent):
            self.stats.unknown += 1
            self.lose("unknown_event", event_id=item.event_id, type=event.kind)
            return
        if isinstance(event, Created):
            self._last_id.clear()
            if item.event_id is not None:
                self._last_id[item.rank] = item.event_id
            self.engine_cleared("cache_created")
            return
        if not self._follows(item):
            self.stats.skipped_events += 1
            return
        if isinstance(event, Stored):
            self._stored(event, item)
        elif isinstance(event, Removed):
            keys = [rank_key(h, item.rank) for h in event.block_hashes]
            self.stats.blocks_removed += self.sink.blocks_removed(self.backend, keys)
        elif event.cache_level is not None and event.cache_level != 0:  # Updated: moved off the GPU
            self.stats.blocks_removed += self.sink.blocks_removed(self.backend, [rank_key(event.block_hash, item.rank)])

    def _keyed_as_tokens(self, block: StoredBlock, parent: int | None, algo: str | None) -> bool:
        """Whether the engine's V1 hash of ``block`` is the hash of its tokens alone (True when it cannot tell)."""
        if (
            self._hash_check is False
            or algo not in _V1_ALGOS
            or block.block_hash < 0
            or (parent is not None and parent < 0)
        ):
            return True
        if parent is None and block.cache_salt is not None:
            return True  # a named salt on the first block: mixed in by the engine, and by the router too
        if v1_block_hash(block.token_ids, parent or 0) == block.block_hash:
            if self._hash_check is None:
                self._hash_check = True
            return True
        self.stats.keyed_blocks += 1
        if self._hash_check is None:
            self._hash_misses += 1
            if self._hash_misses >= _HASH_CHECK_TRIALS:
                self._hash_check = False
                log.warning(
                    "kv_events_hash_check_off",
                    backend=self.backend,
                    mismatches=self._hash_misses,
                    hint="this engine's v1_block_key hash differs from the known one: LoRA blocks cannot be told apart",
                )
        return False

    def _stored(self, event: Stored, item: KvCacheEvent) -> None:
        size = self._size_of(event)
        if not size:
            return
        usable: list[StoredBlock] = []
        parent = event.parent_hash
        for block in event.blocks:
            if (
                block.opaque
                or block.lora_id is not None
                or block.cache_level not in (None, 0)
                or len(block.token_ids) != size
            ):
                if block.lora_id is not None:
                    self._warn_once("lora", "kv_events_lora_by_id", hint="TensorRT-LLM names LoRA adapters by id only")
                break
            if not self._keyed_as_tokens(block, parent, item.hash_algo):
                self._warn_once(
                    "keyed",
                    "kv_events_keyed_blocks_skipped",
                    level="info",
                    hint="blocks keyed on a LoRA task, cache salt or extra ids the event does not name are not indexed",
                )
                break
            usable.append(block)
            parent = block.block_hash
        if not usable:
            self.stats.skipped_events += 1
            return
        tokens: list[int] = [t for b in usable for t in b.token_ids]
        rank = item.rank
        try:
            stored = self.sink.blocks_stored(
                self.backend,
                tokens,
                block_size=size,
                parent_engine_hash=None if event.parent_hash is None else rank_key(event.parent_hash, rank),
                engine_hashes=[rank_key(b.block_hash, rank) for b in usable],
                cache_salt=usable[0].cache_salt if event.parent_hash is None else None,
            )
        except ValueError as exc:
            self.stats.rejected_events += 1
            self._warn_once("rejected", "kv_event_rejected", error=str(exc))
            return
        if not stored:
            self.stats.orphan_events += 1
        self.stats.blocks_stored += len(stored)


def flatten(blocks: Sequence[StoredBlock]) -> list[int]:
    """The token ids of consecutive blocks, flat (tests, debugging)."""
    return [t for b in blocks for t in b.token_ids]
