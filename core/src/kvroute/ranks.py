"""Data-parallel ranks: which rank of a backend a request reaches.

A vLLM server started with ``--data-parallel-size N`` holds N separate KV caches behind one URL
and routes each request to one of its ranks; a request carrying the header
``X-data-parallel-rank: R`` goes to rank R. A prefix cached on rank 0 is no hit on rank 1, so a
router that knows where a prefix is cached names the rank as well as the backend.

* A strategy that knows ranks (tokenizer-prefix keeps its index per backend and rank) sets
  `kvroute.Decision.data_parallel_rank` itself.
* For any other strategy, `rank_for` gives a data-parallel backend a stable rank per prefix key:
  the ranks' rendezvous order for the decision's key (`rank_order`), taking the first rank
  whose engine-reported load (`kvroute.RankLoad`, from vLLM's per-``engine`` metrics) is within
  ``load_factor`` times the ranks' mean (`choose_rank`). The same key reaches the same rank while
  the loads allow, in every router replica. A decision without a key (``random``,
  ``least-outstanding``) names no rank: the engine's own balancer places it.

A backend with one rank never gets a rank: nothing changes without data parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from kvroute.backend import BackendState
from kvroute.strategy import Decision

__all__ = ["RANK_HEADER", "RANK_LOAD_FACTOR", "choose_rank", "rank_for", "rank_order"]

#: The request header naming the rank (vLLM's and SGLang's name; HTTP header names are case-insensitive).
RANK_HEADER = "x-data-parallel-rank"
#: A rank takes a key's requests while its load is at most this many times the ranks' mean.
RANK_LOAD_FACTOR = 1.25


_SEED_MASK = (1 << 64) - 1
_RANK_TAG = 0x6B76_726F_7574_6521  # seeds the ranks' scores apart from any other use of the key


def rank_order(key: int, size: int) -> list[int]:
    """Ranks ``0 .. size - 1`` in ``key``'s rendezvous order (highest score first); the same in every process.

    A rank's score is xxh3 of its number (4 bytes, little-endian) seeded with the key.
    """
    seed = (key ^ _RANK_TAG) & _SEED_MASK
    score = xxhash.xxh3_64_intdigest
    return sorted(range(size), key=lambda rank: score(rank.to_bytes(4, "little"), seed), reverse=True)


def choose_rank(state: BackendState, order: Sequence[int], *, load_factor: float = RANK_LOAD_FACTOR) -> int:
    """The first rank of ``order`` whose reported load is within ``load_factor`` x the mean, else the least loaded.

    Loads are the engine's per-rank reports (running + waiting) while they are fresh; without them
    (or for ranks not reported) the first rank of ``order`` wins.
    """
    load = state.fresh_load()
    reported = {r.rank: r.requests for r in load.ranks} if load is not None else {}
    if not reported or not order:
        return order[0]
    loads = [reported.get(rank, 0) for rank in order]
    bound = max(1.0, load_factor * sum(loads) / len(loads))
    for rank, value in zip(order, loads, strict=True):
        if value <= bound:
            return rank
    return order[loads.index(min(loads))]


def rank_for(decision: Decision, state: BackendState) -> int | None:
    """The rank ``decision`` should reach on ``state``'s backend, ``None`` for no rank header.

    The decision's own ``data_parallel_rank`` when it names one within the backend's ranks; else,
    for a backend with more than one rank and a decision with a key, the key's rank (`rank_order`,
    `choose_rank`); else ``None``.
    """
    size = state.data_parallel_size
    rank = decision.data_parallel_rank
    if rank is not None:
        return rank if 0 <= rank < size else None
    if size <= 1 or decision.key is None:
        return None
    return choose_rank(state, rank_order(decision.key, size))
