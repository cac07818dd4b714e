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
from typing import Any, Protocol, cast

import xxhash

from kvroute.errors import ConfigError, InvalidRequest
from kvroute.logs import get_logger
from kvroute.request import RouteRequest
from kvroute_tokenizer_prefix.blocks import TextSegment, ids_from_bytes, iter_pieces, token_array, token_bytes
from kvroute_tokenizer_prefix.chat import ChatTemplate, ContentFormat, select_template

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

# Where a piece may end (a zero-width match), on the UTF-8 bytes of the text:
#   before a space that sits between an ASCII letter/digit and an ASCII letter ("abc| def"), or
#   after a newline that follows a visible ASCII character and precedes an ASCII letter/digit ("x.\n|Abc").
# Byte-level BPE regexes (GPT-2, Llama 3, Qwen) and whitespace/metaspace splitters all split there,
# and the text on either side cannot join into one pre-token. Non-ASCII neighbours never make a
# boundary (Unicode whitespace such as U+00A0 would change how the regexes group spaces).
_BOUNDARY = re.compile(rb"(?<=[A-Za-z0-9])(?= [A-Za-z])|(?<=[!-~]\n)(?=[A-Za-z0-9])")
_BOUNDARY_SEARCH = _BOUNDARY.search

# The word-level fallback splits on whitespace: cutting right before an ASCII whitespace byte
# never joins or splits a word.
_SPACE = re.compile(rb"[ \t\n\r\x0b\x0c]")

# Normalizers that act on one character at a time, so that cutting the text between two
# characters cannot change either side.
_LOCAL_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents"}

#: Fine pieces tokenized per call to the ``tokenizers`` library by `ModelTokenizer.warm`.
_PREFETCH_BATCH = 32


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


# -- word-level fallback ---------------------------------------------------------------


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


# -- model files -----------------------------------------------------------------------

_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def resolve_model_files(source: str | os.PathLike[str], *, revision: str | None = None) -> dict[str, Path]:
    """Find a model's tokenizer files: a ``tokenizer.json`` path, a directory, or a Hub id in the local cache.

    Never touches the network: a Hub id (``org/name``) is looked up in the local Hugging Face
    cache only. Returns the files found by name; ``tokenizer.json`` is required.
    """
    path = Path(source).expanduser()
    found: dict[str, Path] = {}
    if path.is_file():
        found["tokenizer.json"] = path
        folder = path.parent
        for name in _FILES[1:]:
            if (folder / name).is_file():
                found[name] = folder / name
    elif path.is_dir():
        for name in _FILES:
            if (path / name).is_file():
                found[name] = path / name
        if "tokenizer.json" not in found:
            raise ConfigError(
                f"'tokenizer': the directory {str(path)!r} has no tokenizer.json (a fast tokenizer is required; "
                "save one with transformers' save_pretrained or the tokenizers library)."
            )
    else:
        text = str(source)
        if text.count("/") != 1 or text.startswith(("/", ".", "~")):
            raise ConfigError(
                f"'tokenizer' must be a tokenizer.json file, a model directory or a Hub model id in the local cache "
                f"(got {text!r}, which does not exist)."
            )
        from huggingface_hub import try_to_load_from_cache

        for name in _FILES:
            hit = try_to_load_from_cache(text, name, revision=revision)
            if isinstance(hit, str):
                found[name] = Path(hit)
        if "tokenizer.json" not in found:
            raise ConfigError(
                f"'tokenizer': model {text!r} has no tokenizer.json in the local Hugging Face cache "
                "(kvroute never downloads: fetch it once with `huggingface-cli download` or point to a directory)."
            )
    return found


def _token_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens(config: Mapping[str, Any], special_map: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        text = _token_text(config.get(key))
        if text is None:
            text = _token_text(special_map.get(key))
        if text is not None:
            out[key] = text
    return out


def _read_json(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {str(path)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{str(path)!r} must hold a JSON object (got {type(data).__name__}).")
    return data


# -- the model's tokenizer ---------------------------------------------------------------


def split_points(data: bytes, piece_bytes: int, unsafe: re.Pattern[bytes] | None = None) -> Iterator[int]:
    """Yield the end offsets of the pieces ``data`` is cut into (the last one is ``len(data)``).

    A piece is at least ``piece_bytes`` long unless it is the last one and ends at the first
    boundary after that; cuts depend only on the bytes before them (and the next two), so two
    texts that share a prefix are cut the same way up to where they differ.
    """
    n = len(data)
    start = 0
    while start < n:
        start = _cut(data, start, piece_bytes, unsafe)
        yield start


def _cut(data: bytes, start: int, size: int, unsafe: re.Pattern[bytes] | None) -> int:
    n = len(data)
    pos = start + size
    search = _BOUNDARY.search
    while pos < n:
        m = search(data, pos)
        if m is None:
            break
        cut = m.start()
        if unsafe is None or _cut_is_safe(data, cut, unsafe):
            return cut
        pos = cut + 1
    return n


def _cut_is_safe(data: bytes, cut: int, unsafe: re.Pattern[bytes]) -> bool:
    """No added token that strips whitespace touches the cut (it would swallow the space or newline)."""
    for m in unsafe.finditer(data, max(0, cut - 256), min(len(data), cut + 256)):
        if m.start() <= cut + 1 and m.end() >= cut:
            return False
    return True


def _splittable(config: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether tokenizing pieces separately can equal tokenizing the whole text, from tokenizer.json."""

    def parts(node: Any) -> list[Mapping[str, Any]]:
        if not isinstance(node, Mapping):
            return []
        if node.get("type") == "Sequence":
            inner = node.get("normalizers") or node.get("pretokenizers") or []
            return [p for sub in inner for p in parts(sub)]
        return [node]

    for norm in parts(config.get("normalizer")):
        kind = norm.get("type")
        if kind == "Replace":
            pattern = norm.get("pattern", {})
            literal = pattern.get("String") if isinstance(pattern, Mapping) else None
            if isinstance(literal, str) and len(literal) == 1 and literal not in "\n ":
                continue
        if kind not in _LOCAL_NORMALIZERS:
            return False, f"normalizer {kind} may act across pieces"
    pre = parts(config.get("pre_tokenizer"))
    if not pre:
        return False, "no pre-tokenizer: the model sees the whole text as one word"
    for node in pre:
        kind = node.get("type")
        if kind == "ByteLevel" and node.get("add_prefix_space"):
            return False, "ByteLevel add_prefix_space adds a space to every piece"
        if kind == "Metaspace" and (node.get("prepend_scheme", "always") != "never" or node.get("add_prefix_space")):
            return False, "Metaspace prepends a marker to every piece"
    return True, ""


def _probe_texts(extra: Sequence[str], rng: random.Random, count: int = 160) -> list[str]:
    fragments = [
        "a",
        "Hello",
        "world",
        "the",
        "s",
        "x1",
        "42",
        "2024",
        "007",
        " ",
        "  ",
        "\n",
        "\n\n",
        " \n",
        "\t",
        "\r\n",
        ".",
        ",",
        "!?",
        "'s",
        "'t",
        "(",
        ")",
        "-",
        "_",
        ":",
        '"',
        "#",
        "```",
        "é",
        "Ünïcødé",
        "中文",
        "\u00a0",
        "\u3000",
        "😀",
        "a\u0301",
        "don't",
        "I'm",
        "x.\n",
        "\nItem",
        " word",
        "1,234.5",
    ]
    fragments.extend(extra)
    texts = []
    for _ in range(count):
        texts.append("".join(rng.choice(fragments) for _ in range(rng.randint(1, 40))))
    return texts


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
        ok, why = _splittable(config)
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
        if unsafe is None or _cut_is_safe(data, m.start(), unsafe):
            return m.start()
        return _cut(data, m.start() + 1, 0, unsafe)

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
            for text in _probe_texts(extra, rng):
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
    config = _read_json(files.get("tokenizer_config.json"))
    special = _special_tokens(config, _read_json(files.get("special_tokens_map.json")))
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
