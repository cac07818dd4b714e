"""The ``tokenizer-prefix`` strategy: route by the engine's own KV blocks, longest cached prefix first, load-bounded.

Public API:

* `TokenizerPrefix`: the strategy (registered as ``tokenizer-prefix``).
* `BlockIndex`: the per-backend block index; adapters feed KV events into
  ``strategy.index`` (``set_exact``, ``blocks_stored``, ``blocks_removed``, ``all_cleared``,
  ``set_capacity``).
* `block_hashes`, `root_hash`: the router's chained block hashes; `PromptBlocks` hashes one
  prompt lazily from its segments (token ids, `TextSegment`), memoizing pieces in a `PieceMemo`.
* `load_tokenizer`, `ModelTokenizer`, `WordTokenizer`, `ChatTemplate`: the tokenizers and the
  chat template renderer (for parity checks against an engine's ``/tokenize``).
"""

from __future__ import annotations

from kvroute_tokenizer_prefix.blocks import PieceMemo, PromptBlocks, TextSegment, block_hashes, root_hash
from kvroute_tokenizer_prefix.chat import ChatTemplate
from kvroute_tokenizer_prefix.index import DEFAULT_CAPACITY_BLOCKS, BlockIndex, RecentDecisions
from kvroute_tokenizer_prefix.strategy import DEFAULT_BLOCK_SIZE, TokenizerPrefix, kvroute_register_strategies
from kvroute_tokenizer_prefix.tokenizer import ModelTokenizer, WordTokenizer, load_tokenizer, prompt_ids

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CAPACITY_BLOCKS",
    "BlockIndex",
    "ChatTemplate",
    "ModelTokenizer",
    "PieceMemo",
    "PromptBlocks",
    "RecentDecisions",
    "TextSegment",
    "TokenizerPrefix",
    "WordTokenizer",
    "block_hashes",
    "kvroute_register_strategies",
    "load_tokenizer",
    "prompt_ids",
    "root_hash",
]
