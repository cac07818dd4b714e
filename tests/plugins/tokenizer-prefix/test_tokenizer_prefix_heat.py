"""HotPrefixes: which leading blocks carry more than one backend's share of the recent requests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute_tokenizer_prefix import PromptBlocks, TokenizerPrefix
from kvroute_tokenizer_prefix.heat import MIN_EVIDENCE, HotPrefixes

import kvroute


def prompt_blocks(ids: list[int]) -> PromptBlocks:
    """The lazy blocks of a token-id completions prompt, with the default block size (16)."""
    body = {"model": "m", "prompt": ids}
    return TokenizerPrefix().prompt_blocks(kvroute.RouteRequest.from_openai(body, endpoint="completions"))


class TestHotPrefixes:
    @settings(max_examples=60, derandomize=True)
    @given(
        window=st.integers(1, 6),
        shared=st.lists(st.lists(st.integers(0, 5), max_size=4, unique=True), max_size=20),
    )
    def test_counts_are_those_of_the_window(self, window: int, shared: list[list[int]]) -> None:
        """A block's count is how many of the last ``window`` observed requests shared it (no early stop)."""
        heat = HotPrefixes(window)
        for n, blocks in enumerate(shared):
            heat.observe(blocks, members=1 << 20)  # every block is over a millionth of the window
            recent = shared[max(0, n + 1 - window) : n + 1]
            for block in range(6):
                assert heat.count(block) == sum(block in r for r in recent)
            assert len(heat) == len({b for r in recent for b in r})

    def test_hot_needs_evidence_and_more_than_one_backends_share(self) -> None:
        """A block is hot once at least MIN_EVIDENCE requests shared it and they are over 1/members of the window."""
        heat = HotPrefixes(1024)
        for _ in range(MIN_EVIDENCE - 1):
            heat.observe([7], 4)
        assert not heat.is_hot(7, 4)
        heat.observe([7], 4)
        assert heat.is_hot(7, 4)
        other = HotPrefixes(1024)
        for i in range(4 * MIN_EVIDENCE):
            other.observe([8] if i % 4 == 0 else [i], 4)  # exactly 1/4 of the requests
        assert not other.is_hot(8, 4) and other.is_hot(8, 5)

    def test_hot_stays_hot_until_half_its_threshold(self) -> None:
        """Hysteresis: a hot block stays hot while its share is at least half of 1/members, then it is not."""
        heat = HotPrefixes(40)
        for _ in range(40):
            heat.observe([1], 4)
        assert heat.is_hot(1, 4)
        for _ in range(35):  # 5 of 40 left: 1/8, half of 1/4
            heat.observe([2], 4)
        assert heat.is_hot(1, 4)
        heat.observe([2], 4)  # 4 of 40
        assert not heat.is_hot(1, 4) and heat.hot == 0

    def test_counting_stops_after_the_first_block_under_the_share(self) -> None:
        """A request counts its blocks up to the first one not over 1/members of the window: none after it can be."""
        heat = HotPrefixes(1024)
        for _ in range(MIN_EVIDENCE):
            heat.observe([1, 2], 4)
        heat.observe([1, 3, 4], 4)  # 3 is in 1 of 9 requests: under a quarter
        assert (heat.count(1), heat.count(2), heat.count(3), heat.count(4)) == (MIN_EVIDENCE + 1, MIN_EVIDENCE, 1, 0)
        heat.observe([1, 2, 5], 4)  # 2 is over a quarter: 5 is counted
        assert heat.count(5) == 1

    def test_one_backend_has_no_hot_heads(self) -> None:
        """With a single member every prefix is its whole traffic, and nothing is worth spreading."""
        heat = HotPrefixes(64)
        for _ in range(64):
            heat.observe([3], 1)
        assert not heat.is_hot(3, 1)

    def test_depth_is_the_leading_run_of_hot_blocks(self) -> None:
        """A prompt's hot depth counts its leading hot blocks and stops at the first one that is not."""
        ids = list(range(100, 100 + 16 * 6))
        hashes = list(prompt_blocks(ids).complete())
        heat = HotPrefixes(1024)
        for _ in range(MIN_EVIDENCE):
            heat.observe(hashes[:3], 2)
        assert heat.depth(prompt_blocks(ids), 2) == 3
        assert heat.depth(prompt_blocks([5, *ids]), 2) == 0

    def test_blocks_leaving_the_window_are_forgotten(self) -> None:
        """Once its requests have left the window, a block has no count and is no longer hot."""
        heat = HotPrefixes(MIN_EVIDENCE)
        for _ in range(MIN_EVIDENCE):
            heat.observe([9], 2)
        assert heat.is_hot(9, 2)
        for _ in range(MIN_EVIDENCE):
            heat.observe([], 2)
        assert heat.count(9) == 0 and heat.hot == 0 and len(heat) == 0

    def test_window_must_be_positive(self) -> None:
        """A window of no requests is refused, saying what was expected."""
        with pytest.raises(ValueError, match="'window' must be a positive integer"):
            HotPrefixes(0)
