"""The router's tokenizers: the model's own (``tokenizers`` + chat template), or a word-level fallback.

Both turn a `kvroute.RouteRequest` into the *segments* of its prompt the way the engine
would tokenize it (see `kvroute_tokenizer_prefix.blocks`): token id arrays, and
`TextSegment` s that they cut and tokenize piece by piece on demand, so that a caller who
only needs the first blocks stops early:

* ``token_ids`` sent by the client (completions with a token prompt) are used as they are;
* chat ``messages`` are rendered with the model's chat template and tokenized without adding
  special tokens (the template writes them), as vLLM's chat endpoint does;
* a completions text prompt is tokenized with special tokens (a Llama tokenizer's BOS), as
  vLLM's completions endpoint does.

`ModelTokenizer` reuses work across requests: text is cut where the tokenizer's
pre-tokenizer always splits (see `split_points`), each piece is tokenized on its own and its
ids are cached by the piece's hash. Tokenizing the pieces one by one gives exactly the ids of
tokenizing the whole text: this is checked when the tokenizer is loaded (a self-test on probe
texts) and by the test suite; a tokenizer whose normalizer or pre-tokenizer could make a piece
depend on its neighbours (SentencePiece ``Prepend``, ``add_prefix_space``...) is tokenized
whole instead. `ModelTokenizer.warm` tokenizes many pieces per call to the library (which
releases the GIL meanwhile), for the strategy's background prefetch.

This module holds `ModelTokenizer` and `load_tokenizer`; the word-level fallback is in
`kvroute_tokenizer_prefix.words`, finding model files in `kvroute_tokenizer_prefix.model_files`,
where text may be cut in `kvroute_tokenizer_prefix.boundaries`, and the segment types and the
`PromptTokenizer` interface in `kvroute_tokenizer_prefix.segments` (all importable from here too).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from kvroute.errors import ConfigError, InvalidRequest
from kvroute.logs import get_logger
from kvroute.request import RouteRequest
from kvroute_tokenizer_prefix.blocks import TextSegment, ids_from_bytes, iter_pieces, token_array, token_bytes
from kvroute_tokenizer_prefix.boundaries import (
    BOUNDARY,
    cut_is_safe,
    next_cut,
    pieces_independent,
    probe_texts,
    split_points,
)
from kvroute_tokenizer_prefix.chat import ChatTemplate, ContentFormat, select_template
from kvroute_tokenizer_prefix.model_files import read_json, resolve_model_files, special_tokens
from kvroute_tokenizer_prefix.segments import PromptTokenizer, chunk_ids, prompt_ids, segment_ids
from kvroute_tokenizer_prefix.words import WordTokenizer

__all__ = [
    "ModelTokenizer",
    "PromptTokenizer",
    "WordTokenizer",
    "chunk_ids",
    "load_tokenizer",
    "prompt_ids",
    "resolve_model_files",
    "segment_ids",
    "split_points",
    "token_array",
]

log = get_logger(__name__)

_BOUNDARY_SEARCH = BOUNDARY.search

#: Fine pieces tokenized per call to the ``tokenizers`` library by `ModelTokenizer.warm`.
_PREFETCH_BATCH = 32


class ModelTokenizer:
    """A model's tokenizer (``tokenizer.json``) and chat template, with piece-wise reuse.

    ``inline_bytes`` is 0: what a prompt has left to hash when it is sent is kept pending (and
    prefetched in the background), never tokenized under the router's lock.

    Build it with :func:`load_tokenizer`. Text is cut into pieces of at least ``piece_bytes``
    (what the block hasher memoizes), each cut into fine pieces of at least ``fine_bytes``
    (what is tokenized at a time); ``cache_tokens`` bounds the cache of fine pieces' ids.
    It is a `kvroute_tokenizer_prefix.blocks.PieceCodec`.
    """

    inline_bytes = 0

    def __init__(
        self,
        tokenizer: Any,
        *,
        name: str,
        chat_template: ChatTemplate | None = None,
        piece_bytes: int = 2048,
        fine_bytes: int = 128,
        cache_tokens: int = 1 << 19,
        self_check: bool = True,
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.piece_bytes = piece_bytes
        self.fine_bytes = min(fine_bytes, piece_bytes)
        self.cache_tokens = cache_tokens
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cached_tokens = 0
        self._lock = threading.Lock()
        #: Fine pieces found in the cache / tokenized by `encode`; ``prefetched``: tokenized by `warm`.
        self.hits = 0
        self.misses = 0
        self.prefetched = 0
        config = json.loads(tokenizer.to_str())
        added = config.get("added_tokens") or []
        stripping = [t["content"] for t in added if isinstance(t, Mapping) and (t.get("lstrip") or t.get("rstrip"))]
        self._unsafe = (
            re.compile(b"|".join(re.escape(t.encode("utf-8")) for t in sorted(stripping, key=len, reverse=True)))
            if stripping
            else None
        )
        with_bos = tokenizer.encode("a", add_special_tokens=True).ids
        plain = tokenizer.encode("a", add_special_tokens=False).ids
        at = next((i for i in range(len(with_bos) - len(plain) + 1) if with_bos[i : i + len(plain)] == plain), 0)
        #: Ids the post-processor adds around a single sequence (e.g. Llama's BOS).
        self.prefix_ids: tuple[int, ...] = tuple(with_bos[:at])
        self.suffix_ids: tuple[int, ...] = tuple(with_bos[at + len(plain) :])
        ok, why = pieces_independent(config)
        #: Whether pieces are tokenized (and cached) separately; otherwise the prompt is tokenized whole.
        self.splittable = ok
        if ok and self_check:
            extra = [t["content"] for t in added if isinstance(t, Mapping) and isinstance(t.get("content"), str)]
            ok, why = self._self_check(extra[:32])
            self.splittable = ok
        if not ok:
            log.warning("tokenizer_pieces_disabled", tokenizer=name, reason=why)

    # -- PieceCodec ----------------------------------------------------------------------

    def cut(self, data: bytes, start: int, size: int) -> int:
        """The end of the piece from ``start``: the first safe boundary at or after ``start + size``."""
        n = len(data)
        pos = start + size
        if pos >= n or not self.splittable:
            return n
        m = _BOUNDARY_SEARCH(data, pos)
        if m is None:
            return n
        unsafe = self._unsafe
        if unsafe is None or cut_is_safe(data, m.start(), unsafe):
            return m.start()
        return next_cut(data, m.start() + 1, 0, unsafe)

    def cached(self, data: bytes, start: int, end: int) -> bytes | None:
        """The cached ids of ``data[start:end]`` (a piece between two cuts), or ``None``."""
        key = xxhash.xxh3_64_intdigest(data[start:end])
        cache = self._cache
        found = cache.get(key)  # atomic under the GIL; the prefetch thread may evict concurrently
        if found is not None:
            with contextlib.suppress(KeyError):
                cache.move_to_end(key)
            self.hits += 1
        return found

    def encode(self, data: bytes, start: int, end: int) -> bytes:
        """The ids of ``data[start:end]`` (a piece between two cuts), from the cache or the tokenizer."""
        found = self.cached(data, start, end)
        if found is not None:
            return found
        piece = data[start:end]
        key = xxhash.xxh3_64_intdigest(piece)
        ids = self._tokenize([piece])[0]
        with self._lock:
            self.misses += 1
            self._store(key, ids)
        return ids

    def _tokenize(self, pieces: list[bytes]) -> list[bytes]:
        try:
            texts = [p.decode("utf-8") for p in pieces]
            encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        except UnicodeDecodeError:
            raise InvalidRequest(
                "the prompt is not valid Unicode text (lone surrogate characters).", param="messages"
            ) from None
        return [token_bytes(array("Q", e.ids)) for e in encodings]

    def _store(self, key: int, ids: bytes) -> None:
        """Cache a piece's ids (the caller holds the lock)."""
        cache = self._cache
        if key in cache:
            return
        cache[key] = ids
        self._cached_tokens += len(ids) >> 3
        while self._cached_tokens > self.cache_tokens and cache:
            _, old = cache.popitem(last=False)
            self._cached_tokens -= len(old) >> 3

    # -- prefetching ---------------------------------------------------------------------

    def warm(self, data: bytes, start: int = 0, max_tokens: int = 1 << 62) -> int:
        """Tokenize and cache the fine pieces of ``data`` from ``start`` (a piece boundary), many per call;
        returns ids seen.

        Thread-safe; used by the strategy's prefetch thread. Stops after about ``max_tokens`` ids.
        """
        tokens = 0
        batch: list[tuple[int, bytes]] = []
        for s, e, _ in iter_pieces(self, data, start):
            piece = data[s:e]
            key = xxhash.xxh3_64_intdigest(piece)
            with self._lock:
                found = self._cache.get(key)
                if found is not None:
                    self._cache.move_to_end(key)
            if found is not None:
                tokens += len(found) >> 3
            else:
                batch.append((key, piece))
                if len(batch) >= _PREFETCH_BATCH:
                    tokens += self._warm_batch(batch)
                    batch = []
            if tokens >= max_tokens:
                break
        if batch:
            tokens += self._warm_batch(batch)
        return tokens

    def _warm_batch(self, batch: list[tuple[int, bytes]]) -> int:
        try:
            ids = self._tokenize([piece for _, piece in batch])
        except InvalidRequest:
            return 0
        with self._lock:
            for (key, _), piece_ids in zip(batch, ids, strict=True):
                self._store(key, piece_ids)
            self.prefetched += len(batch)
        return sum(len(i) >> 3 for i in ids)

    # -- whole texts and requests ----------------------------------------------------------

    def encode_text(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The reference: the whole text through ``tokenizers`` (no pieces, no cache)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def text_segments(self, text: str, *, add_special_tokens: bool) -> list[array[int] | TextSegment]:
        """The segments of one text: special ids the post-processor adds, and the text itself."""
        out: list[array[int] | TextSegment] = []
        if add_special_tokens and self.prefix_ids:
            out.append(array("Q", self.prefix_ids))
        if text:
            out.append(TextSegment(text.encode("utf-8", "surrogatepass"), self))
        if add_special_tokens and self.suffix_ids:
            out.append(array("Q", self.suffix_ids))
        return out

    def text_chunks(self, text: str, *, add_special_tokens: bool) -> Iterator[array[int]]:
        """Yield the ids of ``text`` fine piece by fine piece (equal, concatenated, to encoding it whole)."""
        for segment in self.text_segments(text, add_special_tokens=add_special_tokens):
            if isinstance(segment, TextSegment):
                data = segment.data
                for s, e, _ in iter_pieces(self, data):
                    yield ids_from_bytes(self.encode(data, s, e))
            else:
                yield segment

    def render(self, request: RouteRequest) -> str:
        """The chat prompt text of a chat request, as the engine renders it."""
        if self.chat_template is None:
            raise InvalidRequest(
                f"the tokenizer {self.name!r} has no chat template, so chat messages cannot be tokenized "
                "(set the strategy's 'chat_template' option).",
                param="messages",
            )
        assert request.messages is not None
        args = dict(request.prompt_options or {})
        kwargs = args.pop("chat_template_kwargs", None) or {}
        if not isinstance(kwargs, Mapping):
            raise InvalidRequest(
                f"'chat_template_kwargs' must be an object (got {type(kwargs).__name__}).", param="chat_template_kwargs"
            )
        return self.chat_template.render(
            request.messages,
            tools=args.get("tools"),
            documents=args.get("documents"),
            add_generation_prompt=bool(args.get("add_generation_prompt", True)),
            continue_final_message=bool(args.get("continue_final_message", False)),
            **kwargs,
        )

    def segments(self, request: RouteRequest) -> list[array[int] | TextSegment]:
        if request.token_ids is not None:
            return [token_array(request.token_ids)]
        if request.messages is not None:
            options = request.prompt_options or {}
            return self.text_segments(
                self.render(request), add_special_tokens=bool(options.get("add_special_tokens", False))
            )
        return self.text_segments(request.text, add_special_tokens=True)

    def prompt_ids(self, request: RouteRequest) -> list[int]:
        return prompt_ids(self, request)

    def chunks(self, request: RouteRequest) -> Iterator[array[int]]:
        """The prompt's ids, one array per segment (the parity check's interface)."""
        for segment in self.segments(request):
            yield segment_ids(segment)

    # -- checks --------------------------------------------------------------------------

    def _self_check(self, extra: Sequence[str]) -> tuple[bool, str]:
        rng = random.Random(0x6B76)
        try:
            for text in probe_texts(extra, rng):
                whole = self.encode_text(text)
                data = text.encode("utf-8", "surrogatepass")
                pieces: list[int] = []
                start = 0
                for end in split_points(data, 1, self._unsafe):  # cut at every boundary
                    pieces.extend(ids_from_bytes(self._tokenize([data[start:end]])[0]))
                    start = end
                if pieces != whole:
                    return False, f"piece-wise tokenization differs from whole-text tokenization on {text!r:.80}"
        except InvalidRequest as exc:
            return False, f"a probe text could not be tokenized: {exc}"
        return True, ""

    @property
    def cached_tokens(self) -> int:
        """Token ids held by the piece cache (8 bytes each, plus about 170 bytes per piece)."""
        return self._cached_tokens


def load_tokenizer(
    source: str | os.PathLike[str],
    *,
    chat_template: str | None = None,
    content_format: ContentFormat | str = "auto",
    piece_bytes: int = 2048,
    fine_bytes: int = 128,
    cache_tokens: int = 1 << 19,
    revision: str | None = None,
) -> ModelTokenizer:
    """Load a model's tokenizer and chat template from local files (no network).

    ``source`` is a ``tokenizer.json`` path, a model directory, or a Hub id found in the local
    Hugging Face cache. ``chat_template`` overrides the model's template: a file path or the
    template text itself.
    """
    from tokenizers import Tokenizer

    files = resolve_model_files(source, revision=revision)
    try:
        tok = Tokenizer.from_file(str(files["tokenizer.json"]))
    except Exception as exc:  # tokenizers raises its own Exception subclass
        raise ConfigError(f"cannot load {str(files['tokenizer.json'])!r} with the tokenizers library: {exc}") from None
    config = read_json(files.get("tokenizer_config.json"))
    special = special_tokens(config, read_json(files.get("special_tokens_map.json")))
    template_text: str | None
    tool_text: str | None = None
    if chat_template is not None:
        candidate = Path(chat_template).expanduser()
        template_text = (
            candidate.read_text(encoding="utf-8") if "{" not in chat_template and candidate.is_file() else chat_template
        )
    elif "chat_template.jinja" in files:
        template_text = files["chat_template.jinja"].read_text(encoding="utf-8")
    else:
        raw = config.get("chat_template")
        template_text = select_template(raw, with_tools=False)
        if isinstance(raw, list):
            tool_text = select_template(raw, with_tools=True)
            tool_text = None if tool_text == template_text else tool_text
    if content_format not in ("auto", "string", "openai"):
        raise ConfigError(f"'content_format' must be one of auto, string, openai (got {content_format!r}).")
    template = (
        ChatTemplate(template_text, special, content_format=content_format, tool_source=tool_text)
        if template_text
        else None
    )
    return ModelTokenizer(
        tok,
        name=str(source),
        chat_template=template,
        piece_bytes=piece_bytes,
        fine_bytes=fine_bytes,
        cache_tokens=cache_tokens,
    )
