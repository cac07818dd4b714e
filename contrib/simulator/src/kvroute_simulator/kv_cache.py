"""The paged KV cache of one engine: blocks, reference counts, the hash index and the LRU free queue.

``capacity`` blocks, identified by their index. A full block whose tokens are known gets a
chained hash (registered with :meth:`BlockPool.store`) and stays findable by it until the
block is reused. Blocks held by running sequences are reference-counted. Free blocks sit in
one queue in eviction order: never-used blocks first, then blocks in the order they were
freed (:meth:`BlockPool.release` frees a sequence's blocks last-to-first, so its tail goes
first). Allocation takes the queue's head and drops its hash: LRU eviction of unreferenced
blocks only.

:class:`HostTier` is the optional CPU tier behind the pool: the hashes of blocks the pool
evicted, kept in LRU order up to its capacity, and given back (moved to the GPU) on a hit.
The two tiers are exclusive: a block is findable in at most one of them.
"""

from __future__ import annotations

import collections

__all__ = ["BlockPool", "HostTier"]


class BlockPool:
    """The blocks of one engine's KV cache and the index of the cached ones by hash."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._fresh = 0  # ids below were used at least once; ids above were never used
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._block_hash: list[int | None] = [None] * capacity
        self._ref: list[int] = [0] * capacity
        self._cached: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks that are not referenced by a running sequence (including evictable cached ones)."""
        return self.capacity - self._fresh + len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash (referenced or not)."""
        return len(self._cached)

    def is_cached(self, block_hash: int) -> bool:
        """Whether a block with this hash is in the cache."""
        return block_hash in self._cached

    def allocate(self, count: int, into: list[int]) -> list[int]:
        """Append ``count`` new blocks to ``into`` (never-used first, then the LRU head, dropping its hash).

        Returns the hashes that are no longer findable (the evicted blocks').
        """
        fresh_left = self.capacity - self._fresh
        take = min(count, fresh_left)
        if take:
            into.extend(range(self._fresh, self._fresh + take))
            for b in range(self._fresh, self._fresh + take):
                self._ref[b] = 1
            self._fresh += take
            count -= take
        removed: list[int] = []
        if not count:
            return removed
        free, block_hash, cached, ref = self._free, self._block_hash, self._cached, self._ref
        for _ in range(count):
            b, _none = free.popitem(last=False)
            h = block_hash[b]
            if h is not None:
                block_hash[b] = None
                if cached.get(h) == b:
                    del cached[h]
                    removed.append(h)
            ref[b] = 1
            into.append(b)
        return removed

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block, last block first; unreferenced blocks join the free queue's tail."""
        ref, free = self._ref, self._free
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
        blocks.clear()

    def touch(self, blocks: list[int]) -> None:
        """Take one reference to each block (cache hits), taking unreferenced ones out of the free queue."""
        ref, free = self._ref, self._free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def unreferenced(self, blocks: list[int]) -> int:
        """Return how many of ``blocks`` no running sequence references (a hit on them takes a free block)."""
        ref = self._ref
        return sum(1 for b in blocks if ref[b] == 0)

    def lookup(self, hashes: list[int]) -> list[int]:
        """Return the cached blocks holding the longest run of leading ``hashes``."""
        cached = self._cached
        hits: list[int] = []
        for h in hashes:
            b = cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def store(self, hashes: list[int], blocks: list[int], start: int, upto: int) -> list[int]:
        """Make blocks ``start:upto`` findable by their hashes (first writer wins); return the new ones' indexes."""
        cached, block_hash = self._cached, self._block_hash
        stored: list[int] = []
        for i in range(start, upto):
            h = hashes[i]
            if h not in cached:
                b = blocks[i]
                cached[h] = b
                block_hash[b] = h
                stored.append(i)
        return stored

    def audit(self, refs: collections.Counter[int]) -> list[str]:
        """Return the broken invariants of the pool, given how many running references each block has."""
        problems: list[str] = []
        for b in range(self.capacity):
            if self._ref[b] != refs.get(b, 0):
                problems.append(f"block {b}: ref {self._ref[b]} but {refs.get(b, 0)} running references")
            if b >= self._fresh and (self._ref[b] or b in self._free or self._block_hash[b] is not None):
                problems.append(f"block {b}: never allocated but in use")
        for b in self._free:
            if self._ref[b]:
                problems.append(f"block {b}: in the free queue with ref {self._ref[b]}")
        unreferenced = sum(1 for b in range(self._fresh) if self._ref[b] == 0)
        if unreferenced != len(self._free):
            problems.append(f"{unreferenced} used blocks are unreferenced but the free queue holds {len(self._free)}")
        for h, b in self._cached.items():
            if self._block_hash[b] != h:
                problems.append(f"hash {h}: maps to block {b}, which holds {self._block_hash[b]}")
        return problems


class HostTier:
    """The CPU tier of one engine: hashes of blocks the GPU pool evicted, least recently used first.

    ``offload`` takes the pool's evicted blocks and pushes the least recently used ones out past
    ``capacity``; ``match`` counts how many leading hashes of a lookup it holds and ``take`` moves
    them out (to the GPU, where the scheduler stores them again); ``discard`` drops hashes the GPU
    computed anew, so a block is never in both tiers.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a CPU tier needs a capacity of at least one block (got {capacity!r}).")
        self.capacity = capacity
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def offload(self, hashes: list[int]) -> tuple[list[int], list[int]]:
        """Keep the evicted ``hashes`` (most recent last); return ``(stored, dropped)``: new hashes, pushed-out ones."""
        lru, cap = self._lru, self.capacity
        stored: list[int] = []
        for h in hashes[-cap:]:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                stored.append(h)
        dropped: list[int] = []
        while len(lru) > cap:
            dropped.append(lru.popitem(last=False)[0])
        return stored, dropped

    def match(self, hashes: list[int]) -> int:
        """Return how many leading ``hashes`` this tier holds."""
        lru = self._lru
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def take(self, hashes: list[int]) -> None:
        """Remove ``hashes`` (all held: a hit being copied back to the GPU)."""
        for h in hashes:
            del self._lru[h]

    def discard(self, hashes: list[int]) -> list[int]:
        """Remove those of ``hashes`` this tier holds; return them."""
        lru = self._lru
        gone = [h for h in hashes if h in lru]
        for h in gone:
            del lru[h]
        return gone
