"""Decoding vLLM's KV event messages: the captured real stream, the older positional layout, and bad input."""

from __future__ import annotations

import msgpack
import pytest
from kvroute_vllm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventFormatError,
    UnknownEvent,
    decode_batch,
    decode_message,
)

from tests.contrib.vllm.vllm_fakes import as_positional, captured_messages, kv_events


def _pack(events: list[object], *, rank: bool = True) -> bytes:
    return msgpack.packb([1.5, events, 0] if rank else [1.5, events])


class TestDecodeMessage:
    def test_captured_stream(self) -> None:
        """The 11 captured messages decode to 10 stored, 19 removed and 1 cleared event, seq 0..10, rank 0."""
        batches = [decode_message(frames, b"kv") for frames in captured_messages()]
        events = [e for b in batches for e in b.events]
        assert [b.seq for b in batches] == list(range(11))
        assert {b.data_parallel_rank for b in batches} == {0}
        assert sum(isinstance(e, BlockStored) for e in events) == 10
        assert sum(isinstance(e, BlockRemoved) for e in events) == 19
        assert sum(isinstance(e, AllBlocksCleared) for e in events) == 1

    def test_captured_first_store_holds_the_chat_prompt(self) -> None:
        """The first two stores carry the chat prompt's first 3,200 tokens, chained by parent hash."""
        data = kv_events()
        first, second = (decode_message(f).events[0] for f in captured_messages()[:2])
        assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
        assert first.parent_block_hash is None and second.parent_block_hash == first.block_hashes[-1]
        assert list(first.token_ids + second.token_ids) == data["chat_prompt_token_ids"][:3200]
        assert (first.block_size, first.medium, first.group_idx, first.kv_cache_spec_kind) == (
            128,
            "GPU",
            0,
            "full_attention",
        )
        assert any(h >= 2**63 for b in (first, second) for h in b.block_hashes)

    def test_positional_layout_decodes_to_the_same_events(self) -> None:
        """Older servers' positional arrays (and batches without a rank) give the same stores and removals."""
        for frames in captured_messages():
            seq = int.from_bytes(frames[1], "big")
            tagged = decode_batch(seq, frames[2])
            old = decode_batch(seq, as_positional(frames[2]))
            assert old.data_parallel_rank is None
            for a, b in zip(tagged.events, old.events, strict=True):
                assert type(a) is type(b)
                if isinstance(a, BlockStored):
                    assert isinstance(b, BlockStored)
                    assert (a.block_hashes, a.parent_block_hash, a.token_ids, a.block_size) == (
                        b.block_hashes,
                        b.parent_block_hash,
                        b.token_ids,
                        b.block_size,
                    )
                elif isinstance(a, BlockRemoved):
                    assert isinstance(b, BlockRemoved)
                    assert a.block_hashes == b.block_hashes

    def test_bytes_hashes_become_integers(self) -> None:
        """With integer hashes turned off vLLM sends digests as bytes; they are read as big-endian integers."""
        digest = bytes(range(32))
        event = {"type": "BlockRemoved", "block_hashes": [digest], "medium": "GPU"}
        (removed,) = decode_batch(0, _pack([event])).events
        assert isinstance(removed, BlockRemoved)
        assert removed.block_hashes == (int.from_bytes(digest, "big"),)

    def test_unknown_event_types_are_kept_as_unknown(self) -> None:
        """An event type this version does not know decodes to UnknownEvent (so the feed can count it), the rest is
        kept."""
        batch = decode_batch(3, _pack([{"type": "BlockPinned", "x": 1}, {"type": "AllBlocksCleared"}]))
        assert batch.events == (UnknownEvent("BlockPinned"), AllBlocksCleared())

    @pytest.mark.parametrize(
        ("frames", "message"),
        [
            ([b"kv", b"\0" * 8], "3 frames"),
            ([b"other", b"\0" * 8, _pack([])], "topic"),
            ([b"kv", b"\0" * 4, _pack([])], "8-byte sequence"),
            ([b"kv", b"\0" * 8, b"\xc1"], "not msgpack"),
            ([b"kv", b"\0" * 8, msgpack.packb({"ts": 1})], "expected a map with 'ts' and 'events'"),
            ([b"kv", b"\0" * 8, msgpack.packb("batch")], "expected an array"),
            ([b"kv", b"\0" * 8, msgpack.packb(["x", []])], "timestamp"),
            ([b"kv", b"\0" * 8, msgpack.packb([1.0, {}])], "list of events"),
            ([b"kv", b"\0" * 8, _pack([7])], "'type' key"),
            ([b"kv", b"\0" * 8, _pack([{"type": "BlockStored", "block_hashes": [1]}])], "missing field"),
            (
                [
                    b"kv",
                    b"\0" * 8,
                    _pack([{"type": "BlockStored", "block_hashes": [1], "token_ids": ["a"], "block_size": 2}]),
                ],
                "list of integers",
            ),
            (
                [
                    b"kv",
                    b"\0" * 8,
                    _pack([{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 0}]),
                ],
                "positive integer",
            ),
            ([b"kv", b"\0" * 8, _pack([{"type": "BlockRemoved", "block_hashes": [1.5]}])], "block hash"),
            ([b"kv", b"\0" * 8, msgpack.packb([1.0, [], "one"])], r"data_parallel_rank: expected an integer or null"),
        ],
    )
    def test_malformed_messages_say_what_was_expected(self, frames: list[bytes], message: str) -> None:
        """Every malformed message raises EventFormatError naming what was expected."""
        with pytest.raises(EventFormatError, match=message):
            decode_message(frames, b"kv")
