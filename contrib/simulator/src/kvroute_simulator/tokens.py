"""Token ids for the simulator: a word-level vocabulary and shared token sequences.

The simulator never loads a real tokenizer. Text is made of generated words joined by
whitespace and a token is one word, so token ids and text always agree:

* :class:`Vocabulary` holds ``size`` entries: a few reserved markers (``<|system|>``,
  ``<|user|>``, ``<|assistant|>``, ``<|tool|>``, ``<|developer|>``, ``<|end|>``) and then
  pronounceable words built from consonant-vowel syllables (``bada``, ``bade``, ...),
  enumerated in a fixed order, so the vocabulary is the same on every machine.
* ``encode(text)`` splits on whitespace and maps each word to its index. A word that is
  not in the vocabulary (a user's own trace) gets a stable id above ``size`` derived from
  a 64-bit hash of the word, so equal words always give equal ids.
* A chat conversation renders as, for each message, the role marker, the content's
  tokens and ``<|end|>``; then ``<|assistant|>`` (the generation prompt). Turn N's prompt
  plus its answer (the answer's tokens and ``<|end|>``) is therefore a prefix of turn
  N+1's prompt, as with real chat templates.

:class:`TokenSeq` stores a prompt as a chain of shared pieces (a parent sequence and a
tail), so thousands of requests sharing an 8,000-token prefix hold one copy of it, and
the prefix's chained block hashes are computed once for all of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import attrs

from kvroute.hashing import hash64
from kvroute.vocabulary import ASSISTANT, END, SYSTEM, TOOL, USER, Vocabulary, vocabulary

__all__ = [
    "ASSISTANT",
    "END",
    "ROOT_HASH",
    "SYSTEM",
    "TOOL",
    "USER",
    "TokenSeq",
    "Vocabulary",
    "root_hash",
    "vocabulary",
]

#: Parent hash of a sequence's first block when the request has no extra key.
ROOT_HASH = 0x6B76_726F_7574_6530  # "kvroute0"


def root_hash(extra_key: str | None) -> int:
    """Return the parent hash of the first block: a stable hash of the extra key (LoRA, cache_salt)."""
    return ROOT_HASH if extra_key is None else hash64(extra_key, seed=ROOT_HASH & 0xFFFF_FFFF)


# Chain memo: (hashes of the blocks completed inside this node, last hash, tokens left over).
_Chain = tuple[tuple[int, ...], int, tuple[int, ...]]


@attrs.define(eq=False)
class TokenSeq:
    """A token sequence stored as ``parent`` + ``tail``, so that prefixes are shared objects.

    Block hashes are chained like vLLM's: block i's hash is ``hash((hash of block i-1, its
    block_size token ids))``, block 0's parent being :func:`root_hash` of the extra key. Only
    full blocks get a hash. Each node memoizes the hashes of the blocks that end inside it,
    so a prefix shared by many requests is hashed once. Build with :meth:`of` or
    :meth:`extend`; treat a node as immutable.
    """

    parent: TokenSeq | None
    tail: tuple[int, ...]
    length: int = attrs.field(init=False)
    _memo: dict[tuple[int, int], _Chain] = attrs.field(init=False, factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        self.length = (self.parent.length if self.parent is not None else 0) + len(self.tail)

    @classmethod
    def of(cls, tokens: Iterable[int]) -> TokenSeq:
        """Return a root sequence holding ``tokens``."""
        return cls(None, tuple(tokens))

    def extend(self, tail: Iterable[int]) -> TokenSeq:
        """Return a new sequence: this one followed by ``tail`` (this one is shared, not copied)."""
        return TokenSeq(self, tuple(tail))

    def __len__(self) -> int:
        return self.length

    def nodes(self) -> list[TokenSeq]:
        """Return the chain of nodes from the root to this one."""
        chain: list[TokenSeq] = []
        node: TokenSeq | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        chain.reverse()
        return chain

    def to_tuple(self) -> tuple[int, ...]:
        """Return all token ids as one flat tuple (a copy: for tests and small prompts)."""
        return tuple(itertools.chain.from_iterable(node.tail for node in self.nodes()))

    def _chain(self, block_size: int, root: int) -> _Chain:
        key = (block_size, root)
        found = self._memo.get(key)
        if found is not None:
            return found
        # Walk up to the nearest memoized ancestor, then hash forward (no recursion).
        pending: list[TokenSeq] = []
        node: TokenSeq | None = self
        prev = root
        left: tuple[int, ...] = ()
        while node is not None:
            memo = node._memo.get(key)
            if memo is not None:
                _, prev, left = memo
                break
            pending.append(node)
            node = node.parent
        result: _Chain = ((), prev, left)
        for node in reversed(pending):
            buf = left + node.tail if left else node.tail
            full = len(buf) // block_size
            own = []
            h = prev
            for i in range(0, full * block_size, block_size):
                h = hash((h, buf[i : i + block_size]))
                own.append(h)
            left = buf[full * block_size :]
            prev = h
            result = (tuple(own), h, left)
            node._memo[key] = result
        return result

    def block_hashes(self, block_size: int, root: int = ROOT_HASH) -> list[int]:
        """Return the chained hashes of every full block, in order (a new list)."""
        self._chain(block_size, root)
        out: list[int] = []
        key = (block_size, root)
        for node in self.nodes():
            out.extend(node._memo[key][0])
        return out

    def text(self, vocab: Vocabulary | None = None) -> str:
        """Return the text of this sequence (markers included) with the default vocabulary."""
        return (vocab or vocabulary()).decode(self.to_tuple())
