"""Matching: how many leading blocks of a prompt each candidate holds, hashing the prompt only as far as needed.

Candidates are index bits (`BlockIndex.bit`); what they hold is the block index's holders,
plus, for exact-mode backends, the recent decisions (`RecentDecisions`). Where a candidate
stops matching at the frontier of one of its pending tails, the tail is extended first
(`PendingTails.extend`) and matching goes on from there. Both functions are the strategy's
hot path: they keep what they use in local names and touch each block hash once or a few times.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate, repeat
from operator import and_, or_

from kvroute_tokenizer_prefix.blocks import PromptBlocks
from kvroute_tokenizer_prefix.index import BlockIndex, RecentDecisions
from kvroute_tokenizer_prefix.tails import PendingTails

__all__ = ["match_bisect", "match_walk"]


def match_bisect(
    blocks: PromptBlocks,
    bits: list[int],
    matched: list[int],
    index: BlockIndex,
    tails: PendingTails,
    recent: RecentDecisions,
) -> None:
    """Set ``matched[j]`` to the leading blocks candidate ``bits[j]`` holds, for prefix-closed candidates only.

    A candidate the index learns about from the router's own records holds every block
    before any block it holds (see `BlockIndex.record`), so where candidates stop matching is
    found by bisection between the last block all hold and the last block hashed.
    """
    get = index.holders.get
    pending = tails.by_frontier
    hashes = blocks.hashes
    alive = 0
    for bit in bits:
        alive |= bit
    i = 0  # every candidate in ``alive`` holds hashes[:i]
    while alive:
        n = len(hashes)
        if i >= n:
            if not blocks.grow() and i >= len(hashes):
                break
            continue
        last = get(hashes[n - 1], 0) & alive
        if last == alive:
            i = n
            continue
        # Which candidates stop where, between block i - 1 (all of ``alive``) and block n - 1 (``last``).
        drops: list[tuple[int, int]] = []
        stack = [(i - 1, n - 1, alive, last)]
        while stack:
            lo, hi, above, below = stack.pop()
            if above == below:
                continue
            if hi - lo == 1:
                drops.append((hi, above & ~below))
                continue
            mid = (lo + hi) // 2
            middle = get(hashes[mid], 0) & above
            stack.append((lo, mid, above, middle))
            stack.append((mid, hi, middle, below & middle))
        drops.sort()
        for at, lost in drops:
            if at and pending and hashes[at - 1] in pending and tails.extend(blocks, at, lost, recent):
                i = at  # the index changed: bisect again from that block
                break
            for j, bit in enumerate(bits):
                if lost & bit:
                    matched[j] = at
            alive &= ~lost
        else:
            i = n
    if alive:
        for j, bit in enumerate(bits):
            if alive & bit:
                matched[j] = len(hashes)


def match_walk(
    blocks: PromptBlocks,
    bits: list[int],
    matched: list[int],
    index: BlockIndex,
    tails: PendingTails,
    recent: RecentDecisions,
) -> None:
    """Set ``matched[j]`` to the leading blocks candidate ``bits[j]`` holds, looking every block up.

    For candidates in exact mode (KV events may remove any block), recent decisions and blocks on
    slower tiers (`BlockIndex.tiered`, held on any tier counts): the
    running intersection of holders, block by block, tells where each candidate stops.
    """
    get = index.holders.get
    held = recent.holders
    tiered = index.tiered
    pending = tails.by_frontier
    hashes = blocks.hashes
    alive = 0
    for bit in bits:
        alive |= bit
    i = 0  # every candidate in ``alive`` holds hashes[:i]
    while alive:
        if i >= len(hashes):
            if not blocks.grow() and i >= len(hashes):
                break
            continue
        part = hashes[i:] if i else hashes
        masks = map(get, part, repeat(0))
        if held:
            masks = map(or_, masks, map(held.get, part, repeat(0)))
        if tiered:
            masks = map(or_, masks, map(tiered.get, part, repeat(0)))
        running = list(accumulate(masks, and_, initial=alive))
        # running[k]: the candidates holding hashes[:i + k]; it only ever loses candidates.
        k = 0
        last = running[-1]
        while running[k] != last:
            now = running[k]
            k = bisect_left(running, True, k + 1, key=now.__ne__)  # the next block that loses a candidate
            at = i + k - 1  # the candidates lost there hold ``at`` leading blocks
            lost = now & ~running[k]
            if at and pending and hashes[at - 1] in pending and tails.extend(blocks, at, lost, recent):
                break  # the index changed: walk on from that block
            for j, bit in enumerate(bits):
                if lost & bit:
                    matched[j] = at
        else:
            alive = last
            i += len(part)
            continue
        alive = now
        i = at
    if alive:
        for j, bit in enumerate(bits):
            if alive & bit:
                matched[j] = len(hashes)
