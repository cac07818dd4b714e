"""A word-level vocabulary: token ids for text without a model's tokenizer.

Text is whitespace-separated words and a token is one word. The vocabulary holds ``size``
entries: a few reserved markers (``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|tool|>``,
``<|developer|>``, ``<|end|>``), then pronounceable words built from consonant-vowel syllables,
enumerated in a fixed order, so it is the same on every machine. A word outside it gets a
stable id above ``size`` from a 64-bit hash of the word. A chat renders as, per message, the
role marker, the content's words and ``<|end|>``, then ``<|assistant|>``.

Two parts of kvroute share it: the simulator (its workloads are made of these words, its
engine model counts them as tokens) and tokenizer-prefix's fallback tokenizer, which then
gives exactly the simulated engines' token ids. It lives in the library so that neither
depends on the other.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from kvroute.hashing import hash64

__all__ = [
    "ASSISTANT",
    "DEVELOPER",
    "END",
    "SYSTEM",
    "TOOL",
    "USER",
    "Vocabulary",
    "vocabulary",
]

#: Reserved marker tokens (ids 0..7; 6 and 7 are spare).
SYSTEM, USER, ASSISTANT, TOOL, DEVELOPER, END = 0, 1, 2, 3, 4, 5
_MARKERS = (
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|developer|>",
    "<|end|>",
    "<|spare6|>",
    "<|spare7|>",
)
_ROLE_IDS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL, "developer": DEVELOPER}

_CONSONANTS = "bdfghjklmnprstvwz"
_VOWELS = "aeiou"


def _words() -> Iterator[str]:
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    for length in itertools.count(2):
        for parts in itertools.product(syllables, repeat=length):
            yield "".join(parts)


@attrs.frozen
class Vocabulary:
    """A fixed word-level vocabulary: reserved markers, then generated words.

    Build it with :meth:`generated` (or use :func:`vocabulary` for the shared default).
    """

    words: tuple[str, ...]
    index: Mapping[str, int] = attrs.field(eq=False, repr=False)

    #: First id of a generated word; ids below are reserved markers.
    FIRST_WORD = len(_MARKERS)

    @classmethod
    def generated(cls, size: int = 32_000) -> Vocabulary:
        """Return the vocabulary of ``size`` entries (markers included)."""
        if size <= cls.FIRST_WORD:
            raise ValueError(f"'size' must be greater than {cls.FIRST_WORD} (got {size}).")
        words = _MARKERS + tuple(itertools.islice(_words(), size - len(_MARKERS)))
        return cls(words, {w: i for i, w in enumerate(words)})

    @property
    def size(self) -> int:
        """Number of entries, markers included."""
        return len(self.words)

    def word_ids(self) -> range:
        """The ids of generated words (what random content is drawn from)."""
        return range(self.FIRST_WORD, len(self.words))

    def decode(self, ids: Iterable[int]) -> str:
        """Return the text of ``ids``: their words joined by single spaces."""
        return " ".join(map(self.words.__getitem__, ids))

    def token_id(self, word: str) -> int:
        """Return the id of one whitespace-free word (stable ids above ``size`` for unknown words)."""
        found = self.index.get(word)
        if found is not None:
            return found
        return self.size + hash64(word) % (1 << 40)

    def encode(self, text: str) -> tuple[int, ...]:
        """Return the ids of the whitespace-separated words of ``text``."""
        get = self.index.get
        out = []
        for word in text.split():
            found = get(word)
            out.append(found if found is not None else self.token_id(word))
        return tuple(out)

    def role_id(self, role: str) -> int:
        """Return the marker id of a chat role (a stable id for roles this vocabulary does not reserve)."""
        found = _ROLE_IDS.get(role)
        return found if found is not None else self.token_id(f"<|{role}|>")

    def content_text(self, content: object) -> str:
        """Return the text of an OpenAI message content: a string or a list of text parts."""
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "".join(
                str(part.get("text", ""))
                for part in content
                if isinstance(part, Mapping) and part.get("type") == "text"
            )
        raise ValueError(f"message content must be a string or a list of parts (got {type(content).__name__}).")

    def render_message(self, role: str, content: object) -> tuple[int, ...]:
        """Return one message's tokens: role marker, content, ``<|end|>``."""
        return (self.role_id(role), *self.encode(self.content_text(content)), END)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> tuple[int, ...]:
        """Return the prompt tokens of a chat: every message rendered, then ``<|assistant|>``."""
        out: list[int] = []
        for message in messages:
            out.extend(self.render_message(str(message.get("role", "")), message.get("content")))
        if add_generation_prompt:
            out.append(ASSISTANT)
        return tuple(out)


@functools.cache
def vocabulary(size: int = 32_000) -> Vocabulary:
    """Return the shared vocabulary of ``size`` entries (built once per process)."""
    return Vocabulary.generated(size)
