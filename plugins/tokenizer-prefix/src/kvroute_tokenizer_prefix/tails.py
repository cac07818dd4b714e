"""Pending tails: the part of each sent prompt the router has not hashed yet, extended when a later prompt needs it.

When the router sends a request, the strategy records the blocks ``pick`` hashed; the rest of
the prompt waits here as a `PendingTail` of that backend, keyed by its *frontier* (the hash of
the last block recorded). When a later request's match stops at a frontier of a candidate,
`PendingTails.extend` hashes that tail just past the first byte where the two prompts differ
and records the new blocks (in the index, or in the request's recent decision for an
exact-mode backend), so the later request matches on as if the whole prompt had been recorded.
"""

from __future__ import annotations

from collections import OrderedDict

import attrs

from kvroute.errors import InvalidRequest
from kvroute_tokenizer_prefix.blocks import PromptBlocks, first_difference
from kvroute_tokenizer_prefix.index import BlockIndex, RecentDecisions

__all__ = ["MAX_TAIL_BYTES", "MAX_TAILS", "PendingTail", "PendingTails"]

#: Pending tails kept at most, and the bytes of prompt text they may hold (oldest dropped first).
MAX_TAILS = 4096
MAX_TAIL_BYTES = 32 << 20
#: Pending tails kept per block hash at most (prompts identical up to a block, sent to one backend).
_MAX_TAILS_PER_BLOCK = 16


@attrs.define(eq=False)
class PendingTail:
    """The part of a prompt not hashed yet when it was sent to ``backend``: extended on demand."""

    blocks: PromptBlocks
    backend: str
    bit: int
    #: For an exact-mode backend: the request whose recent decision gets the blocks (else the index does).
    request_id: str | None
    frontier: int
    size: int


@attrs.define(eq=False)
class PendingTails:
    """The pending tails of one strategy, bounded by `MAX_TAILS`, `MAX_TAIL_BYTES` and 16 per frontier.

    Not thread-safe: the strategy uses it under its index's lock.
    """

    index: BlockIndex
    #: Tails by frontier block hash (the matching loops look frontiers up here directly).
    by_frontier: dict[int, list[PendingTail]] = attrs.field(init=False, factory=dict)
    #: Bytes of prompt text and ids the tails hold.
    bytes: int = attrs.field(init=False, default=0)
    #: Tails extended, and blocks they recorded that way, since the strategy was built.
    extended: int = attrs.field(init=False, default=0)
    blocks_recorded: int = attrs.field(init=False, default=0)
    _lru: OrderedDict[PendingTail, None] = attrs.field(init=False, factory=OrderedDict)
    _of_request: dict[str, PendingTail] = attrs.field(init=False, factory=dict)

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def has_requests(self) -> bool:
        """Whether a tail waits on a request in flight (sent to an exact-mode backend)."""
        return bool(self._of_request)

    def add(self, tail: PendingTail) -> None:
        """Keep ``tail`` (the oldest tails go when a bound is passed)."""
        same = self.by_frontier.setdefault(tail.frontier, [])
        same.append(tail)
        if len(same) > _MAX_TAILS_PER_BLOCK:
            self.drop(same[0])
        self._lru[tail] = None
        self.bytes += tail.size
        if tail.request_id is not None:
            self._of_request[tail.request_id] = tail
        while self._lru and (len(self._lru) > MAX_TAILS or self.bytes > MAX_TAIL_BYTES):
            self.drop(next(iter(self._lru)))

    def drop(self, tail: PendingTail) -> None:
        """Forget ``tail`` (nothing when it is not kept)."""
        if tail not in self._lru:
            return
        del self._lru[tail]
        self.bytes -= tail.size
        same = self.by_frontier.get(tail.frontier)
        if same is not None:
            same.remove(tail)
            if not same:
                del self.by_frontier[tail.frontier]
        if tail.request_id is not None and self._of_request.get(tail.request_id) is tail:
            del self._of_request[tail.request_id]

    def clear(self, bit: int | None = None) -> None:
        """Forget the tails of the backend with index bit ``bit``, or every tail."""
        for tail in [t for t in self._lru if bit is None or t.bit == bit]:
            self.drop(tail)

    def finish(self, request_id: str) -> None:
        """Forget the tail waiting on ``request_id``, if any (the request finished)."""
        tail = self._of_request.get(request_id)
        if tail is not None:
            self.drop(tail)

    def extend(self, blocks: PromptBlocks, at: int, bits: int, recent: RecentDecisions) -> bool:
        """Extend the pending tails of ``bits`` that end at block ``at - 1`` of ``blocks`` as far as they agree with it.

        Each is hashed just past the first byte where its prompt and ``blocks``'s differ, and
        its new blocks are recorded. Returns whether one of them grew past block ``at - 1`` (the
        index may hold block ``at`` now). Called under the index lock.
        """
        found = self.by_frontier.get(blocks.hashes[at - 1])
        if not found:
            return False
        index = self.index
        progress = False
        for tail in [t for t in found if t.bit & bits]:
            self.drop(tail)
            theirs = tail.blocks
            exact = index.is_exact(tail.backend)
            if (
                len(theirs.hashes) != at
                or theirs.block_size != blocks.block_size
                or exact != (tail.request_id is not None)
            ):
                continue  # stale: another block size, or the backend switched between exact and approximate mode
            try:
                theirs.skip_memoized()
                limit = first_difference(theirs.segments, blocks.segments)
                if limit is not None:
                    # Hash theirs just past where the two prompts first differ; ours then finds the
                    # pieces theirs completed memoized instead of hashing them again.
                    theirs.advance_past(limit)
                else:
                    _lockstep(theirs, blocks, at)
            except InvalidRequest:
                continue  # cannot happen for text that was tokenized before; forget the tail
            new = theirs.hashes[at:]
            if new:
                self.extended += 1
                self.blocks_recorded += len(new)
                if tail.request_id is not None:
                    if not recent.extend(tail.request_id, new):
                        continue  # the request finished or expired
                else:
                    index.record(tail.backend, theirs.hashes)
            progress = progress or len(theirs.hashes) > at
            if not theirs.done and theirs.hashes:
                tail.frontier = theirs.hashes[-1]
                self.add(tail)
        return progress


def _lockstep(theirs: PromptBlocks, ours: PromptBlocks, at: int) -> None:
    """Hash theirs as long as its blocks equal ours (prompts whose bytes cannot be compared)."""
    mine = ours.hashes
    j = at
    while True:
        if j >= len(theirs.hashes):
            if not theirs.grow() and j >= len(theirs.hashes):
                return
            continue
        while j >= len(mine) and ours.grow():
            pass
        if j >= len(mine) or mine[j] != theirs.hashes[j]:
            return
        j += 1
