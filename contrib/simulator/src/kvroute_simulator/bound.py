"""Hit-rate references of a run: one engine with an infinite cache, and one pooled LRU cache of the fleet's size.

Both replay the requests in arrival order, one at a time, through :func:`replay`, which
applies the engine's own caching rules; they differ only in what the cache keeps:

* :func:`ideal_hit_tokens`, the upper bound: a cache that keeps every block it ever computed.
  No routing can do better. :func:`reused_blocks` counts the blocks it hits at least once:
  the workload's working set (what is worth keeping).
* :func:`pooled_lru_hit_tokens`: one cache of a given number of blocks (the fleet's total)
  evicting the least recently used block, as one engine that pooled every instance's memory
  would. Routing over separate engines of that total can approach it, rarely beat it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

from kvroute_simulator.engine_config import EngineConfig
from kvroute_simulator.sequences import EngineRequest

__all__ = [
    "BlockCache",
    "final_computed_tokens",
    "ideal_hit_tokens",
    "pooled_lru_hit_tokens",
    "replay",
    "reused_blocks",
]


class BlockCache(Protocol):
    """What :func:`replay` needs from a cache of block hashes."""

    def match(self, hashes: Sequence[int], limit: int) -> int:
        """Return how many of the leading ``hashes`` (at most ``limit``) are cached, and mark them used."""
        ...

    def store(self, hashes: Sequence[int]) -> None:
        """Keep the blocks a finished request computed (its leading ``hashes``)."""
        ...


def final_computed_tokens(request: EngineRequest) -> int:
    """Return the tokens an engine has computed when ``request`` finishes: all but the last sampled one."""
    return len(request.prompt) + request.output_len - 1


def replay(requests: Iterable[EngineRequest], config: EngineConfig, cache: BlockCache) -> tuple[int, int]:
    """Serve ``requests`` one at a time from ``cache``; return (hit tokens, prompt tokens).

    The engine's rules: the same chained block hashes (none when prefix caching is off), a
    lookup of at most ``prompt - 1`` tokens in full blocks, and, once a request finishes,
    every full block of what it computed findable, prompt and known output alike (a
    multi-turn answer, which the next turn hits). Requests the engine refuses
    (:meth:`EngineConfig.rejection`) count neither in the hits nor in the prompt tokens,
    as in the engines' own counters.
    """
    hits = total = 0
    for request in requests:
        if config.rejection(request) is not None:
            continue
        hashes = config.block_hashes(request)
        prompt = len(request.prompt)
        hits += cache.match(hashes, config.lookup_limit(len(hashes), prompt)) * config.block_size
        total += prompt
        cache.store(hashes[: config.stored_blocks(len(hashes), final_computed_tokens(request))])
    return hits, total


class _Unbounded:
    """Keeps every block; remembers which were hit at least once."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.reused: set[int] = set()

    def match(self, hashes: Sequence[int], limit: int) -> int:
        n = 0
        while n < limit and hashes[n] in self.blocks:
            n += 1
        self.reused.update(hashes[:n])
        return n

    def store(self, hashes: Sequence[int]) -> None:
        self.blocks.update(hashes)


class _Lru:
    """Keeps at most ``capacity`` blocks; evicts the least recently used.

    A finished request's blocks become the most recent, its first block last of all: an
    engine frees a sequence's blocks last-to-first, so its tail is evicted before its prefix.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: Sequence[int], limit: int) -> int:
        n = 0
        while n < limit and hashes[n] in self.blocks:
            n += 1
        return n

    def store(self, hashes: Sequence[int]) -> None:
        blocks = self.blocks
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


def ideal_hit_tokens(requests: Iterable[EngineRequest], config: EngineConfig | None = None) -> tuple[int, int]:
    """Return (hit tokens, prompt tokens) of one engine with an infinite cache that served every request.

    This is the upper bound of any routing over engines with these settings: one pooled
    instance that keeps every block it ever computed, serving the requests in the given
    order (arrival order), by the engine's rules (:func:`replay`).
    """
    return replay(requests, config or EngineConfig(), _Unbounded())


def reused_blocks(requests: Iterable[EngineRequest], config: EngineConfig | None = None) -> int:
    """Return how many distinct blocks the infinite cache of :func:`ideal_hit_tokens` hits at least once.

    That is the working set: the shared prefixes' blocks (for ``long-prefix``, the prefix
    blocks of every group that is requested twice or more; for conversations, the history
    that a later turn reuses). A block computed once and never asked for again is not in it.
    """
    cache = _Unbounded()
    replay(requests, config or EngineConfig(), cache)
    return len(cache.reused)


def pooled_lru_hit_tokens(
    requests: Iterable[EngineRequest], capacity_blocks: int, config: EngineConfig | None = None
) -> tuple[int, int]:
    """Return (hit tokens, prompt tokens) of one LRU cache of ``capacity_blocks`` that served every request.

    The reference for a fleet whose engines hold ``capacity_blocks`` in total: one engine
    with all their memory, evicting the least recently used unreferenced block. Requests are
    served one at a time, so no running request pins blocks (an engine's running requests
    do, which can only lower what it keeps).
    """
    if capacity_blocks < 1:
        raise ValueError(f"'capacity_blocks' must be at least 1 (got {capacity_blocks}).")
    return replay(requests, config or EngineConfig(), _Lru(capacity_blocks))
