"""TensorRT-LLM's /kv_cache_events per serializer version: parsing, applying them to the block index, and its exact
flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kvroute_tensorrt_llm import (
    Created,
    EventFormatError,
    Malformed,
    Removed,
    Stored,
    TrtllmEventFeed,
    UnknownEvent,
    Updated,
    parse_events,
    v1_block_hash,
)
from kvroute_tokenizer_prefix import BlockIndex, block_hashes
from structlog.testing import capture_logs

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BS = 32


def _answers(name: str) -> list[list[dict[str, Any]]]:
    return json.loads((FIXTURES / name).read_text())


def _ids(start: int, n: int = BS) -> list[int]:
    return list(range(start, start + n))


def _block(h: int | str, tokens: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "type": "stored_block",
        "block_hash": h,
        "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
        "cache_level": 0,
        "priority": 35,
        **extra,
    }


def _v1_stored(
    event_id: int, starts: list[int], parent: int | None = None, *, lora: int | None = None, **item: Any
) -> dict[str, Any]:
    """A V1 stored event as the engine writes it: hashes chained by the engine's block hash, no lora_id."""
    blocks = []
    h = parent or 0
    for s in starts:
        h = v1_block_hash(_ids(s), h, lora_task_id=lora)
        blocks.append(_block(h, _ids(s)))
    return {
        "event_id": event_id,
        "data": {"type": "stored", "parent_hash": parent, "blocks": blocks},
        "window_size": 4096,
        **item,
    }


def _v1_hash(*starts: int) -> int:
    h = 0
    for s in starts:
        h = v1_block_hash(_ids(s), h)
    return h


def _removed(event_id: int, hashes: list[int | str], **item: Any) -> dict[str, Any]:
    return {"event_id": event_id, "data": {"type": "removed", "block_hashes": hashes}, "window_size": 4096, **item}


def _fed(
    answers: list[list[dict[str, Any]]], *, start: bool = True, **options: Any
) -> tuple[BlockIndex, TrtllmEventFeed]:
    index = BlockIndex(BS)
    feed = TrtllmEventFeed("t", index, **options)
    if start:
        feed.start()
    for answer in answers:
        feed.receive(parse_events(answer))
    return index, feed


def _matched(index: BlockIndex, tokens: list[int], **root: Any) -> int:
    return index.match(block_hashes(tokens, BS, **root), ["t"])["t"]


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TestParseEvents:
    def test_v1_fixture(self) -> None:
        """The V1 serializer's events parse; hashes above the signed 64-bit range are kept exactly."""
        events = [e for answer in _answers("kv_cache_events_sequence.json") for e in parse_events(answer)]
        kinds = [type(e.event) for e in events]
        assert kinds == [Created, Stored, Stored, Stored, Removed, Updated, Stored, Stored, Stored]
        stored = events[1].event
        assert isinstance(stored, Stored) and stored.blocks[0].block_hash == v1_block_hash(_ids(1000)) > 2**63
        assert stored.blocks[0].token_ids == tuple(_ids(1000))
        assert all(e.window_size == 4096 and e.hash_algo is None and e.layer_group is None for e in events)

    def test_updated_cache_level_and_extra_ids(self) -> None:
        """An update's new cache level is read from its diff; a token with an extra id marks the block opaque."""
        update = parse_events(_answers("kv_cache_events_sequence.json")[4])[1].event
        tuned = parse_events(_answers("kv_cache_events_sequence.json")[5])[2].event
        assert isinstance(update, Updated) and update.cache_level == 1
        assert isinstance(tuned, Stored) and tuned.blocks[0].opaque

    def test_v2_hex_hashes_and_fields(self) -> None:
        """V2 hex hashes, hash_algo, layer_group_id, cache_salt and multimodal hex tokens parse (each hex hash as
        ~int)."""
        answers = _answers("kv_events_v2_sha256.json")
        raw = answers[1][0]["data"]["blocks"][1]["block_hash"]
        second = parse_events(answers[1])
        assert [(e.hash_algo, e.layer_group) for e in second] == [("v2_sha256", 0), ("v2_sha256", 1)]
        stored = second[0].event
        assert isinstance(stored, Stored) and stored.blocks[1].block_hash == ~int(raw, 16) < 0
        (continued,) = parse_events(answers[2])
        assert isinstance(continued.event, Stored) and continued.event.parent_hash == stored.blocks[1].block_hash
        assert [b.opaque for b in continued.event.blocks] == [False, True]  # the second block holds image tokens
        salted = parse_events(answers[3])[0].event
        assert isinstance(salted, Stored) and salted.blocks[0].cache_salt == "tenant-a"
        removed = parse_events(answers[4])[0].event
        assert isinstance(removed, Removed) and removed.block_hashes == (stored.blocks[1].block_hash,)

    def test_signed_hashes_are_read_unsigned(self) -> None:
        """A serializer that wrote a hash as signed int64 gives the same unsigned value."""
        (item,) = parse_events([{"event_id": 1, "data": {"type": "removed", "block_hashes": [-1]}}])
        assert isinstance(item.event, Removed) and item.event.block_hashes == (2**64 - 1,)

    def test_one_bad_event_costs_only_itself(self) -> None:
        """In a V2 drain, the malformed event becomes Malformed (with its id) and the events around it still parse."""
        items = parse_events(_answers("kv_events_v2_malformed.json")[1])
        assert [type(i.event) for i in items] == [Removed, Malformed, Stored]
        bad = items[1]
        assert bad.event_id == 2 and isinstance(bad.event, Malformed) and "tokens" in bad.event.error

    def test_unknown_types_and_missing_optionals(self) -> None:
        """An unknown event type is kept as UnknownEvent; window size, rank, layer group and hash algo are optional."""
        (item,) = parse_events([{"event_id": 9, "data": {"type": "pinned"}}])
        assert (item.event, item.window_size, item.rank, item.layer_group, item.hash_algo) == (
            UnknownEvent("pinned"),
            None,
            0,
            None,
            None,
        )

    def test_not_a_list(self) -> None:
        """An answer that is not a list is unusable as a whole."""
        with pytest.raises(EventFormatError, match="JSON list"):
            parse_events({"event_id": 1})

    @pytest.mark.parametrize(
        ("item", "message"),
        [
            ({"data": {"type": "created"}}, "event_id"),
            ({"event_id": 1, "data": {"type": "stored", "blocks": {}}}, "blocks"),
            (
                {
                    "event_id": 1,
                    "data": {"type": "stored", "parent_hash": None, "blocks": [{"block_hash": 1, "tokens": "abc"}]},
                },
                "tokens",
            ),
            ({"event_id": 1, "data": {"type": "stored", "parent_hash": 1.5, "blocks": []}}, "parent_hash"),
            ({"event_id": 1, "data": {"type": "removed", "block_hashes": ["xyz"]}}, "hex string"),
            (
                {
                    "event_id": 1,
                    "data": {"type": "stored", "parent_hash": None, "blocks": [_block(1, [1], cache_salt=5)]},
                },
                "cache_salt",
            ),
            (
                {"event_id": 1, "data": {"type": "removed", "block_hashes": []}, "attention_dp_rank": -1},
                "attention_dp_rank",
            ),
            ({"event_id": 1, "data": {"type": 3}}, "string"),
            ({"event_id": 1, "data": []}, "'type'"),
            ("x", "object"),
        ],
    )
    def test_malformed_events(self, item: object, message: str) -> None:
        """Anything but the documented layout gives a Malformed event naming the field, next to a good one."""
        good = {"event_id": 0, "data": {"type": "created"}}
        first, bad = parse_events([good, item])
        assert isinstance(first.event, Created)
        assert isinstance(bad.event, Malformed) and message in bad.event.error


class TestEventFeed:
    def test_v1_fixture_builds_the_index(self) -> None:
        """The V1 sequence leaves exactly the live GPU text blocks; LoRA, salted and prompt-tuned blocks stay out."""
        index, feed = _fed(_answers("kv_cache_events_sequence.json"))
        assert _matched(index, _ids(1000, 96)) == 2  # block 3 was offloaded (cache level 1), block 4 was partial
        assert _matched(index, _ids(5000)) == 0  # removed
        assert _matched(index, _ids(7000, 64)) == 0  # LoRA blocks: the V1 serializer sends no lora_id
        assert _matched(index, _ids(8000, 64)) == 0  # a salted chain (salt unknown to the event)
        assert index.blocks("t") == 2
        assert (feed.stats.cleared, feed.stats.lost_events, feed.stats.blocks_removed, feed.stats.keyed_blocks) == (
            1,
            0,
            2,
            2,
        )
        assert feed.exact

    def test_lora_block_told_apart_by_its_hash(self) -> None:
        """A V1 block whose engine hash mixes a LoRA task id is not indexed as the base model's; its twin without LoRA
        is."""
        index, feed = _fed([[_v1_stored(1, [0, 32], lora=3)], [_v1_stored(2, [100])]])
        assert _matched(index, _ids(0, 64)) == 0
        assert _matched(index, _ids(100)) == 1
        assert feed.stats.keyed_blocks == 1 and feed.exact

    def test_salted_chain_indexed_under_its_salt(self) -> None:
        """A block carrying cache_salt is indexed under that salt: salted lookups match it, unsalted ones do not."""
        salted = {
            "event_id": 1,
            "data": {
                "type": "stored",
                "parent_hash": None,
                "blocks": [_block(1234, _ids(0), cache_salt="tenant-a", mm_keys=[])],
            },
            "window_size": 4096,
            "hash_algo": "v2_sha256_64",
            "layer_group_id": 0,
        }
        index, _ = _fed([[salted]])
        assert _matched(index, _ids(0), cache_salt="tenant-a") == 1
        assert _matched(index, _ids(0)) == 0

    def test_v2_fixture_builds_the_index(self) -> None:
        """V2 events (hex hashes, two layer groups, a salted chain, image tokens) keep the index equal to the engine's
        blocks."""
        answers = _answers("kv_events_v2_sha256.json")
        index, feed = _fed(answers[:3])
        assert _matched(index, _ids(1000, 128)) == 3  # the fourth block holds image tokens
        assert index.blocks("t") == 3
        assert feed.stats.skipped_events == 1  # layer group 1 repeats group 0's blocks
        for answer in answers[3:]:
            feed.receive(parse_events(answer))
        assert _matched(index, _ids(1000), cache_salt="tenant-a") == 1
        assert _matched(index, _ids(1000, 96)) == 1  # block 2 removed, block 3 offloaded
        assert feed.exact and feed.stats.malformed == 0

    def test_malformed_event_costs_only_itself(self) -> None:
        """The removal before a malformed V2 event and the store after it are applied; the backend goes inexact."""
        answers = _answers("kv_events_v2_malformed.json")
        index, feed = _fed(answers[:1])
        assert _matched(index, _ids(2000, 64)) == 2
        with capture_logs() as logs:
            feed.receive(parse_events(answers[1]))
        assert _matched(index, _ids(2000, 64)) == 1  # the removal was applied
        assert _matched(index, _ids(3000)) == 1  # and the store after the bad event
        assert not feed.exact and not index.is_exact("t")
        assert (feed.stats.malformed, feed.stats.inexact_reasons) == (1, {"malformed_event": 1})
        assert {"event": "kv_index_inexact", "backend": "t", "reason": "malformed_event"}.items() <= logs[-1].items()

    def test_gap_marks_inexact(self) -> None:
        """A jump in a rank's event ids (the server's buffer overflowed) is counted and turns the exact flag off."""
        index, feed = _fed([[_v1_stored(1, [0])]])
        assert feed.exact and index.is_exact("t")
        with capture_logs() as logs:
            feed.receive(parse_events([_v1_stored(5, [100])]))
        assert (feed.stats.lost_events, feed.stats.blocks_stored) == (3, 2)
        assert not feed.exact and not index.is_exact("t")
        assert feed.stats.inexact_reasons == {"event_gap": 1}
        assert [log for log in logs if log["event"] == "kv_index_inexact"] == [
            {
                "event": "kv_index_inexact",
                "backend": "t",
                "reason": "event_gap",
                "rank": 0,
                "after": 1,
                "count": 3,
                "log_level": "warning",
            }
        ]

    def test_sink_is_told_the_reason(self) -> None:
        """The index learns why the backend is not exact (set_exact's reason), and forgets it once exact again."""
        index, feed = _fed([[_v1_stored(1, [0])], [_v1_stored(5, [100])]])
        assert index.inexact_reason("t") == "event_gap"
        feed.resync()
        assert index.is_exact("t") and index.inexact_reason("t") is None

    def test_losses_while_inexact_count_one_transition(self) -> None:
        """Every loss is counted by reason, but the backend stops being exact (logged, counted) once until it is exact
        again."""
        with capture_logs() as logs:
            _, feed = _fed(
                [[_v1_stored(1, [0])], [_v1_stored(5, [100])], [{"event_id": 6, "data": {"type": "pinned"}}]]
            )
        assert feed.stats.inexact_reasons == {"event_gap": 1, "unknown_event": 1} and feed.stats.inexact == 1
        assert [log["reason"] for log in logs if log["event"] == "kv_index_inexact"] == ["event_gap"]
        assert feed.lost_reason == "event_gap" and feed.report()["lost_reason"] == "event_gap"

    def test_unknown_event_marks_inexact(self) -> None:
        """An event of an unknown type might have removed blocks: the backend goes inexact."""
        _, feed = _fed([[{"event_id": 0, "data": {"type": "pinned"}}]])
        assert not feed.exact and feed.stats.inexact_reasons == {"unknown_event": 1}

    def test_joining_mid_stream_stays_exact(self) -> None:
        """Events before the router started never reached the index, so ids that start high lose nothing."""
        index, feed = _fed([[_v1_stored(57, [0])], [_v1_stored(58, [100])]])
        assert feed.exact and feed.stats.inexact == 0 and index.blocks("t") == 2

    def test_created_after_a_loss_makes_it_exact_again(self) -> None:
        """A 'created' event after a loss clears the backend and makes it exact again."""
        index, feed = _fed([[_v1_stored(1, [0])], [_v1_stored(3, [100])]])
        assert not feed.exact
        feed.receive(parse_events([{"event_id": 0, "data": {"type": "created"}, "window_size": 4096}]))
        assert feed.exact and index.is_exact("t") and index.blocks("t") == 0 and feed.stats.resyncs == 1

    def test_event_ids_starting_again_mean_a_restart(self) -> None:
        """Event ids that do not grow mean the server restarted: its blocks are forgotten and the backend is exact
        again."""
        index, feed = _fed([[_v1_stored(7, [0])], [_v1_stored(9, [50])], [_v1_stored(0, [100])]])
        assert _matched(index, _ids(0)) == 0
        assert index.blocks("t") == 1 and feed.stats.cleared == 1 and feed.exact

    def test_resync_clears_and_trusts_again(self) -> None:
        """After a loss the feed reports how long it has been inexact; a resync clears the backend and marks it
        exact."""
        clock = _Clock()
        index, feed = _fed([[_v1_stored(1, [0])], [_v1_stored(3, [100])]], clock=clock)
        clock.now += 42
        assert feed.inexact_for == 42
        feed.resync()
        assert feed.exact and index.is_exact("t") and index.blocks("t") == 0 and feed.inexact_for is None

    def test_held_until_block_sizes_agree(self) -> None:
        """With the index hashing another block size, events wait in order and are applied once it changes."""
        index = BlockIndex(16)
        feed = TrtllmEventFeed("t", index)
        feed.start()
        feed.receive(parse_events([_v1_stored(1, [0, 32])]))
        feed.receive(parse_events([_removed(2, [_v1_hash(0, 32)])]))
        assert (feed.holding, index.blocks("t")) == (2, 0)
        index.reset(BS)
        assert feed.resume() == 2
        assert index.match(block_hashes(_ids(0, 64), BS), ["t"]) == {"t": 1}

    def test_held_overflow_marks_inexact(self) -> None:
        """Dropping a held event (too many waiting for the block size) loses it: the backend goes inexact."""
        index = BlockIndex(16)
        feed = TrtllmEventFeed("t", index, max_held=1)
        feed.start()
        feed.receive(parse_events([_v1_stored(1, [0]), _v1_stored(2, [100])]))
        assert feed.stats.dropped_held == 1 and not feed.exact
        assert feed.stats.inexact_reasons == {"held_events_dropped": 1}

    def test_engine_block_size_from_metrics_decides(self) -> None:
        """When the metrics gave tokens per block, a stored block of another size ends the run."""
        index = BlockIndex(BS)
        feed = TrtllmEventFeed("t", index)
        feed.engine_block_size = BS
        small = {
            "event_id": 2,
            "data": {
                "type": "stored",
                "parent_hash": None,
                "blocks": [_block(v1_block_hash(_ids(0, 16)), _ids(0, 16))],
            },
        }
        feed.receive(parse_events([_v1_stored(1, [0, 32]), small]))
        assert index.blocks("t") == 2 and feed.stats.skipped_events == 1

    def test_smaller_windows_are_skipped(self) -> None:
        """Events of a smaller attention window than seen stay out of the index."""
        large = _v1_stored(1, [100])
        small = {**_v1_stored(2, [200]), "window_size": 512}
        index, feed = _fed([[large, small]])
        assert index.blocks("t") == 1 and feed.stats.skipped_events == 1

    def test_lora_id_blocks_are_skipped(self) -> None:
        """A block naming a LoRA by id only stays out of the index (the router keys adapters by name)."""
        event = _v1_stored(1, [0])
        event["data"]["blocks"][0]["lora_id"] = 4
        index, feed = _fed([[event]])
        assert index.blocks("t") == 0 and feed.stats.skipped_events == 1

    def test_ranks_are_kept_apart(self) -> None:
        """An engine hash names a block on one attention-DP rank only: another rank's removal of it changes nothing."""
        stored = _v1_stored(1, [0], attention_dp_rank=1)
        other_rank = _removed(1, [_v1_hash(0)], attention_dp_rank=0)
        index, feed = _fed([[stored, other_rank]])
        assert _matched(index, _ids(0)) == 1 and feed.stats.blocks_removed == 0
        feed.receive(parse_events([_removed(2, [_v1_hash(0)], attention_dp_rank=1)]))
        assert _matched(index, _ids(0)) == 0 and feed.stats.blocks_removed == 1
        assert feed.exact

    def test_hash_check_turns_off_for_an_unknown_hash(self) -> None:
        """If no V1 hash ever matches its tokens (an engine hashing differently), the check stops and blocks are
        indexed."""
        wrong = [
            {
                "event_id": i,
                "data": {"type": "stored", "parent_hash": None, "blocks": [_block(i + 1, _ids(1000 * i))]},
                "window_size": 4096,
            }
            for i in range(33)
        ]
        with capture_logs() as logs:
            index, feed = _fed([wrong])
        assert feed.stats.keyed_blocks == 32 and index.blocks("t") == 1
        assert any(log["event"] == "kv_events_hash_check_off" for log in logs)

    def test_one_matching_hash_keeps_the_check_on(self) -> None:
        """Once a V1 hash matched, mismatching blocks are skipped however many there are."""
        wrong = [
            {
                "event_id": i,
                "data": {"type": "stored", "parent_hash": None, "blocks": [_block(i + 1, _ids(1000 * i))]},
                "window_size": 4096,
            }
            for i in range(1, 40)
        ]
        index, feed = _fed([[_v1_stored(0, [0])], wrong])
        assert feed.stats.keyed_blocks == 39 and index.blocks("t") == 1
