"""The word-level fallback tokenizer: one token per whitespace-separated word, no model files needed."""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import cast

import xxhash

from kvroute.errors import InvalidRequest
from kvroute.request import RouteRequest
from kvroute_tokenizer_prefix.segments import TextSegment, prompt_ids, segment_ids, token_array, token_bytes

__all__ = ["WordTokenizer"]

# The word-level fallback splits on whitespace: cutting right before an ASCII whitespace byte
# never joins or splits a word.
_SPACE = re.compile(rb"[ \t\n\r\x0b\x0c]")


class WordTokenizer:
    """The word-level vocabulary (`kvroute.vocabulary`, shared with the simulator): no model files needed.

    Text splits on whitespace, one token per word; chat renders each message as its role
    marker, its words and an end marker, then the assistant marker. In ``kvroute simulate`` it
    gives exactly the simulated engines' token ids; in front of a real engine it is only a
    proxy for the model's tokens (configure ``tokenizer``). Long texts are cut into pieces at
    whitespace, so that a message seen before is skipped a piece at a time and a message that
    differs from one seen before only near its end costs that end.
    """

    name = "words"
    #: A prompt with at most this many bytes left to hash when it is sent is hashed at once
    #: (looking words up is cheap) rather than kept as a pending tail.
    inline_bytes = 4096

    def __init__(self, piece_bytes: int = 8192, fine_bytes: int = 1024, cache_pieces: int = 4096) -> None:
        from kvroute.vocabulary import ASSISTANT, END, vocabulary

        self._vocab = vocabulary()
        self._lookup = self._vocab.index.get
        self._end = END
        self._assistant = ASSISTANT
        self.piece_bytes = piece_bytes
        self.fine_bytes = fine_bytes
        self.cache_pieces = cache_pieces
        # The ids of recent fine pieces: a pending prompt and the request extending it walk the
        # same pieces in step, and a long message seen again is not looked up word by word.
        self._cache: OrderedDict[int, bytes] = OrderedDict()

    # -- PieceCodec ----------------------------------------------------------------------

    def cut(self, data: bytes, start: int, size: int) -> int:
        """The first ASCII whitespace at or after ``start + size``, else the end."""
        n = len(data)
        pos = start + size
        if pos >= n:
            return n
        m = _SPACE.search(data, pos)
        return m.start() if m is not None else n

    def encode(self, data: bytes, start: int, end: int) -> bytes:
        """The word ids of ``data[start:end]``."""
        piece = data[start:end]
        key = xxhash.xxh3_64_intdigest(piece)
        found = self._cache.get(key)
        if found is not None:
            return found
        words = piece.decode("utf-8", "surrogatepass").split()
        looked: list[int | None] = list(map(self._lookup, words))  # Vocabulary.encode's ids, looked up at C speed
        if None in looked:
            token_id = self._vocab.token_id
            looked = [t if t is not None else token_id(w) for t, w in zip(looked, words, strict=True)]
        ids = token_bytes(array("Q", cast("list[int]", looked)))
        self._cache[key] = ids
        if len(self._cache) > self.cache_pieces:
            self._cache.popitem(last=False)
        return ids

    def cached(self, data: bytes, start: int, end: int) -> bytes | None:
        """The ids of ``data[start:end]`` if they were looked up recently."""
        return self._cache.get(xxhash.xxh3_64_intdigest(data[start:end]))

    # -- PromptTokenizer -------------------------------------------------------------------

    def segments(self, request: RouteRequest) -> list[array[int] | TextSegment]:
        if request.token_ids is not None:
            return [token_array(request.token_ids)]
        if request.messages is None:
            return [TextSegment(request.text.encode("utf-8", "surrogatepass"), self)]
        # The chat as one text of words: a role marker word, the content, the end marker, ...
        # Marker words map to the marker ids, so its words are exactly `render_chat`'s ids,
        # and one text is memoized a piece at a time across message boundaries.
        vocab = self._vocab
        words = vocab.words
        out: list[array[int] | TextSegment] = []
        parts: list[str] = []
        for message in request.messages:
            if not isinstance(message, Mapping):
                raise InvalidRequest(f"a message must be an object (got {type(message).__name__}).", param="messages")
            try:
                text = vocab.content_text(message.get("content"))
            except ValueError as exc:
                raise InvalidRequest(f"cannot tokenize the messages: {exc}", param="messages") from None
            role = vocab.role_id(str(message.get("role", "")))
            marker = words[role] if role < len(words) else None
            if marker is None:  # a role without a marker word (its id is a hash of its name): as an id
                if parts:
                    out.append(TextSegment(" ".join(parts).encode("utf-8", "surrogatepass"), self))
                    parts = []
                out.append(array("Q", [role]))
            else:
                parts.append(marker)
            parts.append(text)
            parts.append(words[self._end])
        options = request.prompt_options or {}
        if options.get("add_generation_prompt", True):
            parts.append(words[self._assistant])
        if parts:
            out.append(TextSegment(" ".join(parts).encode("utf-8", "surrogatepass"), self))
        return out

    def prompt_ids(self, request: RouteRequest) -> list[int]:
        return prompt_ids(self, request)

    def chunks(self, request: RouteRequest) -> Iterator[array[int]]:
        """The prompt's ids, one array per segment (the parity check's interface)."""
        for segment in self.segments(request):
            yield segment_ids(segment)
