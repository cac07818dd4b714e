"""TensorRT-LLM's /kv_cache_events: parsing (nulls, hashes above int64) and applying them to the block index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kvroute_tensorrt_llm import Created, EventFeed, EventFormatError, Removed, Stored, Updated, parse_events
from kvroute_tokenizer_prefix import BlockIndex, block_hashes

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BS = 32


def _answers() -> list[list[dict[str, Any]]]:
    return json.loads((FIXTURES / "kv_cache_events_sequence.json").read_text())


def _ids(start: int, n: int = BS) -> list[int]:
    return list(range(start, start + n))


def _stored(event_id: int, hashes: list[int], starts: list[int], parent: int | None = None, **block: Any) -> dict[str, Any]:
    blocks = [
        {"type": "stored_block", "block_hash": h, "tokens": [{"token_id": t, "token_extra_id": 0} for t in _ids(s)],
         "lora_id": None, "cache_level": 0, "priority": 35, **block}
        for h, s in zip(hashes, starts, strict=True)
    ]
    return {"event_id": event_id, "data": {"type": "stored", "parent_hash": parent, "blocks": blocks}}


def _fed(answers: list[list[dict[str, Any]]]) -> tuple[BlockIndex, EventFeed]:
    index = BlockIndex(BS)
    feed = EventFeed("t", index)
    for answer in answers:
        feed.receive(parse_events(answer))
    return index, feed


class TestParseEvents:
    def test_fixture_sequence(self) -> None:
        """Every documented event type parses; hashes above the signed 64-bit range are kept exactly."""
        events = [e for answer in _answers() for e in parse_events(answer)]
        kinds = [type(e.event) for e in events]
        assert kinds == [Created, Stored, Stored, Stored, Removed, Updated, Stored]
        stored = events[1].event
        assert isinstance(stored, Stored) and stored.blocks[0].block_hash == 2**64 - 1 > 2**63
        assert stored.blocks[0].token_ids == tuple(_ids(1000))
        assert all(e.window_size == 4096 for e in events)

    def test_updated_cache_level_and_extra_ids(self) -> None:
        """An update's new cache level is read from its diff; a token with an extra id marks the block opaque."""
        last = parse_events(_answers()[4])
        update, store = last[0].event, last[1].event
        assert isinstance(update, Updated) and update.cache_level == 1
        assert isinstance(store, Stored) and store.blocks[0].opaque

    def test_signed_hashes_are_read_unsigned(self) -> None:
        """A serializer that wrote a hash as signed int64 gives the same unsigned value."""
        (item,) = parse_events([{"event_id": 1, "data": {"type": "removed", "block_hashes": [-1]}}])
        assert isinstance(item.event, Removed) and item.event.block_hashes == (2**64 - 1,)

    def test_unknown_types_and_missing_optionals(self) -> None:
        """An unknown event type is kept as None; window size and rank are optional."""
        (item,) = parse_events([{"event_id": 9, "data": {"type": "pinned"}}])
        assert (item.event, item.window_size, item.rank) == (None, None, 0)

    @pytest.mark.parametrize(
        ("data", "message"),
        [
            ({"event_id": 1}, "JSON list"),
            ([{"data": {"type": "created"}}], "event_id"),
            ([{"event_id": 1, "data": {"type": "stored", "blocks": {}}}], "blocks"),
            ([{"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [{"block_hash": 1, "tokens": "abc"}]}}], "tokens"),
            ([{"event_id": 1, "data": {"type": "stored", "parent_hash": 1.5, "blocks": []}}], "parent_hash"),
            ([{"event_id": 1, "data": {"type": "removed", "block_hashes": ["1"]}}], "integer"),
            ([{"event_id": 1, "data": {"type": 3}}], "string"),
            ([{"event_id": 1, "data": []}], "'type'"),
        ],
    )
    def test_malformed_answers(self, data: object, message: str) -> None:
        """Anything but the documented layout raises EventFormatError naming the field."""
        with pytest.raises(EventFormatError, match=message):
            parse_events(data)


class TestEventFeed:
    def test_fixture_sequence_builds_the_index(self) -> None:
        """The replayed sequence leaves exactly the live GPU blocks, hashed by the router from their tokens."""
        index, feed = _fed(_answers())
        chain = block_hashes(_ids(1000, 96), BS)
        assert index.match(chain, ["t"]) == {"t": 2}  # block 3 was offloaded (cache level 1), block 4 was partial
        assert index.match(block_hashes(_ids(5000), BS), ["t"]) == {"t": 0}  # removed
        assert index.blocks("t") == 2
        assert (feed.stats.cleared, feed.stats.lost_events, feed.stats.blocks_removed) == (1, 0, 2)

    def test_created_clears_the_backend(self) -> None:
        """A 'created' event (the cache was created again) forgets every block."""
        index, feed = _fed([[_stored(1, [11], [0])], [{"event_id": 2, "data": {"type": "created"}}]])
        assert index.blocks("t") == 0 and feed.stats.cleared == 1

    def test_lost_events_are_counted(self) -> None:
        """A jump in event ids (the server's buffer overflowed) is counted, and the feed goes on."""
        _, feed = _fed([[_stored(1, [11], [0])], [_stored(5, [12], [100])]])
        assert (feed.stats.lost_events, feed.stats.blocks_stored) == (3, 2)

    def test_event_ids_starting_again_mean_a_restart(self) -> None:
        """Event ids that do not grow mean the server restarted: its blocks are forgotten."""
        index, feed = _fed([[_stored(7, [11], [0])], [_stored(0, [12], [100])]])
        assert index.match(block_hashes(_ids(0), BS), ["t"]) == {"t": 0}
        assert index.blocks("t") == 1 and feed.stats.cleared == 1

    def test_held_until_block_sizes_agree(self) -> None:
        """With the index hashing another block size, events wait in order and are applied once it changes."""
        index = BlockIndex(16)
        feed = EventFeed("t", index)
        feed.receive(parse_events([_stored(1, [11, 12], [0, 32])]))
        feed.receive(parse_events([{"event_id": 2, "data": {"type": "removed", "block_hashes": [12]}}]))
        assert (feed.holding, index.blocks("t")) == (2, 0)
        index.reset(BS)
        assert feed.resume() == 2
        assert index.match(block_hashes(_ids(0, 64), BS), ["t"]) == {"t": 1}

    def test_engine_block_size_from_metrics_decides(self) -> None:
        """When the metrics gave tokens per block, a stored block of another size ends the run."""
        index = BlockIndex(BS)
        feed = EventFeed("t", index)
        feed.engine_block_size = BS
        feed.receive(parse_events([_stored(1, [11, 12], [0, 32]), {"event_id": 2, "data": {"type": "stored", "parent_hash": None, "blocks": [{"block_hash": 13, "tokens": _ids(0, 16)}]}}]))
        assert index.blocks("t") == 2 and feed.stats.skipped == 1

    def test_lora_blocks_and_smaller_windows_are_skipped(self) -> None:
        """Blocks named by a LoRA id, and events of a smaller attention window than seen, stay out of the index."""
        lora = _stored(1, [11], [0], lora_id=4)
        small = {**_stored(3, [13], [200]), "window_size": 512}
        large = {**_stored(2, [12], [100]), "window_size": 4096}
        index, feed = _fed([[lora, large, small]])
        assert index.blocks("t") == 1 and feed.stats.skipped == 2

    def test_ranks_are_kept_apart(self) -> None:
        """The same engine hash on two attention-DP ranks names two blocks."""
        a = {**_stored(1, [42], [0]), "attention_dp_rank": 0}
        b = {**_stored(1, [42], [100]), "attention_dp_rank": 1}
        removed = {"event_id": 2, "data": {"type": "removed", "block_hashes": [42]}, "attention_dp_rank": 1}
        index, _ = _fed([[a, b, removed]])
        assert index.match(block_hashes(_ids(0), BS), ["t"]) == {"t": 1}
        assert index.match(block_hashes(_ids(100), BS), ["t"]) == {"t": 0}
