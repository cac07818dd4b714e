"""``kvroute check-parity``: does the router tokenize prompts exactly as the engine does?

A prefix-aware router that tokenizes differently from its engines (another tokenizer
revision, a different chat template, a missing BOS) computes block hashes that never match
what the engines cache, and nothing fails loudly: hit rates just stay low. This check sends
sample prompts and chat conversations to the engine's ``POST /tokenize`` and compares the ids
with the router's own (the strategy's ``prompt_tokenizer``, built from the same options the
proxy would use). Engines without ``/tokenize`` (TensorRT-LLM) are compared on the prompt
token counts their completions report in ``usage``, a weaker check that says so.

It also reports the engine's KV block size (read through the installed backend adapters)
and whether the strategy's ``block_size`` agrees with it.

Use it from the command line (``kvroute check-parity --backend URL --tokenizer DIR``), or
call `check_backend` / `startup_check` from code; the proxy calls `startup_check` when its
strategy tokenizes (tokenizer-prefix), and logs a warning per mismatching backend.

The package's modules: `samples` (the built-in prompts and chats), `report` (`ParityCase`,
`ParityReport`), `compare` (`check_backend`, `engine_block_size`), `startup` (`startup_check`)
and `cli` (the ``check-parity`` command).
"""

from __future__ import annotations

from kvroute_server.parity.cli import check_parity

# engine_block_size and Status are importable from here for callers that use them, outside __all__.
from kvroute_server.parity.compare import PromptTokenizer, check_backend
from kvroute_server.parity.compare import engine_block_size as engine_block_size
from kvroute_server.parity.report import ParityCase, ParityReport
from kvroute_server.parity.report import Status as Status
from kvroute_server.parity.samples import sample_chats, sample_prompts
from kvroute_server.parity.startup import startup_check

__all__ = [
    "ParityCase",
    "ParityReport",
    "PromptTokenizer",
    "check_backend",
    "check_parity",
    "sample_chats",
    "sample_prompts",
    "startup_check",
]
