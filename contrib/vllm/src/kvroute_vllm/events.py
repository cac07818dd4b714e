"""vLLM's KV cache events: decoding the ZMQ messages into plain typed events.

A message is three frames, ``[topic, seq (8 bytes, big-endian), payload]``; the payload is
msgpack-encoded by vLLM's msgspec encoder. The shapes of the releases read from their sources
(vLLM 0.20 to 0.33, see docs/adapters.md) are all accepted:

* the batch: an array ``[ts, [event, ...], data_parallel_rank]`` (released servers; the rank
  is left out when unset), or a map ``{"ts": ..., "events": [...], "data_parallel_rank": ...}``
  (builds whose ``EventBatch`` struct is not ``array_like``);
* events: maps tagged by ``"type"`` (``{"type": "BlockStored", "block_hashes": [...], ...}``,
  vLLM 0.24 on; fields equal to their default are left out), or positional arrays whose
  first item is the type name, fields in declaration order (``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
  group_idx, kv_cache_spec_kind, ...]``, up to 0.23; older servers stop earlier).

Replay replies (`decode_replay_reply`) carry the topic from vLLM 0.26 on, ``[b"", topic, seq,
payload]``, and none before, ``[b"", seq, payload]``; both end with seq -1 and an empty payload.

Block hashes are unsigned 64-bit integers (or, with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``,
raw digests as bytes, turned into integers here): they only name blocks, the router never
tries to reproduce them. Anything that does not fit raises `EventFormatError` saying what was
expected and what was found.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import msgpack

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventFormatError",
    "KvEvent",
    "UnknownEvent",
    "decode_batch",
    "decode_message",
    "decode_replay_reply",
]

#: The sequence number vLLM's replay socket sends after the last buffered batch (-1, signed).
END_SEQ = (-1).to_bytes(8, "big", signed=True)

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")


class EventFormatError(ValueError):
    """A KV event message does not have the layout vLLM documents."""


def _hash(value: object, where: str) -> int:
    if isinstance(value, bool):
        raise EventFormatError(f"{where}: expected a block hash (integer or bytes), got {value!r}.")
    if isinstance(value, int):
        return value
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big")
    raise EventFormatError(f"{where}: expected a block hash (integer or bytes), got {type(value).__name__}.")


def _hashes(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise EventFormatError(f"{where}: expected a list of block hashes, got {type(value).__name__}.")
    return tuple(_hash(v, where) for v in value)


def _optional_str(value: object, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise EventFormatError(f"{where}: expected a string or null, got {type(value).__name__}.")


def _optional_int(value: object, where: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise EventFormatError(f"{where}: expected an integer or null, got {value!r}.")


@attrs.frozen
class BlockStored:
    """Full blocks were stored: their hashes, their tokens (flat), and the block before the first."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    #: The KV cache group's kind (``full_attention``, ``mla_attention``, ``sliding_window``...; vLLM 0.22+).
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    #: Whether the engine hashed tokens past each block into its hash (vLLM 0.33 ``lookahead_token_ids``).
    lookahead: bool = False

    @classmethod
    def from_fields(cls, data: Mapping[str, Any], where: str = "BlockStored") -> BlockStored:
        """Build from decoded fields, checking types and that ``token_ids`` fill the blocks."""
        missing = [k for k in ("block_hashes", "token_ids", "block_size") if k not in data]
        if missing:
            raise EventFormatError(f"{where}: missing field(s) {', '.join(missing)} (got {', '.join(map(str, data))}).")
        hashes = _hashes(data["block_hashes"], f"{where}.block_hashes")
        parent = data.get("parent_block_hash")
        tokens = data["token_ids"]
        if not isinstance(tokens, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise EventFormatError(f"{where}.token_ids: expected a list of integers, got {type(tokens).__name__}.")
        block_size = data["block_size"]
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise EventFormatError(f"{where}.block_size: expected a positive integer, got {block_size!r}.")
        extra = data.get("extra_keys")
        if extra is not None and not isinstance(extra, list | tuple):
            raise EventFormatError(
                f"{where}.extra_keys: expected a list (one entry per block) or null, got {type(extra).__name__}."
            )
        return cls(
            block_hashes=hashes,
            parent_block_hash=None if parent is None else _hash(parent, f"{where}.parent_block_hash"),
            token_ids=tuple(tokens),
            block_size=block_size,
            lora_id=_optional_int(data.get("lora_id"), f"{where}.lora_id"),
            medium=_optional_str(data.get("medium"), f"{where}.medium"),
            lora_name=_optional_str(data.get("lora_name"), f"{where}.lora_name"),
            extra_keys=tuple(extra) if extra is not None else None,
            group_idx=_optional_int(data.get("group_idx"), f"{where}.group_idx"),
            kv_cache_spec_kind=_optional_str(data.get("kv_cache_spec_kind"), f"{where}.kv_cache_spec_kind"),
            kv_cache_spec_sliding_window=_optional_int(
                data.get("kv_cache_spec_sliding_window"), f"{where}.kv_cache_spec_sliding_window"
            ),
            lookahead=data.get("lookahead_token_ids") is not None,
        )


@attrs.frozen
class BlockRemoved:
    """Blocks were evicted (named by the engine's hashes)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None

    @classmethod
    def from_fields(cls, data: Mapping[str, Any], where: str = "BlockRemoved") -> BlockRemoved:
        if "block_hashes" not in data:
            raise EventFormatError(f"{where}: missing field block_hashes (got {', '.join(map(str, data))}).")
        return cls(
            block_hashes=_hashes(data["block_hashes"], f"{where}.block_hashes"),
            medium=_optional_str(data.get("medium"), f"{where}.medium"),
            group_idx=_optional_int(data.get("group_idx"), f"{where}.group_idx"),
        )


@attrs.frozen
class AllBlocksCleared:
    """Every cached block was dropped (``/reset_prefix_cache``, or a restart)."""


@attrs.frozen
class UnknownEvent:
    """An event type this adapter does not know (a newer vLLM's): kept so the feed can say it skipped one."""

    type: str


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@attrs.frozen
class EventBatch:
    """One published message: its sequence number, timestamp, engine rank and events."""

    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None


def _event(raw: object, where: str) -> KvEvent:
    """One event in either layout; an `UnknownEvent` for a type this version does not know."""
    if isinstance(raw, Mapping):
        kind = raw.get("type")
        fields: Mapping[str, Any] = raw
    elif isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS if kind == "BlockRemoved" else ()
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise EventFormatError(
            f"{where}: expected an event as a map with a 'type' key or an array starting with the type name, "
            f"got {type(raw).__name__} {str(raw)[:80]}."
        )
    if kind == "BlockStored":
        return BlockStored.from_fields(fields, f"{where} BlockStored")
    if kind == "BlockRemoved":
        return BlockRemoved.from_fields(fields, f"{where} BlockRemoved")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if isinstance(kind, str):
        return UnknownEvent(kind)  # a newer event type: not an error, but the feed cannot apply it
    raise EventFormatError(f"{where}: expected a string event type, got {kind!r}.")


def decode_batch(seq: int, payload: bytes) -> EventBatch:
    """Decode one msgpack payload: ``[ts, [event, ...], data_parallel_rank?]`` or the same as a map."""
    where = f"KV event batch seq {seq}"
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise EventFormatError(f"{where}: payload is not msgpack: {exc}.") from None
    if isinstance(data, Mapping):
        if "ts" not in data or "events" not in data:
            raise EventFormatError(
                f"{where}: expected a map with 'ts' and 'events' (and optionally 'data_parallel_rank'), "
                f"got keys {', '.join(map(str, data)) or 'none'}."
            )
        ts, raw_events, rank = data["ts"], data["events"], data.get("data_parallel_rank")
    elif isinstance(data, list | tuple) and len(data) in (2, 3):
        ts, raw_events = data[0], data[1]
        rank = data[2] if len(data) == 3 else None
    else:
        raise EventFormatError(
            f"{where}: expected an array [ts, events, data_parallel_rank] or a map with 'ts' and 'events', "
            f"got {str(data)[:80]}."
        )
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise EventFormatError(f"{where}: expected a timestamp first, got {ts!r}.")
    if not isinstance(raw_events, list | tuple):
        raise EventFormatError(f"{where}: expected a list of events second, got {type(raw_events).__name__}.")
    events = tuple(_event(raw, f"{where} event {i}") for i, raw in enumerate(raw_events))
    # Any integer rank decodes: the feed refuses one that makes no sense (negative, past the ranks) as a loss.
    rank = _optional_int(rank, f"{where}.data_parallel_rank")
    return EventBatch(seq=seq, ts=float(ts), events=events, data_parallel_rank=rank)


def decode_message(frames: Sequence[bytes], topic: bytes | None = None) -> EventBatch:
    """Decode a ``[topic, seq, payload]`` message (the topic is checked when given)."""
    if len(frames) != 3:
        raise EventFormatError(
            f"expected a KV event message of 3 frames [topic, seq, payload], got {len(frames)} frame(s)."
        )
    got_topic, seq_bytes, payload = frames
    if topic is not None and got_topic != topic:
        raise EventFormatError(f"expected KV events on topic {topic!r}, got topic {bytes(got_topic)!r}.")
    if len(seq_bytes) != 8:
        raise EventFormatError(f"expected an 8-byte sequence number, got {len(seq_bytes)} byte(s).")
    return decode_batch(int.from_bytes(seq_bytes, "big"), bytes(payload))


def decode_replay_reply(frames: Sequence[bytes], topic: bytes | None = None) -> EventBatch | None:
    """One reply of the replay socket as a DEALER receives it; ``None`` for the end marker.

    vLLM 0.26 and later send ``[b"", topic, seq, payload]``; earlier releases send
    ``[b"", seq, payload]`` (no topic frame). The end marker is seq -1 with an empty payload
    (``[b"", b"", -1, b""]`` or ``[b"", -1, b""]``). The topic is checked when given and present.
    """
    if len(frames) == 4 and frames[0] == b"":
        _, got_topic, seq_bytes, payload = frames
    elif len(frames) == 3 and frames[0] == b"":
        _, seq_bytes, payload = frames
        got_topic = None
    else:
        got = f"{len(frames)} frame(s) starting with {bytes(frames[0])[:16]!r}" if frames else "no frames"
        raise EventFormatError(
            "expected a replay reply [b'', topic, seq, payload] (vLLM 0.26+) or [b'', seq, payload] (earlier), "
            f"got {got}."
        )
    if bytes(seq_bytes) == END_SEQ:
        return None
    if got_topic is not None and topic is not None and got_topic != topic:
        raise EventFormatError(f"expected replayed KV events on topic {topic!r}, got topic {bytes(got_topic)!r}.")
    if len(seq_bytes) != 8:
        raise EventFormatError(f"expected an 8-byte sequence number, got {len(seq_bytes)} byte(s).")
    return decode_batch(int.from_bytes(seq_bytes, "big"), bytes(payload))
