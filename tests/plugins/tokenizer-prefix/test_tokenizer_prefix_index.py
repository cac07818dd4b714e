"""Block hashes, the bounded block index (approximate records and exact KV events), recent decisions."""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvroute_tokenizer_prefix import BlockIndex, PromptBlocks, RecentDecisions, block_hashes, prompt_ids, root_hash
from kvroute_tokenizer_prefix.blocks import PieceMemo, TextSegment, first_difference, token_bytes
from kvroute_tokenizer_prefix.tokenizer import token_array

import kvroute

token_lists = st.lists(st.integers(0, (1 << 64) - 1), max_size=80)
small_tokens = st.lists(st.integers(0, 3), max_size=40)  # few distinct ids: many shared prefixes


class TestBlockHashes:
    @given(tokens=token_lists, extra=token_lists, size=st.integers(1, 8))
    def test_a_prefix_has_a_prefix_of_hashes(self, tokens: list[int], extra: list[int], size: int) -> None:
        """Extending a prompt never changes the hashes of its existing full blocks."""
        short = block_hashes(tokens, size)
        assert block_hashes(tokens + extra, size)[: len(short)] == short
        assert len(short) == len(tokens) // size

    @given(a=small_tokens, b=small_tokens, size=st.integers(1, 4))
    def test_equal_hash_means_equal_prefix(self, a: list[int], b: list[int], size: int) -> None:
        """Block i has the same hash in two prompts exactly when their first i+1 blocks are equal."""
        ha, hb = block_hashes(a, size), block_hashes(b, size)
        for i in range(min(len(ha), len(hb))):
            assert (ha[i] == hb[i]) == (a[: (i + 1) * size] == b[: (i + 1) * size])

    @given(tokens=token_lists.filter(lambda t: len(t) >= 4), cut=st.integers(1, 20))
    def test_continuation_from_parent_equals_whole(self, tokens: list[int], cut: int) -> None:
        """Hashing a continuation from its parent's hash gives the whole prompt's hashes (as KV events chain)."""
        size = 2
        cut = min(cut, len(tokens) // size) * size
        head = block_hashes(tokens[:cut], size)
        tail = block_hashes(tokens[cut:], size, parent=head[-1] if head else None)
        assert head + tail == block_hashes(tokens, size)

    def test_lora_and_cache_salt_change_every_block(self) -> None:
        """Different LoRA adapters or cache salts never share a block hash."""
        tokens = list(range(64))
        plain = set(block_hashes(tokens, 16))
        assert plain.isdisjoint(block_hashes(tokens, 16, lora="adapter-a"))
        assert plain.isdisjoint(block_hashes(tokens, 16, cache_salt="tenant-1"))
        assert set(block_hashes(tokens, 16, cache_salt="tenant-1")).isdisjoint(
            block_hashes(tokens, 16, cache_salt="tenant-2")
        )
        assert root_hash(None, None) == root_hash()

    def test_bad_block_size(self) -> None:
        """A block size below 1 is a ValueError that says so."""
        with pytest.raises(ValueError, match="'block_size' must be >= 1"):
            block_hashes([1, 2], 0)

    @given(chunks=st.lists(token_lists, max_size=6), size=st.integers(1, 8), max_blocks=st.integers(1, 30))
    def test_lazy_blocks_equal_eager(self, chunks: list[list[int]], size: int, max_blocks: int) -> None:
        """PromptBlocks fed in any chunking gives the first max_blocks hashes of the whole prompt."""
        whole = [t for c in chunks for t in c]
        blocks = PromptBlocks(iter(token_array(c) for c in chunks), size, max_blocks, root_hash())
        assert blocks.complete() == block_hashes(whole, size)[:max_blocks]
        assert blocks.done

    @settings(max_examples=100)
    @given(
        shared=st.text(" abcXY\n.é", max_size=120),
        tails=st.lists(st.text(" abcXY\n.é", max_size=60), min_size=1, max_size=4),
        size=st.integers(1, 8),
        max_blocks=st.integers(1, 64),
        salt=st.sampled_from([None, "tenant"]),
    )
    def test_memoized_pieces_give_the_same_hashes(
        self, tok: Any, shared: str, tails: list[str], size: int, max_blocks: int, salt: str | None
    ) -> None:
        """Prompts sharing a prefix, hashed through one memo, get exactly their own block hashes."""
        memo = PieceMemo()
        for tail in tails:
            request = kvroute.RouteRequest.from_text(shared + tail, cache_salt=salt)
            expected = block_hashes(prompt_ids(tok, request), size, cache_salt=salt)[:max_blocks]
            blocks = PromptBlocks(tok.segments(request), size, max_blocks, root_hash(None, salt), memo)
            assert blocks.complete() == expected

    @settings(max_examples=150, deadline=None)
    @given(
        words=st.lists(
            st.sampled_from(["Hello", " world", " the", " cat", ".", "\n", "\nItem", " 42", " é", "  "]), max_size=120
        ),
        cuts=st.lists(st.integers(0, 120), max_size=4),
        coarse=st.integers(1, 96),
        fine=st.integers(1, 32),
        size=st.integers(1, 8),
        max_blocks=st.integers(1, 80),
    )
    def test_any_piece_sizes_give_the_whole_prompts_hashes(
        self, tok: Any, words: list[str], cuts: list[int], coarse: int, fine: int, size: int, max_blocks: int
    ) -> None:
        """Whatever the piece and fine piece sizes, memoized or not, the hashes are those of the whole prompt's ids."""
        codec = TextCodec(tok, coarse, fine)
        memo = PieceMemo()
        for cut in [len(words), *cuts]:  # prompts sharing prefixes of one text
            text = "".join(words[:cut])
            segments = [array("Q", [7]), TextSegment(text.encode(), codec), array("Q", [8, 9])]
            expected = block_hashes([7, *tok.encode_text(text), 8, 9], size)[:max_blocks]
            assert PromptBlocks(segments, size, max_blocks, root_hash(), memo).complete() == expected
            assert PromptBlocks(segments, size, max_blocks, root_hash()).complete() == expected

    @settings(max_examples=60, deadline=None)
    @given(
        words=st.lists(
            st.sampled_from(["Hello", " world", " the", " cat", ".", "\n", "\nItem", " 42"]), min_size=1, max_size=120
        ),
        stop=st.integers(0, 40),
        size=st.integers(1, 4),
    )
    def test_a_fork_memoizes_the_rest_of_the_prompt(self, tok: Any, words: list[str], stop: int, size: int) -> None:
        """A fork hashes the rest of a prompt from where it stopped; merged, its pieces make the rest a memo hit."""
        codec = TextCodec(tok, 16, 4)
        text = "".join(words)
        segments = [TextSegment(text.encode(), codec)]
        memo = PieceMemo()
        first = PromptBlocks(segments, size, 1 << 20, root_hash(), memo)
        first.ensure(stop)
        fork = first.fork()
        if fork is None:
            assert first.done or not first.hashes
            return
        fork.complete()
        assert fork.memo is not None
        memo.merge(fork.memo)
        assert first.complete() == block_hashes(tok.encode_text(text), size)
        codec.encoded = 0
        again = PromptBlocks(segments, size, 1 << 20, root_hash(), memo)
        assert again.complete() == first.hashes
        assert codec.encoded == 0

    def test_growing_tokenizes_at_most_one_fine_piece(self, tok: Any) -> None:
        """Each grow() step tokenizes at most one fine piece, so a caller that stops early pays little."""
        codec = TextCodec(tok, 64, 8)
        text = " ".join(f"word{i} and more" for i in range(300))
        blocks = PromptBlocks([TextSegment(text.encode(), codec)], 4, 1 << 20, root_hash(), PieceMemo())
        steps = 0
        while blocks.grow():
            steps += 1
            assert codec.encoded <= steps
        assert codec.encoded > 100 and blocks.hashes == block_hashes(tok.encode_text(text), 4)

    @settings(max_examples=300)
    @given(
        shared=st.lists(st.sampled_from([b"ab", b"c", b" ", b"\xc3\xa9"]), max_size=30).map(b"".join),
        ends=st.lists(st.lists(st.sampled_from([b"ab", b"x", b" "]), max_size=6).map(b"".join), min_size=2, max_size=2),
        ids=st.lists(st.lists(st.integers(0, 3), max_size=4), min_size=2, max_size=2),
        shape=st.sampled_from(["text", "ids-then-text", "text-then-ids", "mixed"]),
    )
    def test_first_difference_is_where_the_segments_part(
        self, shared: bytes, ends: list[bytes], ids: list[list[int]], shape: str
    ) -> None:
        """first_difference is the first byte (or id) where two prompts' segments differ, or None when bytes cannot
        tell."""
        codec = TextCodec(None, 8, 2)

        def prompt(k: int) -> list[Any]:
            text = TextSegment(shared + ends[k], codec)
            tail = array("Q", ids[k])
            if shape == "text":
                return [text]
            if shape == "ids-then-text":
                return [tail, text]
            if shape == "text-then-ids":
                return [text, tail]
            return [text] if k == 0 else [tail]

        def raw(seg: Any) -> bytes:
            return seg.data if isinstance(seg, TextSegment) else token_bytes(seg)

        def reference(a: list[Any], b: list[Any]) -> tuple[int, int] | None:
            for i, (x, y) in enumerate(zip(a, b, strict=False)):
                if isinstance(x, TextSegment) != isinstance(y, TextSegment):
                    return None
                rx, ry = raw(x), raw(y)
                if rx != ry:
                    common = next(
                        (k for k, (p, q) in enumerate(zip(rx, ry, strict=False)) if p != q), min(len(rx), len(ry))
                    )
                    if (common == len(rx) and i + 1 < len(a)) or (common == len(ry) and i + 1 < len(b)):
                        return None
                    return i, common
            return min(len(a), len(b)), 0

        a, b = prompt(0), prompt(1)
        assert first_difference(a, b) == reference(a, b)


class TextCodec:
    """A `PieceCodec` over a model tokenizer with its own piece sizes, counting the pieces it tokenizes."""

    def __init__(self, tok: Any, piece_bytes: int, fine_bytes: int) -> None:
        self.tok = tok
        self.piece_bytes = piece_bytes
        self.fine_bytes = fine_bytes
        self.encoded = 0

    def cut(self, data: bytes, start: int, size: int) -> int:
        return int(self.tok.cut(data, start, size))

    def encode(self, data: bytes, start: int, end: int) -> bytes:
        self.encoded += 1
        return token_bytes(token_array(self.tok.encode_text(data[start:end].decode())))

    def cached(self, data: bytes, start: int, end: int) -> bytes | None:
        return None


class TestPieceMemo:
    def test_bounded_by_blocks_and_entries(self) -> None:
        """The memo never holds more block hashes or entries than its bounds; the least recently used go first."""
        memo = PieceMemo(max_blocks=10, max_entries=3)
        for key in range(5):
            memo.put(key, array("Q", [key] * 4), b"", 4)
        assert memo.blocks <= 10 and len(memo) <= 3
        assert 4 in memo and 0 not in memo
        memo.get(3)
        memo.put(9, array("Q", [1]), b"", 1)
        assert 3 in memo and memo.blocks <= 10

    def test_merge_adds_only_new_entries(self) -> None:
        """Merging a prefetch's memo adds its new pieces and keeps the existing ones."""
        memo, other = PieceMemo(), PieceMemo()
        memo.put(1, array("Q", [5]), b"x", 1)
        other.put(1, array("Q", [6]), b"y", 1)
        other.put(2, array("Q", [7]), b"", 1)
        assert memo.merge(other) == 1
        got = memo.get(1)
        assert got is not None and list(got[0]) == [5]


class TestBlockIndex:
    def test_match_counts_leading_blocks(self) -> None:
        """match() returns, per backend, the number of leading blocks it holds."""
        index = BlockIndex(block_size=2)
        hashes = block_hashes(range(20), 2)
        index.record("a", hashes[:6])
        index.record("b", hashes[:2])
        index.record("c", hashes[1:])  # no first block: matches nothing
        assert index.match(hashes, ["a", "b", "c", "d"]) == {"a": 6, "b": 2, "c": 0, "d": 0}

    def test_capacity_evicts_the_tail_first(self) -> None:
        """A backend over capacity forgets its least recent blocks, a prompt's tail before its head."""
        index = BlockIndex(block_size=1, capacity_blocks=4)
        hashes = block_hashes(range(6), 1)
        index.record("a", hashes)
        assert index.blocks("a") == 4
        assert index.match(hashes, ["a"]) == {"a": 4}
        assert index.evictions == 2

    def test_set_capacity_evicts_at_once(self) -> None:
        """Lowering a backend's capacity evicts down to it immediately."""
        index = BlockIndex(block_size=1)
        index.record("a", block_hashes(range(10), 1))
        index.set_capacity("a", 3)
        assert index.blocks("a") == 3 and index.capacity("a") == 3

    def test_exact_events_chain_through_engine_hashes(self) -> None:
        """A stored event whose parent is an engine hash continues the router's chain from that block."""
        index = BlockIndex(block_size=2)
        tokens = list(range(8))
        index.blocks_stored("a", tokens[:4], block_size=2, engine_hashes=[101, 102])
        stored = index.blocks_stored("a", tokens[4:], block_size=2, parent_engine_hash=102, engine_hashes=[103, 104])
        assert stored == block_hashes(tokens, 2)[2:]
        assert index.match(block_hashes(tokens, 2), ["a"]) == {"a": 4}

    def test_removed_event_names_engine_hashes(self) -> None:
        """A removed event drops the router blocks its engine hashes map to."""
        index = BlockIndex(block_size=2)
        tokens = list(range(8))
        index.blocks_stored("a", tokens, block_size=2, engine_hashes=[1, 2, 3, 4])
        assert index.blocks_removed("a", [3, 99]) == 1
        assert index.match(block_hashes(tokens, 2), ["a"]) == {"a": 2}

    def test_all_cleared(self) -> None:
        """An all-cleared event empties one backend only."""
        index = BlockIndex(block_size=2)
        hashes = block_hashes(range(8), 2)
        index.record("a", hashes)
        index.record("b", hashes)
        index.all_cleared("a")
        assert index.match(hashes, ["a", "b"]) == {"a": 0, "b": 4}

    def test_orphan_event_is_skipped_and_counted(self) -> None:
        """A stored event whose parent the index never saw stores nothing and is counted."""
        index = BlockIndex(block_size=2)
        assert index.blocks_stored("a", [1, 2, 3, 4], block_size=2, parent_engine_hash=77) == []
        assert index.orphan_events == 1 and len(index) == 0

    def test_event_lora_and_salt_key_the_first_block(self) -> None:
        """A stored event for an adapter and salt matches only prompts with that adapter and salt."""
        index = BlockIndex(block_size=2)
        index.blocks_stored("a", [1, 2, 3, 4], block_size=2, lora="x", cache_salt="s")
        assert index.match(block_hashes([1, 2, 3, 4], 2, lora="x", cache_salt="s"), ["a"]) == {"a": 2}
        assert index.match(block_hashes([1, 2, 3, 4], 2), ["a"]) == {"a": 0}

    def test_block_size_mismatch_is_rejected(self) -> None:
        """An event with another block size is a ValueError telling what to configure."""
        index = BlockIndex(block_size=16)
        with pytest.raises(ValueError, match="set the strategy's 'block_size'"):
            index.blocks_stored("a", list(range(32)), block_size=32)

    def test_engine_hash_count_must_match_blocks(self) -> None:
        """An event naming a different number of hashes than full blocks is a ValueError."""
        index = BlockIndex(block_size=2)
        with pytest.raises(ValueError, match="names 1 block hashes for 2 full blocks"):
            index.blocks_stored("a", [1, 2, 3, 4], block_size=2, engine_hashes=[9])

    def test_set_exact_forgets_approximate_records(self) -> None:
        """Switching a backend to exact mode drops what was only guessed."""
        index = BlockIndex(block_size=1)
        index.record("a", block_hashes(range(3), 1))
        index.set_exact("a")
        assert index.is_exact("a") and index.blocks("a") == 0

    def test_inexact_reason_is_kept_until_exact_again(self) -> None:
        """The reason an adapter gives for leaving exact mode is readable until the backend is exact again."""
        index = BlockIndex(block_size=1)
        index.set_exact("a")
        index.set_exact("a", False, reason="lost_batches")
        assert not index.is_exact("a") and index.inexact_reason("a") == "lost_batches"
        index.set_exact("a")
        assert index.is_exact("a") and index.inexact_reason("a") is None

    def test_removed_backend_frees_its_bit(self) -> None:
        """A removed backend's blocks vanish and its bit is reused by the next new backend."""
        index = BlockIndex(block_size=1)
        hashes = block_hashes(range(3), 1)
        index.record("a", hashes)
        bit = index.bit("a")
        index.remove_backend("a")
        assert len(index) == 0
        assert index.bit("z") == bit
        assert index.match(hashes, ["z"]) == {"z": 0}

    def test_reset_changes_block_size(self) -> None:
        """reset() forgets everything and hashes blocks of the new size."""
        index = BlockIndex(block_size=1)
        index.record("a", block_hashes(range(3), 1))
        index.reset(4)
        assert index.block_size == 4 and len(index) == 0


class TestPrefixClosure:
    @settings(max_examples=200)
    @given(
        records=st.lists(st.tuples(st.sampled_from("ab"), st.lists(st.integers(0, 2), max_size=12)), max_size=30),
        capacity=st.integers(1, 12),
    )
    def test_records_keep_every_backend_prefix_closed(
        self, records: list[tuple[str, list[int]]], capacity: int
    ) -> None:
        """After any approximate records and evictions, a backend holding a block holds every block before it."""
        index = BlockIndex(block_size=1, capacity_blocks=capacity)
        parent: dict[int, int | None] = {}
        for backend, tokens in records:
            hashes = block_hashes(tokens, 1)
            for i, h in enumerate(hashes):
                parent[h] = hashes[i - 1] if i else None
            index.record(backend, hashes)
        for backend in "ab":
            for h, before in parent.items():
                if before is not None and index.holds(backend, h):
                    assert index.holds(backend, before)


class IndexMachine(RuleBasedStateMachine):
    """Random records and exact events against a simple model: per backend, an LRU list of hashes."""

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 6
        self.index = BlockIndex(block_size=2, capacity_blocks=self.capacity)
        self.model: dict[str, OrderedDict[int, None]] = {}

    def _touch(self, backend: str, hashes: list[int]) -> None:
        lru = self.model.setdefault(backend, OrderedDict())
        for h in hashes:
            lru.pop(h, None)
            lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    @rule(backend=st.sampled_from("abc"), tokens=small_tokens)
    def record(self, backend: str, tokens: list[int]) -> None:
        hashes = block_hashes(tokens, 2)
        self.index.record(backend, hashes)
        self._touch(backend, list(reversed(hashes)))

    @rule(backend=st.sampled_from("abc"), tokens=small_tokens)
    def stored(self, backend: str, tokens: list[int]) -> None:
        hashes = self.index.blocks_stored(backend, tokens, block_size=2)
        assert hashes == block_hashes(tokens, 2)
        self._touch(backend, hashes)

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def removed(self, data: Any) -> None:
        backend = data.draw(st.sampled_from(sorted(b for b, lru in self.model.items() if lru)))
        h = data.draw(st.sampled_from(list(self.model[backend])))
        assert self.index.blocks_removed(backend, hashes=[h]) == 1
        del self.model[backend][h]

    @rule(backend=st.sampled_from("abc"))
    def cleared(self, backend: str) -> None:
        self.index.all_cleared(backend)
        self.model.pop(backend, None)

    @invariant()
    def holders_agree_with_the_model(self) -> None:
        expected: dict[int, set[str]] = {}
        for backend, lru in self.model.items():
            assert self.index.blocks(backend) == len(lru) <= self.capacity
            for h in lru:
                expected.setdefault(h, set()).add(backend)
        assert set(self.index.holders) == set(expected)
        for h, backends in expected.items():
            assert {b for b in "abc" if self.index.holds(b, h)} == backends


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=30)


class TestRecentDecisions:
    def test_expires_after_ttl(self) -> None:
        """A recent decision is forgotten once its time to live has passed."""
        now = [0.0]
        recent = RecentDecisions(ttl_s=5.0, clock=lambda: now[0])
        recent.add("r1", 1, [10, 11])
        assert recent.holders == {10: 1, 11: 1}
        now[0] = 6.0
        recent.expire()
        assert recent.holders == {} and len(recent) == 0

    def test_overlapping_requests_are_counted(self) -> None:
        """A block stays held while any recent request on that backend still has it."""
        recent = RecentDecisions()
        recent.add("r1", 2, [10, 11])
        recent.add("r2", 2, [10])
        recent.add("r3", 4, [10])
        recent.discard("r1")
        assert recent.holders == {10: 6}
        recent.discard("r2")
        assert recent.holders == {10: 4}

    def test_bounded_entries(self) -> None:
        """At most max_entries requests are remembered; the oldest go first."""
        recent = RecentDecisions(max_entries=2)
        for i in range(3):
            recent.add(f"r{i}", 1, [i])
        assert len(recent) == 2 and 0 not in recent.holders

    def test_extend_adds_blocks_until_the_request_ends(self) -> None:
        """Blocks added to a remembered request are held with it and forgotten with it."""
        recent = RecentDecisions()
        recent.add("r1", 2, [10])
        assert recent.extend("r1", [11, 12]) and recent.holders == {10: 2, 11: 2, 12: 2}
        recent.discard("r1")
        assert recent.holders == {} and not recent.extend("r1", [13])

    def test_drop_bit(self) -> None:
        """Dropping a backend's bit forgets its entries only."""
        recent = RecentDecisions()
        recent.add("r1", 1, [5])
        recent.add("r2", 2, [5])
        recent.drop_bit(1)
        assert recent.holders == {5: 2}


class TestRecentGrace:
    def test_finished_request_kept_for_the_grace(self) -> None:
        """A finished request's blocks stay held grace_s seconds, then go."""
        now = [0.0]
        recent = RecentDecisions(ttl_s=30.0, grace_s=2.0, clock=lambda: now[0])
        recent.add("r1", 1, [10, 11])
        recent.finish("r1")
        now[0] = 1.9
        recent.expire()
        assert recent.holders == {10: 1, 11: 1}
        now[0] = 2.0
        recent.expire()
        assert recent.holders == {} and recent.kept_after_finish == 1

    def test_covered_or_no_grace_forgets_at_once(self) -> None:
        """A finished request whose blocks the engine reported (or with no grace) is forgotten at finish."""
        recent = RecentDecisions(grace_s=2.0)
        recent.add("r1", 1, [10])
        recent.finish("r1", lambda bit, hashes: True)
        assert len(recent) == 0 and recent.covered_at_finish == 1
        none = RecentDecisions(grace_s=0.0)
        none.add("r1", 1, [10])
        none.finish("r1")
        assert len(none) == 0

    def test_readded_request_not_dropped_by_an_old_grace(self) -> None:
        """A request id sent again after its grace began keeps its new entry when the old grace ends."""
        now = [0.0]
        recent = RecentDecisions(grace_s=1.0, clock=lambda: now[0])
        recent.add("r1", 1, [10])
        recent.finish("r1")
        recent.add("r1", 2, [20])
        now[0] = 5.0
        recent.expire()
        assert recent.holders == {20: 2}


class TestRankSlots:
    def test_slots_are_apart_and_share_the_backends_fate(self) -> None:
        """Each rank holds its own blocks; exactness and removal apply to every rank of the backend."""
        index = BlockIndex(4)
        r1 = index.slot("b", 1)
        assert index.slot("b", 0) == index.slot("b") == "b" and index.owner(r1) == "b"
        index.record("b", [1, 2])
        index.record(r1, [1, 3])
        assert index.match([1, 2], ["b", r1]) == {"b": 2, r1: 1}
        index.set_exact("b")
        assert index.is_exact(r1) and len(index) == 0
        index.blocks_stored("b", list(range(4)), block_size=4, rank=1)
        assert index.blocks(r1) == 1 and index.blocks("b") == 0
        index.remove_backend("b")
        assert len(index) == 0 and index.slots_of("b") == ["b"] and not index.is_exact(r1)

    def test_clear_of_one_rank(self) -> None:
        """all_cleared with a rank clears that rank only; without one, every rank."""
        index = BlockIndex(4)
        index.blocks_stored("b", list(range(4)), block_size=4)
        index.blocks_stored("b", list(range(4)), block_size=4, rank=2)
        index.all_cleared("b", rank=2)
        assert (index.blocks("b"), index.blocks(index.slot("b", 2))) == (1, 0)
        index.blocks_stored("b", list(range(4)), block_size=4, rank=2)
        index.all_cleared("b")
        assert len(index) == 0


class TestTiers:
    def test_tier_blocks_bounded_and_cleared(self) -> None:
        """A slower tier holds at most the backend's capacity, and a clear empties it with the GPU's."""
        index = BlockIndex(4, capacity_blocks=2)
        for start in range(0, 12, 4):
            index.blocks_stored("b", list(range(start, start + 4)), block_size=4, medium="CPU")
        assert index.tier_blocks("b") == {"GPU": 0, "CPU": 2} and len(index.tiered) == 2
        index.all_cleared("b")
        assert index.tier_blocks("b") == {"GPU": 0} and not index.tiered

    def test_block_on_both_tiers_is_on_the_gpu(self) -> None:
        """A block on GPU and CPU counts as GPU; removed from the GPU it is on CPU, still named by its engine hash."""
        index = BlockIndex(4)
        (h,) = index.blocks_stored("b", list(range(4)), block_size=4, engine_hashes=[77])
        index.blocks_stored("b", (), block_size=4, engine_hashes=[77], medium="CPU")
        assert index.tier_of_block("b", h) == "GPU"
        index.blocks_removed("b", [77])
        assert index.tier_of_block("b", h) == "CPU"
        assert index.blocks_removed("b", [77], medium="CPU") == 1 and index.tier_of_block("b", h) is None
