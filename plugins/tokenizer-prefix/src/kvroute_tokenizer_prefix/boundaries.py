"""Where a model's text may be cut into pieces that tokenize on their own exactly as within the whole text.

`split_points` cuts at boundaries every pre-tokenizer this package accepts splits at
(`BOUNDARY`), away from added tokens that strip whitespace; `pieces_independent` tells from a
``tokenizer.json`` whether its normalizer and pre-tokenizer keep pieces independent, and
`probe_texts` are the texts `ModelTokenizer` checks that claim on when it is loaded.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["BOUNDARY", "cut_is_safe", "next_cut", "pieces_independent", "probe_texts", "split_points"]

# Where a piece may end (a zero-width match), on the UTF-8 bytes of the text:
#   before a space that sits between an ASCII letter/digit and an ASCII letter ("abc| def"), or
#   after a newline that follows a visible ASCII character and precedes an ASCII letter/digit ("x.\n|Abc").
# Byte-level BPE regexes (GPT-2, Llama 3, Qwen) and whitespace/metaspace splitters all split there,
# and the text on either side cannot join into one pre-token. Non-ASCII neighbours never make a
# boundary (Unicode whitespace such as U+00A0 would change how the regexes group spaces).
BOUNDARY = re.compile(rb"(?<=[A-Za-z0-9])(?= [A-Za-z])|(?<=[!-~]\n)(?=[A-Za-z0-9])")

# Normalizers that act on one character at a time, so that cutting the text between two
# characters cannot change either side.
_LOCAL_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents"}


def split_points(data: bytes, piece_bytes: int, unsafe: re.Pattern[bytes] | None = None) -> Iterator[int]:
    """Yield the end offsets of the pieces ``data`` is cut into (the last one is ``len(data)``).

    A piece is at least ``piece_bytes`` long unless it is the last one and ends at the first
    boundary after that; cuts depend only on the bytes before them (and the next two), so two
    texts that share a prefix are cut the same way up to where they differ.
    """
    n = len(data)
    start = 0
    while start < n:
        start = next_cut(data, start, piece_bytes, unsafe)
        yield start


def next_cut(data: bytes, start: int, size: int, unsafe: re.Pattern[bytes] | None) -> int:
    """The first safe boundary at or after ``start + size``, else ``len(data)``."""
    n = len(data)
    pos = start + size
    search = BOUNDARY.search
    while pos < n:
        m = search(data, pos)
        if m is None:
            break
        cut = m.start()
        if unsafe is None or cut_is_safe(data, cut, unsafe):
            return cut
        pos = cut + 1
    return n


def cut_is_safe(data: bytes, cut: int, unsafe: re.Pattern[bytes]) -> bool:
    """No added token that strips whitespace touches the cut (it would swallow the space or newline)."""
    for m in unsafe.finditer(data, max(0, cut - 256), min(len(data), cut + 256)):
        if m.start() <= cut + 1 and m.end() >= cut:
            return False
    return True


def pieces_independent(config: Mapping[str, Any]) -> tuple[bool, str]:
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


def probe_texts(extra: Sequence[str], rng: random.Random, count: int = 160) -> list[str]:
    """``count`` random texts of tricky fragments (and ``extra``, the model's added tokens) for the self-check."""
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
