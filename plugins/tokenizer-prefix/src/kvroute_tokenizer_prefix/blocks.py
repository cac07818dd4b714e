"""Chained block hashes: the identity of a KV-cache block as the router computes it.

A prompt's tokens are cut into blocks of ``block_size``; only full blocks count (engines only
cache full blocks). Block ``i``'s hash is ``xxh3_64(its token ids, seed = hash of block i-1)``,
and block 0's seed is `root_hash` of the request's LoRA adapter and ``cache_salt``: so a
block's hash names the whole prefix up to it, and two tenants or adapters never share one.
Token ids are hashed as little-endian unsigned 64-bit integers.

These are the router's own hashes, never the engine's (vLLM seeds its hashes per process):
KV events are mapped onto them by recomputing from the events' token ids.

`PromptBlocks` computes one prompt's hashes lazily, from *segments*: arrays of token ids,
and `TextSegment` s that a `PieceCodec` (the tokenizer) cuts into pieces and tokenizes.
Text is walked at two granularities:

* *pieces* of at least ``piece_bytes``: with a memo, a piece whose whole prefix (every byte
  and id before it, the root, the block size) was hashed before is applied from the memo: one
  hash of its bytes and one dictionary lookup, no tokenization, no block hashing;
* *fine pieces* of at least ``fine_bytes`` inside a piece that missed: each is tokenized on its
  own (the codec caches their ids) and hashed, and the caller regains control after each, so
  a prompt nobody has seen costs its first fine piece or so, not its whole text.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Iterable, Iterator, Sequence

import xxhash

from kvroute.hashing import hash_parts

# The piece memo and the segments live in their own modules; their names stay importable from here.
from kvroute_tokenizer_prefix.memo import PieceMemo
from kvroute_tokenizer_prefix.segments import (
    PieceCodec,
    Segment,
    TextSegment,
    first_difference,
    ids_from_bytes,
    iter_pieces,
    token_array,
    token_bytes,
)

__all__ = [
    "PieceCodec",
    "PieceMemo",
    "PromptBlocks",
    "Segment",
    "TextSegment",
    "block_hashes",
    "first_difference",
    "ids_from_bytes",
    "iter_pieces",
    "root_hash",
    "token_array",
    "token_bytes",
]

_ROOT_TAG = "kvroute-blocks/1"
# Id segments chain with another seed than text pieces, so that text bytes equal to some ids' bytes never alias.
_IDS_SEED = 0x9E37_79B9_7F4A_7C15
# Token-id segments are hashed this many blocks at a time between two chances to stop.
_ID_STEP_BLOCKS = 64
# Message hashes past the token cap chain with another seed than blocks, so that they never alias a block.
_MESSAGE_SEED = 0xC2B2_AE3D_27D4_EB4F


@functools.lru_cache(maxsize=1024)
def root_hash(lora: str | None = None, cache_salt: str | None = None) -> int:
    """The seed of a prompt's first block: LoRA adapter and ``cache_salt`` are part of its key."""
    return hash_parts(_ROOT_TAG, lora, cache_salt)


@functools.lru_cache(maxsize=1024)
def _chain_seed(root: int, block_size: int) -> int:
    return hash_parts(_ROOT_TAG, root, block_size)


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


class PromptBlocks:
    """One request's block hashes, computed lazily from its segments.

    ``hashes`` grows as :meth:`grow` advances; ``tokens`` counts the ids seen so far. Hashing
    stops at ``max_blocks`` full blocks (the ``max_prefix_tokens`` bound). Each :meth:`grow`
    tokenizes at most one fine piece (or hashes at most 64 blocks of token ids), first, and
    then applies every memoized piece and every fine piece whose ids are cached that follow,
    so a caller stops paying as soon as it knows enough.

    With a ``memo``, pieces are looked up by a chain key (the root, the block size and every
    byte and id before and in the piece): a prefix seen before costs one lookup per piece.
    """

    __slots__ = (
        "_at",
        "_beyond",
        "_done",
        "_gen",
        "_h",
        "_memo",
        "_resume",
        "_segments",
        "_step",
        "_tail",
        "block_size",
        "hashes",
        "max_blocks",
        "pace",
        "root",
        "tokens",
    )

    def __init__(
        self,
        segments: Iterable[array[int] | TextSegment],
        block_size: int,
        max_blocks: int,
        root: int,
        memo: PieceMemo | None = None,
        beyond: tuple[str, Sequence[int]] | None = None,
    ) -> None:
        self._segments = list(segments)
        self._beyond = beyond
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.root = root
        self._step = block_size * 8
        self._h = root
        self._tail = b""
        self._done = False
        self._memo = memo
        #: Where the piece being hashed started: (segment, offset, chain key, hash, leftover bytes, hashes, ids so far).
        self._resume: tuple[int, int, int, int, bytes, int, int] | None = None
        #: (segment, byte offset) of the first byte not hashed yet, as of the last pause.
        self._at = (0, 0)
        self.hashes: list[int] = []
        self.tokens = 0
        #: Also pause after every piece (a background thread hashing ahead hands the GIL back there).
        self.pace = False
        self._gen = self._drive(0, 0, _chain_seed(root, block_size) if memo is not None else None)

    @property
    def done(self) -> bool:
        """Whether every block up to the bound is hashed."""
        return self._done

    def grow(self) -> bool:
        """Advance by one step; False once nothing is left (the last step may still have added hashes)."""
        if self._done:
            return False
        try:
            next(self._gen)
        except StopIteration:
            self._done = True
        except BaseException:
            self._done = True  # a generator that raised cannot resume
            raise
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

    def tokens_of(self, count: int) -> int:
        """Tokens in the first ``count`` hashes: message hashes past the cap count none (their tokens are unknown)."""
        return min(count, self.max_blocks) * self.block_size

    def tail_key(self) -> int:
        """A key for a prompt shorter than one block: the root and its leftover tokens."""
        return xxhash.xxh3_64_intdigest(self._tail, self.root)

    def text_bytes(self) -> int:
        """Bytes of text and ids this object holds on to (what keeping it pending costs)."""
        return sum(len(s.data) if isinstance(s, TextSegment) else 8 * len(s) for s in self._segments)

    def fork(self) -> PromptBlocks | None:
        """A copy that hashes the rest of the prompt from the start of the piece this one is in, into its own memo.

        The copy shares nothing mutable with this one (the segments are read only), so
        another thread may run it: its `memo` then holds every piece of the rest of the
        prompt, ready to be merged into the shared one. ``None`` when there is nothing to
        hash ahead (done, no memo, or inside token ids).
        """
        if self._done or self._resume is None or self._memo is None:
            return None
        segment, pos, chain, h, tail, count, _ = self._resume
        other = PromptBlocks.__new__(PromptBlocks)
        other._segments = self._segments
        other.block_size = self.block_size
        other.max_blocks = self.max_blocks - count
        other.root = self.root
        other._step = self._step
        other._h = h
        other._tail = tail
        other._done = False
        other._memo = PieceMemo(max_blocks=1 << 62, max_entries=1 << 62)
        other._resume = None
        other._at = (segment, pos)
        other.hashes = []
        other.tokens = 0
        other.pace = False
        other._beyond = None
        other._gen = other._run(segment, pos, chain)
        return other

    @property
    def position(self) -> tuple[int, int]:
        """(segment, byte offset) of the first byte or id not hashed yet (ids count 8 bytes each)."""
        return (len(self._segments), 0) if self._done else self._at

    def remaining_bytes(self) -> int:
        """Bytes of text and ids (8 each) not hashed yet, from the last pause on."""
        if self._done:
            return 0
        segment, offset = self._at
        total = -offset
        for seg in self._segments[segment:]:
            total += len(seg.data) if isinstance(seg, TextSegment) else 8 * len(seg)
        return max(0, total)

    def skip_memoized(self) -> bool:
        """If the piece being hashed has been memoized since (by a prefetch), take it from the memo.

        Restarts from the start of that piece, so the fine pieces already hashed in it are not
        needed again (their ids may have left the cache meanwhile). Returns whether it did.
        """
        if self._done or self._resume is None or self._memo is None:
            return False
        segment, pos, chain, h, tail, count, tokens = self._resume
        text = self._segments[segment]
        assert isinstance(text, TextSegment)
        end = text.codec.cut(text.data, pos, text.codec.piece_bytes)
        if xxhash.xxh3_64_intdigest(memoryview(text.data)[pos:end], chain) not in self._memo:
            return False
        del self.hashes[count:]
        self._h, self._tail, self.tokens = h, tail, tokens
        self._gen = self._drive(segment, pos, chain)
        return True

    def advance_past(self, limit: tuple[int, int]) -> None:
        """Hash until the byte or id at ``limit`` (a `position`) is hashed, or everything is."""
        while self.position <= limit and self.grow():
            pass

    @property
    def segments(self) -> list[array[int] | TextSegment]:
        """The prompt's segments (read only)."""
        return self._segments

    @property
    def memo(self) -> PieceMemo | None:
        """The memo pieces are looked up in and stored to."""
        return self._memo

    def remaining_text(self) -> list[tuple[TextSegment, int]]:
        """Text not hashed yet: each text segment with the offset of the piece hashing is in."""
        if self._done or self._resume is None:
            return []
        segment, pos = self._resume[0], self._resume[1]
        out = []
        for i in range(segment, len(self._segments)):
            seg = self._segments[i]
            if isinstance(seg, TextSegment):
                out.append((seg, pos if i == segment else 0))
        return out

    # -- the engine ------------------------------------------------------------------------

    def _drive(self, start: int, start_pos: int, chain: int | None) -> Iterator[None]:
        """Hash the blocks (`_run`); if they reached ``max_blocks``, then the messages past them (`_past_cap`)."""
        yield from self._run(start, start_pos, chain)
        if self._beyond is not None and len(self.hashes) >= self.max_blocks > 0:
            self._past_cap(*self._beyond)

    def _past_cap(self, text: str, offsets: Sequence[int]) -> None:
        """Append one hash per message of a prompt longer than the cap: its text, chained from the last block.

        A chat prompt's blocks stop at ``max_blocks``; what follows is told apart by its
        messages instead (a conversation's turns, an agent's tool outputs): hash *k* past the
        cap names the last block and the routing text up to the end of message *k*
        (`kvroute.request.RouteRequest.message_offsets`; the first one includes the tools
        rendered before it). Hashing text costs no tokenization. They match like blocks:
        holding one means having been sent every message before it under the same blocks.
        """
        digest = xxhash.xxh3_64_intdigest
        h = self.hashes[-1] ^ _MESSAGE_SEED
        append = self.hashes.append
        start = 0
        for end in offsets[1:]:
            if end > start:
                h = digest(text[start:end].encode("utf-8", "surrogatepass"), h)
                append(h)
                start = end

    def _absorb(self, data: bytes) -> bool:
        """Hash the blocks ``data`` (token bytes) completes; True once ``max_blocks`` is reached."""
        self.tokens += len(data) >> 3
        if self._tail:
            data = self._tail + data
        step = self._step
        hashes = self.hashes
        room = (self.max_blocks - len(hashes)) * step
        usable = len(data) - len(data) % step
        if usable >= room:
            usable = room
        if usable:
            view = memoryview(data)
            h = self._h
            digest = xxhash.xxh3_64_intdigest
            append = hashes.append
            for offset in range(0, usable, step):
                h = digest(view[offset : offset + step], h)
                append(h)
            self._h = h
        if usable == room:
            self._tail = b""
            return True
        self._tail = data[usable:]
        return False

    def _run(self, start: int, start_pos: int, chain: int | None) -> Iterator[None]:
        memo = self._memo
        # The memo's dictionary, used directly on the hot path (one method call less per piece).
        entries = memo._data if memo is not None else None
        hashes = self.hashes
        digest = xxhash.xxh3_64_intdigest
        if self.max_blocks <= 0:
            return
        for number in range(start, len(self._segments)):
            segment = self._segments[number]
            if not isinstance(segment, TextSegment):
                self._resume = None
                data = token_bytes(segment)
                if chain is not None:
                    chain = digest(data, chain ^ _IDS_SEED)
                chunk = _ID_STEP_BLOCKS * self._step
                for offset in range(0, len(data), chunk):
                    if offset:
                        self._at = (number, offset)
                        yield  # the caller may stop before the next blocks are hashed
                    if self._absorb(data[offset : offset + chunk]):
                        return
                continue
            text = segment.data
            codec = segment.codec
            cut = codec.cut
            encode = codec.encode
            cached = codec.cached
            coarse, fine = codec.piece_bytes, codec.fine_bytes
            view = memoryview(text)
            n = len(text)
            pos = start_pos if number == start else 0
            while pos < n:
                end = cut(text, pos, coarse)
                key: int | None = None
                if chain is not None and entries is not None:
                    key = digest(view[pos:end], chain)
                    hit = entries.get(key)
                    if hit is not None:
                        entries.move_to_end(key)
                        new, self._tail, count = hit
                        self.tokens += count
                        if new:
                            hashes.extend(new)
                            self._h = new[-1]
                            if len(hashes) >= self.max_blocks:
                                del hashes[self.max_blocks :]
                                self._tail = b""
                                return
                        chain = key
                        pos = end
                        if self.pace:
                            self._at = (number, pos)
                            yield
                        continue
                    self._resume = (number, pos, chain, self._h, self._tail, len(hashes), self.tokens)
                first = len(hashes)
                before = self.tokens
                ready: list[bytes] = []  # ids of fine pieces not absorbed yet
                f = pos
                while f < end:
                    e = cut(text, f, fine) if fine < end - f else end
                    if e > end:
                        e = end
                    ids = cached(text, f, e)
                    if ids is None:
                        if ready:
                            if self._absorb(b"".join(ready)):
                                return
                            ready = []
                        self._at = (number, f)
                        yield  # the caller may stop here, before paying for tokenization
                        ids = encode(text, f, e)
                    ready.append(ids)
                    f = e
                if ready and self._absorb(b"".join(ready)):
                    return
                if key is not None and memo is not None:
                    memo.put(key, array("Q", hashes[first:]), self._tail, self.tokens - before)
                chain = key
                pos = end
                if self.pace:
                    self._at = (number, pos)
                    yield
