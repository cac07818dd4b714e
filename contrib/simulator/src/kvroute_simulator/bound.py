"""The hit-rate upper bound of a run: one engine with an infinite cache that served every request."""

from __future__ import annotations

from collections.abc import Iterable

from kvroute_simulator.engine_config import EngineConfig
from kvroute_simulator.sequences import EngineRequest

__all__ = ["final_computed_tokens", "ideal_hit_tokens"]


def final_computed_tokens(request: EngineRequest) -> int:
    """Return the tokens an engine has computed when ``request`` finishes: all but the last sampled one."""
    return len(request.prompt) + request.output_len - 1


def ideal_hit_tokens(requests: Iterable[EngineRequest], config: EngineConfig | None = None) -> tuple[int, int]:
    """Return (hit tokens, prompt tokens) of one engine with an infinite cache that served every request.

    This is the upper bound of any routing over engines with these settings: one pooled
    instance that keeps every block it ever computed, serving the requests in the given
    order (arrival order). It follows the engine's own rules: the same chained block hashes
    (none when prefix caching is off), a lookup of at most ``prompt - 1`` tokens in full
    blocks, and, once a request finishes, every full block of what it computed findable,
    prompt and known output alike (a multi-turn answer, which the next turn hits). Requests
    the engine refuses (:meth:`EngineConfig.rejection`) count neither in the hits nor in the
    prompt tokens, as in the engines' own counters.
    """
    config = config or EngineConfig()
    seen: set[int] = set()
    hits = total = 0
    for request in requests:
        if config.rejection(request) is not None:
            continue
        hashes = config.block_hashes(request)
        prompt = len(request.prompt)
        limit = config.lookup_limit(len(hashes), prompt)
        n = 0
        while n < limit and hashes[n] in seen:
            n += 1
        hits += n * config.block_size
        total += prompt
        seen.update(hashes[: config.stored_blocks(len(hashes), final_computed_tokens(request))])
    return hits, total
