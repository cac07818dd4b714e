"""A fleet cache view: which prompt-prefix blocks each backend probably holds, whatever the strategy.

Strategies keep their own indexes, shaped by how they decide; this view is kept apart from any
of them so that every strategy (the live one and its shadows, see `kvroute.shadow`) is scored
against the same yardstick: "if the request goes to backend B, how many of its prompt tokens
would B find in its prefix cache?"

It is approximate. It records where requests were sent, never what the engine reports (KV events
are not read), and it does not tokenize like the engine: a prompt is cut into *units* standing in
for tokens, either

* ``chars`` (default): every ``chars_per_token`` characters of the routing text are one unit (about
  four characters per token for English text and BPE tokenizers), or
* ``words``: each ``<|marker|>`` and each whitespace-separated word is one unit (the emulator's and
  the simulator's word-level tokenizer), or
* the prompt's token ids when the request came as token ids.

Units are grouped in blocks of ``block_size``; block *i*'s hash chains block *i-1*'s
(xxh3 seeded with the parent's hash), block 0 being seeded by the model, LoRA adapter and
``cache_salt``, so a block hash stands for the whole prefix up to it, as in vLLM. Only full blocks
count, at most ``(units - 1) // block_size`` of them (an engine always computes the last token).

Each backend holds an LRU set of block hashes bounded by its capacity: the engine's own when its
adapter reports it (``EngineLoad.kv_tokens``), else
``capacity_tokens``. A prompt's blocks are recorded last block first, so the first block is the
most recent: a backend then never holds a block without its parent (eviction takes the oldest),
and the matched length is found by bisection, a few lookups per backend.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable
from typing import Literal

import attrs
import xxhash

from kvroute.backend import BackendState
from kvroute.hashing import hash_parts
from kvroute.request import RouteRequest

__all__ = ["DEFAULT_CAPACITY_TOKENS", "CacheView", "PromptBlocks", "Reuse", "Units"]

#: Units a prompt is cut into (see the module docstring).
Units = Literal["chars", "words"]

#: Cache size assumed for a backend whose adapter does not report one: 1M tokens (vLLM on one
#: 80 GB GPU with an 8B model holds about that much).
DEFAULT_CAPACITY_TOKENS = 1 << 20

_xxh3 = xxhash.xxh3_64_intdigest
#: Key prefix of the block hashes in a request's memo (`RouteRequest.memo`).
_MEMO = "kvroute-cache-view/1"
_WORD = re.compile(r"<\|.*?\|>|[^\s<]+|<")


@attrs.frozen
class PromptBlocks:
    """A prompt's chained block hashes (``hashes[i]`` stands for the prefix up to block i) and its length in units."""

    hashes: tuple[int, ...]
    units: int


@attrs.frozen
class Reuse:
    """Predicted prefix reuse of one decision, in units (tokens, approximately).

    ``chosen``: what the chosen backend holds; ``best``: the most any candidate held
    ("reusable anywhere"); ``prompt``: the prompt's length.
    """

    chosen: int
    best: int
    prompt: int


class CacheView:
    """Per backend, an LRU set of prefix block hashes, fed by where requests were sent.

    Not thread-safe: the caller serializes (the proxy's event loop, or the fleet's lock).
    """

    def __init__(
        self,
        *,
        block_size: int = 16,
        capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
        units: Units = "chars",
        chars_per_token: int = 4,
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("capacity_tokens", capacity_tokens),
            ("chars_per_token", chars_per_token),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"'{name}' must be a positive integer (got {value!r}).")
        if units not in ("chars", "words"):
            raise ValueError(f"'units' must be 'chars' or 'words' (got {units!r}).")
        self.block_size = block_size
        self.capacity_tokens = capacity_tokens
        self.units: Units = units
        self.chars_per_token = chars_per_token
        self._held: dict[str, OrderedDict[int, None]] = {}
        #: Block 0's seed per (model, LoRA adapter, cache salt): hashed once, not per request.
        self._seeds: dict[tuple[str | None, str | None, str | None], int] = {}

    # -- prompts -------------------------------------------------------------------------

    def blocks(self, request: RouteRequest) -> PromptBlocks:
        """The request's chained block hashes (full blocks only) and its length in units.

        Kept in the request's memo (`RouteRequest.memo`) under how they were cut, so every view
        cutting the same way (the SLO choice's in a dry run and then for the lease, a shadow view)
        hashes a request's prompt once.
        """
        memo = request.memo
        cut = (_MEMO, self.units, self.block_size, self.chars_per_token)  # views that cut alike share the blocks
        kept = memo.get(cut)
        if kept is not None:
            return kept  # type: ignore[no-any-return]
        where = (request.model, request.lora, request.cache_salt)
        seed = self._seeds.get(where)
        if seed is None:
            if len(self._seeds) >= 1024:
                self._seeds.clear()
            seed = self._seeds[where] = hash_parts(_MEMO, *where)
        size = self.block_size
        hashes: list[int] = []
        append = hashes.append
        h = seed
        if request.token_ids is not None:
            ids = request.token_ids
            count = len(ids)
            for i in range(0, (count - 1) // size * size, size):
                h = _xxh3(b",".join(b"%d" % t for t in ids[i : i + size]), h)
                append(h)
        elif self.units == "words":
            words = _WORD.findall(request.text)
            count = len(words)
            for i in range(0, (count - 1) // size * size, size):
                h = _xxh3(" ".join(words[i : i + size]).encode("utf-8", "surrogatepass"), h)
                append(h)
        else:
            raw = memoryview(request.text.encode("utf-8", "surrogatepass"))
            count = -(-len(raw) // self.chars_per_token)
            step = size * self.chars_per_token
            for i in range(0, (count - 1) // size * step, step):
                h = _xxh3(raw[i : i + step], h)  # a memoryview slice: no copy
                append(h)
        blocks = memo[cut] = PromptBlocks(tuple(hashes), count)
        return blocks

    # -- reading -------------------------------------------------------------------------

    def matched(self, backend_id: str, blocks: PromptBlocks) -> int:
        """Units of the prompt that ``backend_id`` holds as leading blocks (0 for an unknown backend)."""
        held = self._held.get(backend_id)
        hashes = blocks.hashes
        if not held or not hashes or hashes[0] not in held:
            return 0
        # Prefix-closed (see the module docstring): the whole prompt when its last block is held (a prompt
        # sent there before), else bisect for the first block not held.
        if hashes[-1] in held:
            return len(hashes) * self.block_size
        lo, hi = 1, len(hashes) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if hashes[mid] in held:
                lo = mid + 1
            else:
                hi = mid
        return lo * self.block_size

    def reuse(self, blocks: PromptBlocks, chosen: str, candidates: Iterable[str]) -> Reuse:
        """What ``chosen`` holds of the prompt and the best any of ``candidates`` holds."""
        at_chosen = self.matched(chosen, blocks)
        best = at_chosen
        for backend_id in candidates:
            if best == len(blocks.hashes) * self.block_size:
                break
            best = max(best, self.matched(backend_id, blocks))
        return Reuse(at_chosen, best, blocks.units)

    def held_blocks(self, backend_id: str) -> int:
        """How many blocks the view thinks ``backend_id`` holds."""
        return len(self._held.get(backend_id, ()))

    def capacity_blocks(self, state: BackendState) -> int:
        """``state``'s cache size in this view's blocks: the engine's when reported, else ``capacity_tokens``."""
        tokens = state.load.kv_tokens if state.load is not None else None
        if tokens is None:
            tokens = self.capacity_tokens
        return max(1, tokens // self.block_size)

    # -- changing ------------------------------------------------------------------------

    def record(self, state: BackendState, blocks: PromptBlocks) -> None:
        """The request was sent to ``state``: it now holds the prompt's blocks; the oldest go past its capacity."""
        held = self._held.get(state.id)
        if held is None:
            held = self._held[state.id] = OrderedDict()
        touch = held.move_to_end
        for h in reversed(blocks.hashes):
            if h in held:
                touch(h)
            else:
                held[h] = None
        limit = self.capacity_blocks(state)
        while len(held) > limit:
            held.popitem(last=False)

    def forget(self, backend_id: str) -> None:
        """Drop what ``backend_id`` held (it left the fleet, or its engine restarted)."""
        self._held.pop(backend_id, None)
