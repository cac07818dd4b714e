"""Hot heads: leading blocks that more than one backend's share of the recent traffic starts with.

A prefix that many different prompts start with (one chat application's system prompt, a
template's preamble, a popular first document) is no reason to send a new prompt to the backend
that happens to hold it: whichever backend held it first would take every new conversation
under it, and a backend that never got it would be starved. Such a *hot head* is worth its
prefill once on every backend; what decides where a prompt goes is the part after it.

`HotPrefixes` counts, over the last ``window`` started requests, the leading blocks each one
shared with what the router had seen (its longest match, plus one block). A block is hot when
more than ``1 / members`` of the window's requests started with it, once at least
`MIN_EVIDENCE` of them did; it stays hot until that share falls under half of it (hysteresis,
so that a prefix near the threshold does not move its prompts back and forth). Counts only
shrink along a chain (a request that counts a block counts every block before it), so a
prompt's hot head is its leading run of hot blocks, and a request stops counting after its
first block that is neither over one backend's share nor hot: nothing deeper can be. A
request thus counts its hot head and one block more, not its whole history (a conversation's
8,000 tokens), and a block starts being counted as soon as its parent is over the share, so
nested heads (a template's preamble, then one application's system prompt) are learnt
together, not one block per `MIN_EVIDENCE` requests. Counts are exact for blocks whose parents
stay over the share; near the line they may run low, which errs toward keeping a prefix on one
backend.

This is the block-level form of the hash strategies' hot groups (``consistent-hash``'s
``HotGroups``): one backend's share of the traffic is the line between a prefix that should
stay on one backend and one that should be spread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs

from kvroute_tokenizer_prefix.blocks import PromptBlocks

__all__ = ["MIN_EVIDENCE", "HotPrefixes"]

#: Requests of the window that must start with a block before it can be called hot.
MIN_EVIDENCE = 8


@attrs.define
class HotPrefixes:
    """A sliding window over the shared leading blocks of started requests, and the hot ones among them.

    Not thread-safe: the strategy uses it under its index's lock.
    """

    window: int = 1024
    _recent: deque[tuple[int, ...]] = attrs.field(init=False)
    _counts: dict[int, int] = attrs.field(factory=dict, init=False)
    _hot: set[int] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"'window' must be a positive integer (got {self.window!r}).")
        self._recent = deque()

    def __len__(self) -> int:
        """Blocks counted in the window (distinct)."""
        return len(self._counts)

    @property
    def hot(self) -> int:
        """How many blocks are hot now."""
        return len(self._hot)

    def count(self, block: int) -> int:
        """Requests of the window that started with ``block``."""
        return self._counts.get(block, 0)

    def is_hot(self, block: int, members: int) -> bool:
        """Whether ``block`` heads more than one backend's share of the window (with hysteresis)."""
        count, seen = self._counts.get(block, 0), len(self._recent)
        if block in self._hot:
            if count * 2 * members >= seen:
                return True
            self._hot.discard(block)
            return False
        if members > 1 and count >= MIN_EVIDENCE and count * members > seen:
            self._hot.add(block)
            return True
        return False

    def depth(self, blocks: PromptBlocks, members: int) -> int:
        """How many leading blocks of ``blocks`` are hot, hashing only as far as the hot run goes.

        `is_hot` block after block, inlined: a preamble of 20,000 tokens is a thousand hot blocks per request.
        """
        hashes = blocks.hashes
        counts, hot = self._counts, self._hot
        seen = len(self._recent)
        twice = 2 * members
        depth = 0
        while True:
            if depth == len(hashes):
                blocks.ensure(depth + 1)
                if depth == len(hashes):
                    return depth
            block = hashes[depth]
            count = counts.get(block, 0)
            if block in hot:
                if count * twice >= seen:
                    depth += 1
                    continue
                hot.discard(block)
                return depth
            if members > 1 and count >= MIN_EVIDENCE and count * members > seen:
                hot.add(block)
                depth += 1
                continue
            return depth

    def observe(self, shared: Sequence[int], members: int) -> None:
        """Count one started request that shared the leading blocks ``shared`` (the oldest leaves the window).

        Counting stops after the first block that is neither over ``1 / members`` of the window
        nor hot: no block after it can be.
        """
        counts = self._counts
        if len(self._recent) == self.window:
            for block in self._recent.popleft():
                left = counts[block] - 1
                if left:
                    counts[block] = left
                else:
                    del counts[block]
                    self._hot.discard(block)
        seen = len(self._recent) + 1
        counted = []
        for block in shared:
            count = counts.get(block, 0) + 1
            counts[block] = count
            counted.append(block)
            if count * members <= seen and block not in self._hot:
                break
        self._recent.append(tuple(counted))

    def clear(self) -> None:
        """Forget everything (the block size changed: every hash did)."""
        self._recent.clear()
        self._counts.clear()
        self._hot.clear()
