"""Chained block hashes: the identity of a KV-cache block as the router computes it.

A prompt's tokens are cut into blocks of ``block_size``; only full blocks count (engines only
cache full blocks). Block ``i``'s hash is ``xxh3_64(its token ids, seed = hash of block i-1)``,
and block 0's seed is `root_hash` of the request's LoRA adapter and ``cache_salt``: so a
block's hash names the whole prefix up to it, and two tenants or adapters never share one.
Token ids are hashed as little-endian unsigned 64-bit integers.

These are the router's own hashes, never the engine's (vLLM seeds its hashes per process):
KV events are mapped onto them by recomputing from the events' token ids.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import xxhash

from kvroute.hashing import hash_parts
from kvroute_tokenizer_prefix.tokenizer import token_array, token_bytes

__all__ = ["PromptBlocks", "block_hashes", "root_hash"]

_ROOT_TAG = "kvroute-blocks/1"


def root_hash(lora: str | None = None, cache_salt: str | None = None) -> int:
    """The seed of a prompt's first block: LoRA adapter and ``cache_salt`` are part of its key."""
    return hash_parts(_ROOT_TAG, lora, cache_salt)


def block_hashes(
    token_ids: Sequence[int] | array[int],
    block_size: int,
    *,
    parent: int | None = None,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """The chained hashes of every full block of ``token_ids``.

    ``parent`` is the hash of the block before the first one (for a continuation, as in a KV
    event whose parent block is known); without it the chain starts at `root_hash`.
    """
    if block_size < 1:
        raise ValueError(f"'block_size' must be >= 1 (got {block_size}).")
    data = memoryview(token_bytes(token_array(token_ids)))
    step = block_size * 8
    h = root_hash(lora, cache_salt) if parent is None else parent
    out = []
    digest = xxhash.xxh3_64_intdigest
    for offset in range(0, len(data) - step + 1, step):
        h = digest(data[offset : offset + step], h)
        out.append(h)
    return out


#: Memo of hashed pieces: chain key -> (hashes of the blocks the piece completes, leftover bytes, ids in it).
Memo = "OrderedDict[int, tuple[tuple[int, ...], bytes, int]]"


class PromptBlocks:
    """One request's block hashes, computed lazily from a stream of token chunks.

    ``hashes`` grows as :meth:`grow` pulls chunks; ``tokens`` counts the ids seen so far.
    Hashing stops at ``max_blocks`` full blocks (the ``max_prefix_tokens`` bound).

    With a ``memo``, keyed pieces (see `kvroute_tokenizer_prefix.tokenizer.Keyed`) are looked
    up by a chain key (the root, the block size and every piece's key so far): a prefix seen
    before costs a dictionary lookup per piece, neither tokenization nor hashing.
    """

    __slots__ = (
        "_chain", "_chunks", "_done", "_h", "_memo", "_memo_size", "_step", "_tail",
        "block_size", "hashes", "max_blocks", "root", "tokens",
    )

    def __init__(
        self,
        chunks: Iterator[array[int] | tuple[int, Callable[[], array[int]]]],
        block_size: int,
        max_blocks: int,
        root: int,
        memo: OrderedDict[int, tuple[tuple[int, ...], bytes, int]] | None = None,
        memo_size: int = 32_768,
    ) -> None:
        self._chunks = chunks
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.root = root
        self._step = block_size * 8
        self._h = root
        self._tail = b""
        self._done = False
        self._memo = memo
        self._memo_size = memo_size
        self._chain: int | None = hash_parts(_ROOT_TAG, root, block_size) if memo is not None else None
        self.hashes: list[int] = []
        self.tokens = 0

    @property
    def done(self) -> bool:
        """Whether every block up to the bound is hashed."""
        return self._done

    def grow(self) -> bool:
        """Pull the next chunk and hash the blocks it completes; False once nothing is left."""
        if self._done:
            return False
        chunk = next(self._chunks, None)
        if chunk is None:
            self._done = True
            return False
        chain: int | None = None
        if isinstance(chunk, tuple):
            key, load = chunk
            if self._chain is not None:
                chain = self._chain = xxhash.xxh3_64_intdigest(key.to_bytes(8, "little"), self._chain)
                hit = self._memo.get(chain) if self._memo is not None else None
                if hit is not None:
                    new, tail, count = hit
                    self.tokens += count
                    if new:
                        self.hashes.extend(new)
                        self._h = new[-1]
                    self._tail = tail
                    if len(self.hashes) >= self.max_blocks:
                        del self.hashes[self.max_blocks :]
                        self._done = True
                    return not self._done
            ids = load()
        else:
            self._chain = None  # plain ids have no key: nothing after them is memoized
            ids = chunk
        self.tokens += len(ids)
        data = self._tail + token_bytes(ids) if self._tail else token_bytes(ids)
        view = memoryview(data)
        step = self._step
        room = (self.max_blocks - len(self.hashes)) * step
        full = len(data) - len(data) % step
        usable = min(full, room)
        h = self._h
        digest = xxhash.xxh3_64_intdigest
        first = len(self.hashes)
        append = self.hashes.append
        for offset in range(0, usable, step):
            h = digest(view[offset : offset + step], h)
            append(h)
        self._h = h
        self._tail = bytes(view[usable:])
        if chain is not None and usable == full and self._memo is not None:
            memo = self._memo
            memo[chain] = (tuple(self.hashes[first:]), self._tail, len(ids))
            if len(memo) > self._memo_size:
                memo.popitem(last=False)
        if len(self.hashes) >= self.max_blocks:
            self._done = True
            self._tail = b""
        return not self._done

    def ensure(self, count: int) -> None:
        """Hash at least ``count`` blocks, or every block there is."""
        while len(self.hashes) < count and self.grow():
            pass

    def complete(self) -> list[int]:
        """Hash every block up to the bound and return the hashes."""
        while self.grow():
            pass
        return self.hashes

    def tail_key(self) -> int:
        """A key for a prompt shorter than one block: the root and its leftover tokens."""
        return xxhash.xxh3_64_intdigest(self._tail, self.root)
