"""Applying vLLM's KV events to the router's block index: sequence order, gaps, restarts, block sizes, filters."""

from __future__ import annotations

import msgpack
from hypothesis import given
from hypothesis import strategies as st
from kvroute_tokenizer_prefix import BlockIndex, block_hashes, root_hash
from kvroute_vllm import EventBatch, Gap, VllmEventFeed, decode_batch

from tests.contrib.vllm.vllm_fakes import RecordingSink, captured_payloads, kv_events, model_router_hashes

BS = 128


def _batches() -> list[EventBatch]:
    return [decode_batch(seq, payload) for seq, payload in enumerate(captured_payloads())]


def _stored(hashes: list[int], tokens: list[int], parent: int | None = None, **extra: object) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def _batch(seq: int, *events: dict[str, object], rank: int = 0) -> EventBatch:
    return decode_batch(seq, msgpack.packb([0.0, list(events), rank]))


def _in_order(upto: int = 10) -> BlockIndex:
    index = BlockIndex(BS)
    feed = VllmEventFeed("a", index)
    for batch in _batches()[:upto]:
        assert feed.receive(batch) is None
    return index


class TestKvEventFeed:
    def test_captured_stream_matches_an_independent_model(self) -> None:
        """After each captured batch, the index holds exactly the blocks the engine holds, in router hashes."""
        payloads = captured_payloads()
        index = BlockIndex(BS)
        feed = VllmEventFeed("a", index)
        for seq, batch in enumerate(_batches()):
            feed.receive(batch)
            assert set(index.holders) == model_router_hashes(payloads[: seq + 1]), f"after batch {seq}"
        assert feed.stats.batches == 11 and feed.stats.cleared == 1 and index.blocks("a") == 0

    def test_router_hashes_come_from_token_ids(self) -> None:
        """The chat prompt's blocks, hashed by the router from its token ids, are all held after the first two
        batches."""
        index = _in_order(upto=2)
        prompt = block_hashes(kv_events()["chat_prompt_token_ids"], BS)
        assert index.match(prompt, ["a"]) == {"a": len(prompt)} == {"a": 25}

    def test_gap_is_reported_then_filled_by_replay(self) -> None:
        """A batch past the expected one returns the gap; replaying it and offering the batch again catches up."""
        batches = _batches()
        index = BlockIndex(BS)
        feed = VllmEventFeed("a", index)
        feed.receive(batches[0])
        assert feed.receive(batches[3]) == Gap(1, 3)
        feed.replayed(batches[1:5])
        assert feed.receive(batches[3]) is None  # now a duplicate
        assert (feed.expected, feed.stats.gaps, feed.stats.duplicates) == (5, 1, 1)
        for batch in batches[5:10]:
            feed.receive(batch)
        assert set(index.holders) == set(_in_order().holders)

    def test_unfillable_gap_is_counted_lost(self) -> None:
        """Without a replay the gap is skipped and counted, and the stream goes on."""
        batches = _batches()
        feed = VllmEventFeed("a", BlockIndex(BS))
        feed.receive(batches[0])
        gap = feed.receive(batches[4])
        assert gap == Gap(1, 4)
        feed.skip_gap(gap)
        assert feed.receive(batches[4]) is None
        assert (feed.stats.lost_batches, feed.expected) == (3, 5)

    def test_replay_that_starts_late_counts_the_missing_batches(self) -> None:
        """A replay buffer that no longer reaches the expected batch: the missing ones are counted lost."""
        batches = _batches()
        feed = VllmEventFeed("a", BlockIndex(BS))
        feed.receive(batches[0])
        feed.replayed(batches[3:5])
        assert (feed.stats.lost_batches, feed.expected) == (2, 5)

    def test_publisher_restart_clears_the_backend(self) -> None:
        """A live sequence number that does not grow means the engine restarted: its blocks are forgotten."""
        sink = RecordingSink()
        feed = VllmEventFeed("a", sink)
        batches = _batches()
        for batch in batches[:3]:
            feed.receive(batch)
        assert sink.index.blocks("a") > 0
        assert feed.receive(batches[0]) is None
        assert feed.stats.restarts == 1 and "all_cleared" in sink.names()
        assert sink.index.blocks("a") == 16  # only the re-sent first batch

    def test_restart_then_gap_asks_for_replay_from_zero(self) -> None:
        """After a restart the first live batch past 0 reveals a gap from 0."""
        feed = VllmEventFeed("a", BlockIndex(BS))
        batches = _batches()
        feed.receive(batches[5])
        assert feed.receive(batches[2]) == Gap(0, 2)

    def test_batches_wait_while_block_sizes_differ(self) -> None:
        """Until the sink hashes blocks of the engine's size, batches are held in order, then applied."""
        index = BlockIndex(16)
        feed = VllmEventFeed("a", index)
        for batch in _batches()[:4]:
            feed.receive(batch)
        assert (feed.holding, index.blocks("a")) == (4, 0)
        assert feed.resume() == 0
        index.reset(BS)
        assert feed.resume() == 4 and feed.holding == 0
        assert set(index.holders) == set(_in_order(upto=4).holders)

    def test_held_batches_are_bounded(self) -> None:
        """A sink that never agrees on the block size does not make the feed grow without bound."""
        feed = VllmEventFeed("a", BlockIndex(16), max_held=3)
        for batch in _batches()[:6]:
            feed.receive(batch)
        assert (feed.holding, feed.stats.dropped_held) == (3, 3)

    def test_cpu_blocks_and_other_groups_are_skipped(self) -> None:
        """Blocks on another medium or in another KV cache group do not enter the GPU index."""
        sink = RecordingSink()
        feed = VllmEventFeed("a", sink)
        tokens = list(range(BS))
        feed.receive(
            _batch(
                0,
                _stored([1], tokens, medium="CPU"),
                _stored([2], tokens, group_idx=1, kv_cache_spec_kind="sliding_window"),
            )
        )
        feed.receive(_batch(1, {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}))
        assert "blocks_stored" not in sink.names() and "blocks_removed" not in sink.names()
        assert feed.stats.skipped_events == 3

    def test_lora_name_and_cache_salt_key_the_root(self) -> None:
        """The LoRA name and the cache_salt found in the first block's extra keys seed the router's chain."""
        sink = RecordingSink()
        feed = VllmEventFeed("a", sink)
        tokens = list(range(2 * BS))
        feed.receive(
            _batch(
                0,
                _stored(
                    [7, 8], tokens, lora_name="tenant-lora", extra_keys=[["tenant-lora", "salt-1"], ["tenant-lora"]]
                ),
            )
        )
        expected = block_hashes(tokens, BS, parent=root_hash("tenant-lora", "salt-1"))
        assert sink.index.match(expected, ["a"]) == {"a": 2}
        assert sink.calls[-1][2]["cache_salt"] == "salt-1"

    def test_multimodal_blocks_end_the_event(self) -> None:
        """A block keyed by a multimodal identifier cannot be recomputed from tokens: it and its successors are
        skipped."""
        sink = RecordingSink()
        feed = VllmEventFeed("a", sink)
        tokens = list(range(3 * BS))
        feed.receive(_batch(0, _stored([1, 2, 3], tokens, extra_keys=[None, [["img-hash", 5]], None])))
        assert sink.index.blocks("a") == 1

    def test_lora_known_only_by_id_is_skipped(self) -> None:
        """Old servers name LoRA adapters by id only; such blocks cannot be keyed like the router's."""
        feed = VllmEventFeed("a", RecordingSink())
        feed.receive(_batch(0, _stored([1], list(range(BS)), lora_id=3)))
        assert feed.stats.skipped_events == 1 and feed.stats.blocks_stored == 0

    def test_ranks_do_not_share_engine_hashes(self) -> None:
        """The same engine hash on two data-parallel ranks names two blocks: removing one keeps the other's mapping."""
        sink = RecordingSink()
        a, b = list(range(BS)), list(range(1, BS + 1))
        rank0, rank1 = VllmEventFeed("x", sink, rank=0), VllmEventFeed("x", sink, rank=1)
        rank0.receive(_batch(0, _stored([42], a), rank=0))
        rank1.receive(_batch(0, _stored([42], b), rank=1))
        rank1.receive(_batch(1, {"type": "BlockRemoved", "block_hashes": [42], "medium": "GPU"}, rank=1))
        assert sink.index.match(block_hashes(a, BS), ["x"]) == {"x": 1}
        assert sink.index.match(block_hashes(b, BS), ["x"]) == {"x": 0}

    def test_wide_digests_do_not_collide_across_ranks(self) -> None:
        """A digest wider than 64 bits (bytes hashes) on rank 0 and a small hash on rank 1 name different blocks."""
        sink = RecordingSink()
        a, b = list(range(BS)), list(range(1, BS + 1))
        wide = (2**64 + 5).to_bytes(32, "big")  # a digest sent as bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
        rank0, rank1 = VllmEventFeed("x", sink, rank=0), VllmEventFeed("x", sink, rank=1)
        rank0.receive(_batch(0, _stored([wide], a), rank=0))  # type: ignore[list-item]
        rank1.receive(_batch(0, _stored([5], b), rank=1))
        rank0.receive(_batch(1, {"type": "BlockRemoved", "block_hashes": [wide], "medium": "GPU"}, rank=0))
        assert sink.index.match(block_hashes(a, BS), ["x"]) == {"x": 0}
        assert sink.index.match(block_hashes(b, BS), ["x"]) == {"x": 1}

    def test_unknown_parent_is_an_orphan(self) -> None:
        """A continuation whose parent block was never seen cannot be hashed and is counted as an orphan."""
        feed = VllmEventFeed("a", BlockIndex(BS))
        feed.receive(_batch(0, _stored([5], list(range(BS)), parent=99)))
        assert (feed.stats.orphan_events, feed.stats.blocks_stored) == (1, 0)


@st.composite
def _deliveries(draw: st.DrawFn) -> list[int]:
    """Which of the first 10 captured batches (the ones before the cache reset) arrive live, in order."""
    out: list[int] = []
    for seq in range(10):
        copies = draw(st.sampled_from([0, 1, 1, 1, 2]))
        out.extend([seq] * copies)
    return out


class TestFeedDelivery:
    @given(_deliveries())
    def test_any_loss_pattern_converges_to_in_order_state(self, live: list[int]) -> None:
        """However batches are dropped or repeated live, filling gaps from the replay buffer ends in the in-order
        state."""
        batches = _batches()[:10]
        index = BlockIndex(BS)
        feed = VllmEventFeed("a", index)
        feed.replayed([], complete=True)  # subscribed before the first batch: the replay buffer was empty
        for seq in live:
            gap = feed.receive(batches[seq])
            if gap is not None:
                feed.replayed(batches[gap.start :])
                assert feed.receive(batches[seq]) is None
        assert feed.expected is not None
        feed.replayed(batches[feed.expected :])  # the next live message would reveal the tail
        reference = BlockIndex(BS)
        reference_feed = VllmEventFeed("a", reference)
        for batch in batches:
            reference_feed.receive(batch)
        assert index.holders == reference.holders
        assert set(index.holders) == model_router_hashes(captured_payloads()[:10]) != set()
        assert feed.stats.lost_batches == 0 and feed.expected == len(batches)


def _removed(hashes: list[int], medium: str = "GPU") -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


class TestDataParallelFeed:
    def test_ranks_fill_their_own_slots(self) -> None:
        """Batches of ranks 0 and 1 (one stream each) put their blocks in the backend's rank slots, apart."""
        index = BlockIndex(BS)
        tokens_a, tokens_b = list(range(2 * BS)), list(range(5, 2 * BS + 5))
        VllmEventFeed("x", index, rank=0, size=2).receive(_batch(0, _stored([1, 2], tokens_a), rank=0))
        VllmEventFeed("x", index, rank=1, size=2).receive(_batch(0, _stored([1, 2], tokens_b), rank=1))
        slot1 = index.slot("x", 1)
        assert index.match(block_hashes(tokens_a, BS), ["x", slot1]) == {"x": 2, slot1: 0}
        assert index.match(block_hashes(tokens_b, BS), ["x", slot1]) == {"x": 0, slot1: 2}

    def test_rank_clear_and_removal_stay_in_their_rank(self) -> None:
        """A removal and an AllBlocksCleared on rank 1 leave rank 0's blocks alone."""
        index = BlockIndex(BS)
        tokens = list(range(BS))
        rank0, rank1 = VllmEventFeed("x", index, rank=0, size=2), VllmEventFeed("x", index, rank=1, size=2)
        rank0.receive(_batch(0, _stored([7], tokens), rank=0))
        rank1.receive(_batch(0, _stored([7], tokens), rank=1))
        rank1.receive(_batch(1, _removed([7]), rank=1))
        assert (index.blocks("x"), index.blocks(index.slot("x", 1))) == (1, 0)
        rank1.receive(_batch(2, _stored([8], tokens), rank=1))
        rank1.receive(_batch(3, {"type": "AllBlocksCleared"}, rank=1))
        assert (index.blocks("x"), index.blocks(index.slot("x", 1))) == (1, 0)

    def test_rank_beyond_the_servers_ranks_is_a_loss(self) -> None:
        """A batch naming rank 3 of a 2-rank server is not applied, and the index is inexact: bad_rank."""
        index = BlockIndex(BS)
        feed = VllmEventFeed("x", index, rank=1, size=2)
        feed.receive(_batch(0, _stored([1], list(range(BS))), rank=3))
        assert feed.lost_reason == "bad_rank" and index.blocks(index.slot("x", 3)) == 0
        assert index.inexact_reason("x") == "bad_rank"

    def test_negative_rank_is_a_loss_not_a_crash(self) -> None:
        """A negative rank decodes, is refused by the feed (bad_rank) and stores nothing."""
        index = BlockIndex(BS)
        feed = VllmEventFeed("x", index)
        feed.receive(_batch(0, _stored([1], list(range(BS))), rank=-1))
        assert feed.lost_reason == "bad_rank" and len(index) == 0

    def test_one_publisher_is_one_cache_whatever_its_rank(self) -> None:
        """A server with one publisher whose batches name rank 3 (a rank served at its own URL) fills the backend."""
        index = BlockIndex(BS)
        VllmEventFeed("x", index).receive(_batch(0, _stored([1], list(range(BS))), rank=3))
        assert index.blocks("x") == 1 and index.slots_of("x") == ["x"]


class TestTieredFeed:
    def test_block_moved_to_cpu_changes_tier(self) -> None:
        """GPU removal then a CPU store of the same engine hashes (no token ids, as the offloading connector sends)
        moves the blocks to the CPU tier."""
        index = BlockIndex(BS)
        feed = VllmEventFeed("a", index)
        tokens = list(range(2 * BS))
        hashes = block_hashes(tokens, BS)
        feed.receive(_batch(0, _stored([1, 2], tokens)))
        feed.receive(_batch(1, _removed([1, 2])))
        feed.receive(_batch(2, _stored([1, 2], [], medium="CPU")))
        assert index.blocks("a") == 0 and feed.lost_reason is None
        assert [index.tier_of_block("a", h) for h in hashes] == ["CPU", "CPU"]
        feed.receive(_batch(3, _removed([2], medium="CPU")))
        assert [index.tier_of_block("a", h) for h in hashes] == ["CPU", None]

    def test_cpu_store_with_tokens_and_disk_names(self) -> None:
        """A CPU store carrying token ids is hashed like a GPU one; LMCache's disk backend's name reads as DISK."""
        index = BlockIndex(BS)
        feed = VllmEventFeed("a", index)
        tokens = list(range(BS))
        feed.receive(_batch(0, _stored([1], tokens, medium="cpu"), _stored([2], tokens, medium="LocalDiskBackend")))
        (h,) = block_hashes(tokens, BS)
        assert index.tier_of_block("a", h) == "CPU" and index.tier_blocks("a") == {"GPU": 0, "CPU": 1, "DISK": 1}

    def test_unknown_medium_is_a_loss(self) -> None:
        """A medium the adapter does not know stores nothing and marks the index inexact: unknown_medium."""
        index = BlockIndex(BS)
        feed = VllmEventFeed("a", index)
        feed.receive(_batch(0, _stored([1], list(range(BS)), medium="TAPE")))
        assert feed.lost_reason == "unknown_medium" and len(index) == 0 and not index.tiered

    def test_offload_of_a_block_never_seen_is_a_loss(self) -> None:
        """A CPU store naming an engine hash no event named cannot be placed: unknown_offloaded_block."""
        index = BlockIndex(BS)
        feed = VllmEventFeed("a", index)
        feed.receive(_batch(0, _stored([99], [], medium="CPU")))
        assert feed.lost_reason == "unknown_offloaded_block" and not index.tiered
