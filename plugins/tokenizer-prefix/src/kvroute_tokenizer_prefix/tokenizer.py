"""The router's tokenizers: the model's own (``tokenizers`` + chat template), or a word-level fallback.

Both turn a `kvroute.RouteRequest` into its prompt token ids the way the engine would, as a
lazy stream of chunks (`array.array` of unsigned 64-bit ids), so that a caller that only
needs the first blocks stops early:

* ``token_ids`` sent by the client (completions with a token prompt) are used as they are;
* chat ``messages`` are rendered with the model's chat template and tokenized without adding
  special tokens (the template writes them), as vLLM's chat endpoint does;
* a completions text prompt is tokenized with special tokens (a Llama tokenizer's BOS), as
  vLLM's completions endpoint does.

`ModelTokenizer` reuses work across requests: text is cut into pieces that end on
boundaries where the tokenizer's pre-tokenizer always splits (see `split_points`), each
piece is tokenized on its own and its ids are cached by the piece's hash. Tokenizing the
pieces one by one gives exactly the ids of tokenizing the whole text: this is checked when
the tokenizer is loaded (a self-test on probe texts) and by the test suite; a tokenizer
whose normalizer or pre-tokenizer could make a piece depend on its neighbours (SentencePiece
``Prepend``, ``add_prefix_space``...) is tokenized whole instead, without reuse.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import structlog
import xxhash

from kvroute.errors import ConfigError, InvalidRequest
from kvroute.request import RouteRequest
from kvroute_tokenizer_prefix.chat import ChatTemplate, ContentFormat, select_template

__all__ = [
    "ModelTokenizer",
    "PromptTokenizer",
    "WordTokenizer",
    "chunk_ids",
    "load_tokenizer",
    "resolve_model_files",
    "split_points",
    "token_array",
]

log = structlog.get_logger(__name__)

_BIG_ENDIAN = sys.byteorder == "big"
_MAX_TOKEN_ID = (1 << 64) - 1

# Where a piece may end (a zero-width match), on the UTF-8 bytes of the text:
#   before a space that sits between an ASCII letter/digit and an ASCII letter ("abc| def"), or
#   after a newline that follows a visible ASCII character and precedes an ASCII letter/digit ("x.\n|Abc").
# Byte-level BPE regexes (GPT-2, Llama 3, Qwen) and whitespace/metaspace splitters all split there,
# and the text on either side cannot join into one pre-token. Non-ASCII neighbours never make a
# boundary (Unicode whitespace such as U+00A0 would change how the regexes group spaces).
_BOUNDARY = re.compile(rb"(?<=[A-Za-z0-9])(?= [A-Za-z])|(?<=[!-~]\n)(?=[A-Za-z0-9])")

# Normalizers that act on one character at a time, so that cutting the text between two
# characters cannot change either side.
_LOCAL_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents"}


def token_array(ids: Sequence[int] | array[int]) -> array[int]:
    """Ids as an unsigned 64-bit array; raises `InvalidRequest` for ids outside 0..2**64-1."""
    try:
        return array("Q", ids)
    except (OverflowError, TypeError):
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= _MAX_TOKEN_ID), None)
        raise InvalidRequest(
            f"token ids must be integers between 0 and 2**64-1 (got {bad!r}).", param="prompt"
        ) from None


def token_bytes(ids: array[int]) -> bytes:
    """The little-endian bytes that block hashes are computed over (the same on every machine)."""
    if _BIG_ENDIAN:  # pragma: no cover - no big-endian CI machine
        ids = array("Q", ids)
        ids.byteswap()
    return ids.tobytes()


#: A chunk whose ids are computed on demand: ``(stable 64-bit key of its text, loader)``.
Keyed = tuple[int, Callable[[], "array[int]"]]


def chunk_ids(chunk: array[int] | Keyed) -> array[int]:
    """The ids of a chunk, loading a keyed piece."""
    return chunk[1]() if isinstance(chunk, tuple) else chunk


class PromptTokenizer(Protocol):
    """What the strategy needs: a request's prompt ids, lazily, in chunks."""

    #: A short description for decision details and logs (``model:/path``, ``words``).
    name: str

    def chunks(self, request: RouteRequest) -> Iterator[array[int] | Keyed]:
        """Yield the prompt's token ids in order, in chunks of any size (ids, or keyed pieces)."""
        ...


def prompt_ids(tokenizer: PromptTokenizer, request: RouteRequest) -> list[int]:
    """All prompt ids of ``request`` as one list (tests, parity checks)."""
    out: list[int] = []
    for chunk in tokenizer.chunks(request):
        out.extend(chunk_ids(chunk))
    return out


# -- word-level fallback ---------------------------------------------------------------


class WordTokenizer:
    """The simulator's word-level vocabulary (`kvroute.simulation.tokens`): no model files needed.

    Text splits on whitespace, one token per word; chat renders each message as its role
    marker, its words and an end marker, then the assistant marker. In ``kvroute simulate`` it
    gives exactly the simulated engines' token ids; in front of a real engine it is only a
    proxy for the model's tokens (configure ``tokenizer``).
    """

    name = "words"

    def __init__(self) -> None:
        from kvroute.simulation.tokens import vocabulary

        self._vocab = vocabulary()

    def chunks(self, request: RouteRequest) -> Iterator[array[int] | Keyed]:
        if request.token_ids is not None:
            yield token_array(request.token_ids)
        elif request.messages is not None:
            # One keyed chunk per message, so that a history seen before is a memo hit, not re-tokenized.
            for message in request.messages:
                if not isinstance(message, Mapping):
                    raise InvalidRequest(f"a message must be an object (got {type(message).__name__}).", param="messages")
                role, content = str(message.get("role", "")), message.get("content")
                try:
                    text = self._vocab.content_text(content)
                except ValueError as exc:
                    raise InvalidRequest(f"cannot tokenize the messages: {exc}", param="messages") from None
                key = xxhash.xxh3_64_intdigest(f"{role}\0{text}".encode("utf-8", "surrogatepass"))
                yield key, functools.partial(self._message, role, text)
            options = request.prompt_options or {}
            if options.get("add_generation_prompt", True):
                yield array("Q", self._vocab.render_chat([], add_generation_prompt=True))
        else:
            yield token_array(self._vocab.encode(request.text))

    def _message(self, role: str, text: str) -> array[int]:
        return token_array(self._vocab.render_message(role, text))


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
    boundary after that; cuts depend only on the bytes before them, so two texts that share a
    prefix are cut the same way up to where they differ.
    """
    n = len(data)
    start = 0
    search = _BOUNDARY.search
    while start < n:
        pos = start + piece_bytes
        end = n
        while pos < n:
            m = search(data, pos)
            if m is None:
                break
            cut = m.start()
            if unsafe is None or _cut_is_safe(data, cut, unsafe):
                end = cut
                break
            pos = cut + 1
        yield end
        start = end


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
        "a", "Hello", "world", "the", "s", "x1", "42", "2024", "007", " ", "  ", "\n", "\n\n", " \n", "\t", "\r\n",
        ".", ",", "!?", "'s", "'t", "(", ")", "-", "_", ":", "\"", "#", "```", "é", "Ünïcødé", "中文", "\u00a0",
        "\u3000", "😀", "a\u0301", "don't", "I'm", "x.\n", "\nItem", " word", "1,234.5",
    ]
    fragments.extend(extra)
    texts = []
    for _ in range(count):
        texts.append("".join(rng.choice(fragments) for _ in range(rng.randint(1, 40))))
    return texts


class ModelTokenizer:
    """A model's tokenizer (``tokenizer.json``) and chat template, with piece-wise reuse.

    Build it with :func:`load_tokenizer`. ``piece_bytes`` is the least size of a cached piece
    and ``cache_tokens`` bounds the piece cache (ids are stored as 8-byte integers).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        name: str,
        chat_template: ChatTemplate | None = None,
        piece_bytes: int = 512,
        cache_tokens: int = 1 << 21,
        self_check: bool = True,
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.piece_bytes = piece_bytes
        self.cache_tokens = cache_tokens
        self._cache: OrderedDict[int, array[int]] = OrderedDict()
        self._cached_tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
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
        if ok and self_check:
            extra = [t["content"] for t in added if isinstance(t, Mapping) and isinstance(t.get("content"), str)]
            ok, why = self._self_check(extra[:32])
        #: Whether pieces are tokenized (and cached) separately; otherwise the prompt is tokenized whole.
        self.splittable = ok
        if not ok:
            log.warning("tokenizer_pieces_disabled", tokenizer=name, reason=why)

    # -- encoding ------------------------------------------------------------------------

    def encode_text(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The reference: the whole text through ``tokenizers`` (no pieces, no cache)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    @staticmethod
    def keyed(piece: bytes, encode: Callable[[bytes, int], array[int]]) -> Keyed:
        """A piece as ``(key, loader)``: consumers that memoize by key only call ``loader`` on a miss."""
        key = xxhash.xxh3_64_intdigest(piece)
        return key, functools.partial(encode, piece, key)

    def _encode_piece(self, piece: bytes, key: int | None = None) -> array[int]:
        if key is None:
            key = xxhash.xxh3_64_intdigest(piece)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return found
        ids = token_array(self.tokenizer.encode_batch_fast([piece.decode("utf-8")], add_special_tokens=False)[0].ids)
        with self._lock:
            self.misses += 1
            if key not in self._cache:
                self._cache[key] = ids
                self._cached_tokens += len(ids)
                while self._cached_tokens > self.cache_tokens and self._cache:
                    _, old = self._cache.popitem(last=False)
                    self._cached_tokens -= len(old)
        return ids

    def text_chunks(self, text: str, *, add_special_tokens: bool) -> Iterator[array[int] | Keyed]:
        """Yield the ids of ``text`` piece by piece (equal, concatenated, to encoding it whole)."""
        if add_special_tokens and self.prefix_ids:
            yield array("Q", self.prefix_ids)
        if not self.splittable:
            yield token_array(self.encode_text(text))
        elif text:
            data = text.encode("utf-8", "surrogatepass")
            start = 0
            encode = self._encode_piece
            for end in split_points(data, self.piece_bytes, self._unsafe):
                yield self.keyed(data[start:end], encode)
                start = end
        if add_special_tokens and self.suffix_ids:
            yield array("Q", self.suffix_ids)

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
            raise InvalidRequest(f"'chat_template_kwargs' must be an object (got {type(kwargs).__name__}).", param="chat_template_kwargs")
        return self.chat_template.render(
            request.messages,
            tools=args.get("tools"),
            documents=args.get("documents"),
            add_generation_prompt=bool(args.get("add_generation_prompt", True)),
            continue_final_message=bool(args.get("continue_final_message", False)),
            **kwargs,
        )

    def chunks(self, request: RouteRequest) -> Iterator[array[int] | Keyed]:
        if request.token_ids is not None:
            yield token_array(request.token_ids)
        elif request.messages is not None:
            options = request.prompt_options or {}
            yield from self.text_chunks(self.render(request), add_special_tokens=bool(options.get("add_special_tokens", False)))
        else:
            yield from self.text_chunks(request.text, add_special_tokens=True)

    # -- checks --------------------------------------------------------------------------

    def _self_check(self, extra: Sequence[str]) -> tuple[bool, str]:
        rng = random.Random(0x6B76)
        saved = self.piece_bytes
        self.piece_bytes = 1  # cut at every boundary
        self.splittable = True
        try:
            for text in _probe_texts(extra, rng):
                whole = self.encode_text(text)
                pieces = [t for chunk in self.text_chunks(text, add_special_tokens=False) for t in chunk_ids(chunk)]
                if pieces != whole:
                    return False, f"piece-wise tokenization differs from whole-text tokenization on {text!r:.80}"
        finally:
            self.piece_bytes = saved
            self._cache.clear()
            self._cached_tokens = 0
            self.hits = self.misses = 0
        return True, ""

    @property
    def cached_tokens(self) -> int:
        """Token ids held by the piece cache (8 bytes each, plus about 90 bytes per piece)."""
        return self._cached_tokens


def load_tokenizer(
    source: str | os.PathLike[str],
    *,
    chat_template: str | None = None,
    content_format: ContentFormat | str = "auto",
    piece_bytes: int = 512,
    cache_tokens: int = 1 << 21,
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
        template_text = candidate.read_text(encoding="utf-8") if "{" not in chat_template and candidate.is_file() else chat_template
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
    return ModelTokenizer(tok, name=str(source), chat_template=template, piece_bytes=piece_bytes, cache_tokens=cache_tokens)
