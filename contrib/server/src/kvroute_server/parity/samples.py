"""The built-in samples `kvroute check-parity` compares: completion prompts and chat conversations."""

from __future__ import annotations

import random
from typing import Any

__all__ = ["sample_chats", "sample_prompts"]

_WORDS = (
    "the",
    "router",
    "cache",
    "block",
    "prefix",
    "engine",
    "token",
    "model",
    "request",
    "latency",
    "of",
    "and",
    "to",
    "in",
    "is",
    "a",
    "for",
    "with",
    "on",
    "that",
    "by",
    "this",
    "we",
    "are",
    "from",
    "Hello",
    "world",
    "GPU",
    "KV",
    "vLLM",
    "Überprüfung",
    "naïve",
    "café",
    "東京",
    "数据",
    "😀",
    "x86_64",
    "3.14159",
    "1,234",
    "(a)",
    "[b]",
    "{c}",
    "don't",
    "it's",
    "e.g.",
    "--flag",
    "#include",
    "<tag>",
    "ß",
    "Ωmega",
)


def _long_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(words):
        out.append(rng.choice(_WORDS))
        r = rng.random()
        if r < 0.06:
            out.append(".\n" if rng.random() < 0.5 else ".\n\n")
        elif r < 0.12:
            out.append(",")
    text = ""
    for piece in out:
        text += piece if piece in (",", ".\n", ".\n\n") or text.endswith("\n") or not text else " " + piece
    return text.strip() + "."


def sample_prompts() -> list[tuple[str, str]]:
    """Built-in completion prompts ``(name, text)``: ASCII, code, Unicode, whitespace, and a long one."""
    return [
        ("hello", "Hello world"),
        ("code", "def square(x):\n    return x ** 2  # a comment\n\nprint(square(12))\n"),
        ("unicode", "Grüße aus Köln — 東京の天気は晴れ 😀 café naïve façade"),
        ("whitespace", "  leading spaces, 3.14159 and 1,234,567\ttabs\n\nnew paragraph\n   indented\r\nCRLF"),
        ("long", _long_text(7, 1400)),
    ]


def sample_chats() -> list[tuple[str, list[dict[str, Any]]]]:
    """Built-in chat conversations ``(name, messages)``: one turn, system prompt, multi-turn, content parts, long."""
    return [
        ("chat-hello", [{"role": "user", "content": "Hello world"}]),
        (
            "chat-system",
            [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is a KV cache?"}],
        ),
        (
            "chat-turns",
            [
                {"role": "user", "content": "Name a prime."},
                {"role": "assistant", "content": "7"},
                {"role": "user", "content": "Another one, please."},
            ],
        ),
        ("chat-parts", [{"role": "user", "content": [{"type": "text", "text": "Hello from a content part."}]}]),
        ("chat-long", [{"role": "user", "content": _long_text(11, 1200)}]),
    ]
