"""What a prompt is made of: *segments*, and the interfaces of what produces and tokenizes them.

A prompt is a list of segments: arrays of token ids (used as they are), and `TextSegment` s
that a `PieceCodec` (the tokenizer) cuts into pieces and tokenizes on demand. A
`PromptTokenizer` turns a request into its segments. Token ids travel as little-endian
unsigned 64-bit integers (`token_bytes`), the bytes block hashes are computed over (see
`kvroute_tokenizer_prefix.blocks`).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Protocol

from kvroute.errors import InvalidRequest
from kvroute.request import RouteRequest

__all__ = [
    "PieceCodec",
    "PromptTokenizer",
    "Segment",
    "TextSegment",
    "chunk_ids",
    "first_difference",
    "ids_from_bytes",
    "iter_pieces",
    "prompt_ids",
    "segment_ids",
    "token_array",
    "token_bytes",
]

_BIG_ENDIAN = sys.byteorder == "big"
_MAX_TOKEN_ID = (1 << 64) - 1


def token_array(ids: Sequence[int] | array[int]) -> array[int]:
    """Ids as an unsigned 64-bit array; raises `InvalidRequest` for ids outside 0..2**64-1."""
    try:
        return array("Q", ids)
    except (OverflowError, TypeError):
        bad = next(
            (t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= _MAX_TOKEN_ID), None
        )
        raise InvalidRequest(
            f"token ids must be integers between 0 and 2**64-1 (got {bad!r}).", param="prompt"
        ) from None


def token_bytes(ids: array[int]) -> bytes:
    """The little-endian bytes that block hashes are computed over (the same on every machine)."""
    if _BIG_ENDIAN:  # pragma: no cover - no big-endian CI machine
        ids = array("Q", ids)
        ids.byteswap()
    return ids.tobytes()


def ids_from_bytes(data: bytes) -> array[int]:
    """The inverse of `token_bytes`."""
    ids = array("Q")
    ids.frombytes(data)
    if _BIG_ENDIAN:  # pragma: no cover - no big-endian CI machine
        ids.byteswap()
    return ids


class PieceCodec(Protocol):
    """How a tokenizer cuts text into pieces and tokenizes them, for `PromptBlocks`.

    Cutting a text at any offset ``cut`` returns, tokenizing the pieces one by one must give
    exactly the ids of tokenizing the whole text (the tokenizer checks this for itself).
    """

    #: Least size of a memoized piece (the unit a prefix seen before is skipped by).
    piece_bytes: int
    #: Least size of a piece tokenized on its own (the unit of tokenization work).
    fine_bytes: int

    def cut(self, data: bytes, start: int, size: int) -> int:
        """The end of the piece that starts at ``start``: a boundary at or after ``start + size``, else
        ``len(data)``."""
        ...

    def encode(self, data: bytes, start: int, end: int) -> bytes:
        """The ids of ``data[start:end]`` as little-endian unsigned 64-bit integers (see `token_bytes`)."""
        ...

    def cached(self, data: bytes, start: int, end: int) -> bytes | None:
        """The ids of ``data[start:end]`` if they are at hand without tokenizing, else ``None``."""
        ...


class TextSegment:
    """UTF-8 text that ``codec`` tokenizes piece by piece."""

    __slots__ = ("codec", "data")

    def __init__(self, data: bytes, codec: PieceCodec) -> None:
        self.data = data
        self.codec = codec

    def __repr__(self) -> str:
        return f"TextSegment({len(self.data)} bytes)"


#: What a prompt is made of: token ids as they are, or text to tokenize.
Segment = "array[int] | TextSegment"


def _common_bytes(a: bytes, b: bytes) -> int:
    """Length of the common prefix of ``a`` and ``b`` (compared 4 KiB at a time, then bisected)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + 4096] == b[i : i + 4096]:
        i += 4096
    lo, hi = i, min(i + 4096, n)
    while lo < hi:  # a[:lo] == b[:lo]; they differ before hi (or hi == n)
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def first_difference(
    a: Sequence[array[int] | TextSegment], b: Sequence[array[int] | TextSegment]
) -> tuple[int, int] | None:
    """The first (segment, byte offset) at which two prompts' segments differ (ids count 8 bytes each).

    When one prompt is a prefix of the other, that is where the shorter one ends. ``None``
    when bytes cannot tell: a text segment against ids, or one segment a strict prefix of the
    other while its prompt goes on (the same tokens may follow in another form).
    """
    for i in range(min(len(a), len(b))):
        x, y = a[i], b[i]
        if isinstance(x, TextSegment) and isinstance(y, TextSegment):
            if x.data == y.data:
                continue
            xb, yb = x.data, y.data
        elif isinstance(x, TextSegment) or isinstance(y, TextSegment):
            return None
        elif x == y:
            continue
        else:
            xb, yb = token_bytes(x), token_bytes(y)
        common = _common_bytes(xb, yb)
        if (common == len(xb) and i + 1 < len(a)) or (common == len(yb) and i + 1 < len(b)):
            return None
        return i, common
    return min(len(a), len(b)), 0


def iter_pieces(codec: PieceCodec, data: bytes, start: int = 0) -> Iterator[tuple[int, int, int]]:
    """The fine pieces of ``data`` from ``start`` (a piece boundary) as ``(start, end, piece end)``.

    Exactly the cuts `PromptBlocks` makes: pieces of ``piece_bytes``, each cut into fine
    pieces of ``fine_bytes`` (the last one ends where its piece ends).
    """
    n = len(data)
    cut = codec.cut
    coarse, fine = codec.piece_bytes, codec.fine_bytes
    pos = start
    while pos < n:
        end = cut(data, pos, coarse)
        f = pos
        while f < end:
            e = cut(data, f, fine) if fine < end - f else end
            if e > end:
                e = end
            yield f, e, end
            f = e
        pos = end


def chunk_ids(chunk: Sequence[int] | array[int]) -> array[int]:
    """The ids of a chunk yielded by ``chunks`` / ``text_chunks`` (kept for callers of the old API)."""
    return chunk if isinstance(chunk, array) else array("Q", chunk)


def segment_ids(segment: array[int] | TextSegment) -> array[int]:
    """All ids of one segment (text tokenized piece by piece, through its codec's cache)."""
    if not isinstance(segment, TextSegment):
        return segment
    data, codec = segment.data, segment.codec
    return ids_from_bytes(b"".join(codec.encode(data, s, e) for s, e, _ in iter_pieces(codec, data)))


class PromptTokenizer(Protocol):
    """What the strategy needs: a request's prompt as segments, tokenized lazily."""

    #: A short description for decision details and logs (``model:/path``, ``words``).
    name: str
    #: When a prompt is sent, at most this many bytes left to hash are hashed at once instead of kept pending.
    inline_bytes: int

    def segments(self, request: RouteRequest) -> list[array[int] | TextSegment]:
        """The prompt's segments in order: token ids, or text the segment's codec tokenizes."""
        ...

    def prompt_ids(self, request: RouteRequest) -> list[int]:
        """All prompt ids at once (parity checks, tests)."""
        ...


def prompt_ids(tokenizer: PromptTokenizer, request: RouteRequest) -> list[int]:
    """All prompt ids of ``request`` as one list (tests, parity checks)."""
    out: list[int] = []
    for segment in tokenizer.segments(request):
        out.extend(segment_ids(segment))
    return out
