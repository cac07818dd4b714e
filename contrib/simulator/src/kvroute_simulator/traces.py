"""Trace replay for the fleet simulator: a JSONL file of requests as a workload (``trace``).

Two line formats: the Mooncake format (``timestamp`` in ms, ``input_length``,
``output_length``, ``hash_ids`` of 512-token blocks, equal ids meaning equal content) and a
simple format with ``prompt`` or ``messages``, ``timestamp`` (ms) and ``output_length``. A
line that is in neither raises :class:`TraceFormatError`, naming the file, the line, what was
expected and what was got.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

import attrs

from kvroute.errors import ConfigError, KvrouteError
from kvroute.validators import expect, integer, optional, positive_integer, positive_number
from kvroute_simulator._content import draw_words, is_int, is_number, seeded_rng
from kvroute_simulator.arrivals import DEFAULT_MODEL, Arrival
from kvroute_simulator.tokens import TokenSeq, Vocabulary, vocabulary

__all__ = ["Trace", "TraceFormatError"]


class TraceFormatError(KvrouteError, ValueError):
    """A trace file line is not in a supported format; the message names the file, line, expectation and value."""


TraceFormat = Literal["auto", "mooncake", "simple"]
#: The values of Trace.format.
_FORMATS: tuple[TraceFormat, ...] = ("auto", "mooncake", "simple")


def _shown(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@attrs.frozen(kw_only=True)
class Trace:
    """Replay of a JSONL trace (Mooncake or simple format, see the module docstring).

    Parameters: ``path``; ``format`` (``auto`` picks per line: ``hash_ids`` or
    ``input_length`` means Mooncake, ``prompt`` or ``messages`` means simple);
    ``block_tokens`` (tokens per Mooncake hash id, 512); ``time_scale`` (multiplies the
    time between arrivals: 0.5 replays twice as fast); ``requests``/``duration`` (optional
    cut-offs); ``seed`` (the generated content of each hash id); ``model``;
    ``cache_blocks`` (how many generated hash-id blocks to keep for reuse).

    Times are relative to the first line's timestamp and must not decrease. Hash id ``h``
    stands for the same ``block_tokens`` generated words wherever it appears; a last block
    shorter than ``block_tokens`` (``input_length`` not a multiple) uses the first words of
    that block; tokens not covered by ``hash_ids`` are unique to the request.
    """

    name: ClassVar[str] = "trace"

    path: Path = attrs.field(converter=Path)
    format: TraceFormat = attrs.field(
        default="auto", validator=expect("auto, mooncake or simple", attrs.validators.in_(_FORMATS))
    )
    block_tokens: int = attrs.field(default=512, validator=positive_integer)
    time_scale: float = attrs.field(default=1.0, validator=positive_number)
    requests: int | None = attrs.field(default=None, validator=optional(positive_integer))
    duration: float | None = attrs.field(default=None, validator=optional(positive_number))
    seed: int = attrs.field(default=0, validator=integer)
    model: str = DEFAULT_MODEL
    cache_blocks: int = attrs.field(default=65_536, validator=positive_integer)

    def arrivals(self) -> Iterator[Arrival]:
        """Return a new iterator over the trace's requests; raises :class:`TraceFormatError` on a bad line."""
        if not self.path.is_file():
            raise ConfigError(f"'path' must be an existing trace file (got {str(self.path)!r}).")
        vocab = vocabulary()
        state = _MooncakeState(self, vocab)
        first: float | None = None
        last = -math.inf
        emitted = 0
        try:
            lines = self.path.open("rb")
        except OSError as exc:
            raise ConfigError(
                f"'path' must be a readable trace file (got {str(self.path)!r}: {exc.strerror})."
            ) from None
        with lines:
            for lineno, raw in enumerate(lines, 1):
                where = f"{self.path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise TraceFormatError(
                        f"{where}: expected UTF-8 text (got byte 0x{raw[exc.start]:02x} at byte {exc.start + 1})."
                    ) from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceFormatError(
                        f"{where}: expected a JSON object (got invalid JSON at column {exc.colno}: {exc.msg})."
                    ) from None
                if not isinstance(record, dict):
                    raise TraceFormatError(f"{where}: expected a JSON object (got {type(record).__name__}).")
                stamp = record.get("timestamp")
                if not is_number(stamp) or stamp < 0:
                    raise TraceFormatError(
                        f"{where}: 'timestamp' must be a number of milliseconds >= 0 (got {_shown(stamp)})."
                    )
                if stamp < last:
                    raise TraceFormatError(
                        f"{where}: 'timestamp' must not decrease (got {_shown(stamp)} after {_shown(last)})."
                    )
                last = stamp
                if first is None:
                    first = stamp
                t = (stamp - first) / 1000.0 * self.time_scale
                if (self.requests is not None and emitted >= self.requests) or (
                    self.duration is not None and t > self.duration
                ):
                    return
                kind = self._kind(record, where)
                request_id = f"{self.name}-{lineno:06d}"
                if kind == "mooncake":
                    yield state.arrival(record, where, t, request_id, lineno)
                else:
                    yield self._simple(vocab, record, where, t, request_id)
                emitted += 1

    def _kind(self, record: dict[str, Any], where: str) -> Literal["mooncake", "simple"]:
        if self.format != "auto":
            return self.format
        if "hash_ids" in record or "input_length" in record:
            return "mooncake"
        if "prompt" in record or "messages" in record:
            return "simple"
        raise TraceFormatError(
            f"{where}: expected Mooncake fields (input_length, output_length, hash_ids) or 'prompt'/'messages' "
            f"(got keys {sorted(record)})."
        )

    def _simple(self, vocab: Vocabulary, record: dict[str, Any], where: str, t: float, request_id: str) -> Arrival:
        output_len = _output_length(record, where)
        salt = record.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise TraceFormatError(f"{where}: 'cache_salt' must be a string (got {_shown(salt)}).")
        model = record.get("model", self.model)
        if not isinstance(model, str):
            raise TraceFormatError(f"{where}: 'model' must be a string (got {_shown(model)}).")
        body: dict[str, Any] = {"model": model, "max_tokens": output_len}
        if salt is not None:
            body["cache_salt"] = salt
        if "messages" in record:
            messages = record["messages"]
            if not isinstance(messages, list) or not messages:
                raise TraceFormatError(f"{where}: 'messages' must be a non-empty list (got {_shown(messages)}).")
            for i, message in enumerate(messages):
                if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                    raise TraceFormatError(
                        f"{where}: 'messages[{i}]' must be an object with a string 'role' (got {_shown(message)})."
                    )
                content = message.get("content")
                if not (content is None or isinstance(content, str | list)):
                    raise TraceFormatError(
                        f"{where}: 'messages[{i}].content' must be a string or a list of parts (got {_shown(content)})."
                    )
            ids = vocab.render_chat(messages)
            body["messages"] = messages
        else:
            prompt = record.get("prompt")
            if not isinstance(prompt, str) or not prompt.strip():
                raise TraceFormatError(f"{where}: 'prompt' must be a non-empty string (got {_shown(prompt)}).")
            ids = vocab.encode(prompt)
            body["prompt"] = prompt
        return Arrival(
            time=t, request_id=request_id, body=body, prompt=TokenSeq.of(ids), output_len=output_len, extra_key=salt
        )


def _output_length(record: dict[str, Any], where: str) -> int:
    value = record.get("output_length")
    if not is_int(value) or value < 1:
        raise TraceFormatError(f"{where}: 'output_length' must be an integer >= 1 (got {_shown(value)}).")
    return int(value)


class _MooncakeState:
    """Shared content of a Mooncake replay: generated blocks per hash id and the trie of prefixes."""

    def __init__(self, trace: Trace, vocab: Vocabulary) -> None:
        self.trace = trace
        self.vocab = vocab
        self.blocks: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.nodes: OrderedDict[tuple[TokenSeq | None, int, int], TokenSeq] = OrderedDict()

    def _lru(self, table: OrderedDict[Any, Any], key: Any, make: Callable[[], Any]) -> Any:
        found = table.get(key)
        if found is not None:
            table.move_to_end(key)
            return found
        found = table[key] = make()
        if len(table) > self.trace.cache_blocks:
            table.popitem(last=False)
        return found

    def _block(self, hash_id: int) -> tuple[int, ...]:
        size, seed = self.trace.block_tokens, self.trace.seed
        return self._lru(  # type: ignore[no-any-return]
            self.blocks, hash_id, lambda: draw_words(seeded_rng(seed, "trace", "block", hash_id), self.vocab, size)
        )

    def arrival(self, record: dict[str, Any], where: str, t: float, request_id: str, lineno: int) -> Arrival:
        size = self.trace.block_tokens
        length = record.get("input_length")
        if not is_int(length) or length < 1:
            raise TraceFormatError(f"{where}: 'input_length' must be an integer >= 1 (got {_shown(length)}).")
        output_len = _output_length(record, where)
        hash_ids = record.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(is_int(h) for h in hash_ids):
            raise TraceFormatError(f"{where}: 'hash_ids' must be a list of integers (got {_shown(hash_ids)}).")
        blocks = -(-length // size)
        if len(hash_ids) > blocks:
            raise TraceFormatError(
                f"{where}: 'hash_ids' must hold at most ceil(input_length / {size}) = {blocks} ids "
                f"for input_length={length} (got {len(hash_ids)})."
            )
        node: TokenSeq | None = None
        for i, hash_id in enumerate(hash_ids):
            take = min(size, length - i * size)
            parent = node

            def make(parent: TokenSeq | None = parent, hash_id: int = hash_id, take: int = take) -> TokenSeq:
                return TokenSeq(parent, self._block(hash_id)[:take])

            node = self._lru(self.nodes, (parent, hash_id, take), make)
        covered = min(length, len(hash_ids) * size)
        if covered < length:
            unique = draw_words(seeded_rng(self.trace.seed, "trace", "line", lineno), self.vocab, length - covered)
            node = TokenSeq(node, unique)
        assert node is not None
        text = self.vocab.decode(node.to_tuple())
        body = {"model": self.trace.model, "prompt": text, "max_tokens": output_len}
        return Arrival(time=t, request_id=request_id, body=body, prompt=node, output_len=output_len)
