"""A vLLM-like engine model for the fleet simulator: paged KV cache, prefix reuse, chunked prefill.

One :class:`Engine` models one inference instance (one vLLM server on 8 x H100 by
default) in virtual time. It is driven by events: the driver ``submit``s requests and
calls ``step`` at ``next_event_time()``. The model follows vLLM v1:

* **Paged KV cache.** ``capacity_blocks`` blocks of ``block_size`` tokens. A full block
  whose tokens are known gets a chained hash (see :class:`~kvroute_simulator.tokens.TokenSeq`)
  and stays findable by it until evicted; blocks of running sequences are reference-counted.
  Free blocks sit in one queue in eviction order: never-used blocks first, then blocks in
  the order they were freed (a finished sequence frees its blocks last-to-first, so its
  tail goes first). Allocation takes the queue's head and drops its hash: LRU eviction of
  unreferenced blocks only.
* **Prefix reuse.** When a waiting sequence is admitted, the longest run of its leading
  block hashes found in the cache is reused (at most ``num_tokens - 1`` tokens, so the last
  token is always computed and the first token sampled, as vLLM does).
* **Continuous batching with chunked prefill.** Each step has a budget of
  ``max_num_batched_tokens``: running decodes take one token each first, then running
  sequences still in prefill, then waiting sequences in arrival order (FCFS) get the rest as
  chunks, while fewer than ``max_num_seqs`` run. When blocks run out, the most recently
  admitted sequence is preempted (its blocks are freed and it is recomputed later).
* **Aborts.** ``abort`` removes a waiting or running sequence at once, as vLLM does when its
  client disconnects: its blocks are released like a finished sequence's (shared prefix
  blocks are unpinned and become evictable when nothing else holds them; blocks it filled
  stay findable by hash until evicted), and the step in progress no longer produces its
  tokens.
* **Cost model.** A step's duration comes from :class:`CostModel`; a step that completes a
  sequence's prompt samples its first token (TTFT = arrival to the end of that step).

Decode-only stretches are simulated in one batch of many steps (closed-form durations)
that ends early when a request arrives, so the cost of a run grows with the number of
requests, not the number of tokens. See docs/simulation.md for the calibration.

The pieces live in their own modules, which this one composes and re-exports:
:mod:`~kvroute_simulator.engine_config` (model, hardware, settings, cost model),
:mod:`~kvroute_simulator.sequences` (requests and their progress),
:mod:`~kvroute_simulator.kv_cache` (the block pool), :mod:`~kvroute_simulator.scheduler`
(steps) and :mod:`~kvroute_simulator.bound` (the hit-rate upper bound).
"""

from __future__ import annotations

import collections
import math
from typing import Protocol

import structlog

from kvroute_simulator.bound import final_computed_tokens, ideal_hit_tokens
from kvroute_simulator.engine_config import (
    DEFAULT_CAPACITY_BLOCKS,
    H100_X8,
    LLAMA_3_1_70B,
    CostModel,
    EngineConfig,
    HardwareSpec,
    ModelSpec,
    Rejection,
    kv_capacity_blocks,
)
from kvroute_simulator.kv_cache import BlockPool
from kvroute_simulator.scheduler import Batch, EngineStats, Scheduler, StepResult
from kvroute_simulator.sequences import EngineRequest, EngineSequence

__all__ = [
    "DEFAULT_CAPACITY_BLOCKS",
    "H100_X8",
    "LLAMA_3_1_70B",
    "CostModel",
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "EngineSequence",
    "EngineStats",
    "HardwareSpec",
    "KvEventListener",
    "ModelSpec",
    "Rejection",
    "StepResult",
    "final_computed_tokens",
    "ideal_hit_tokens",
    "kv_capacity_blocks",
]

log = structlog.get_logger(__name__)


class KvEventListener(Protocol):
    """Receives an engine's KV cache events, as vLLM publishes BlockStored and BlockRemoved."""

    def blocks_stored(self, engine: Engine, hashes: list[int], now: float) -> None:
        """Blocks with these hashes became findable in ``engine``'s cache."""

    def blocks_removed(self, engine: Engine, hashes: list[int], now: float) -> None:
        """Blocks with these hashes were evicted from ``engine``'s cache."""


class Engine:
    """One simulated inference instance (see the module docstring for the model).

    Driving protocol: ``submit(request, now)`` when a request arrives; while
    ``next_event_time()`` is not None, call ``step(t)`` at that time ``t``. A ``submit`` to
    an idle engine schedules a zero-length wake-up step at ``now`` (so requests arriving at
    the same instant share the first step); a ``submit`` may also move ``next_event_time()``
    earlier (it cuts a decode-only run short), so re-read it after every submit.

    ``listener`` receives KV cache events. ``coalesce_decodes=False`` simulates every
    decode step one by one (same results up to float rounding, much slower: for tests).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        cost: CostModel | None = None,
        *,
        name: str = "engine",
        listener: KvEventListener | None = None,
        coalesce_decodes: bool = True,
    ) -> None:
        self.config = config or EngineConfig()
        self.name = name
        self.listener = listener
        self._pool = BlockPool(self.config.capacity_blocks)
        self._scheduler = Scheduler(
            self.config,
            cost or CostModel(),
            self._pool,
            EngineStats(),
            name=name,
            coalesce_decodes=coalesce_decodes,
            on_stored=self._blocks_stored,
            on_removed=self._blocks_removed,
        )
        self._batch: Batch | None = None

    # -- settings the scheduler applies ----------------------------------------------------

    @property
    def cost(self) -> CostModel:
        """The cost model that times each step."""
        return self._scheduler.cost

    @cost.setter
    def cost(self, cost: CostModel) -> None:
        self._scheduler.cost = cost

    @property
    def coalesce_decodes(self) -> bool:
        """Whether decode-only stretches are simulated as one run of steps (see the class docstring)."""
        return self._scheduler.coalesce_decodes

    @coalesce_decodes.setter
    def coalesce_decodes(self, coalesce: bool) -> None:
        self._scheduler.coalesce_decodes = coalesce

    @property
    def stats(self) -> EngineStats:
        """The engine's counters."""
        return self._scheduler.stats

    @stats.setter
    def stats(self, stats: EngineStats) -> None:
        self._scheduler.stats = stats

    def _blocks_stored(self, hashes: list[int], now: float) -> None:
        if self.listener is not None:
            self.listener.blocks_stored(self, hashes, now)

    def _blocks_removed(self, hashes: list[int], now: float) -> None:
        if self.listener is not None:
            self.listener.blocks_removed(self, hashes, now)

    # -- observation -----------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Sequences admitted to the running batch (vLLM's num_requests_running)."""
        return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued, not yet admitted or preempted (num_requests_waiting)."""
        return len(self._scheduler.waiting)

    @property
    def in_flight(self) -> int:
        """Sequences submitted and not finished."""
        return len(self._scheduler.running) + len(self._scheduler.waiting)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that are not referenced by a running sequence (including evictable cached ones)."""
        return self._pool.num_free

    @property
    def kv_usage(self) -> float:
        """Share of blocks referenced by running sequences (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self._pool.num_free / self._pool.capacity

    @property
    def cached_blocks(self) -> int:
        """Blocks findable by hash (referenced or not)."""
        return self._pool.num_cached

    def is_cached(self, block_hash: int) -> bool:
        """Whether a block with this hash is in the cache."""
        return self._pool.is_cached(block_hash)

    def cached_prefix_tokens(self, request: EngineRequest) -> int:
        """Return how many leading prompt tokens of ``request`` are in the cache now (whole blocks)."""
        bs = self.config.block_size
        n = 0
        for h in request.block_hashes(bs)[: len(request.prompt) // bs]:
            if not self._pool.is_cached(h):
                break
            n += 1
        return n * bs

    def audit(self) -> list[str]:
        """Return the broken invariants of the block pool and the scheduler (empty when consistent)."""
        running, waiting = self._scheduler.running, self._scheduler.waiting
        problems = self._pool.audit(collections.Counter(b for seq in running for b in seq.blocks))
        for seq in running:
            if len(set(seq.blocks)) != len(seq.blocks):
                problems.append(f"{seq.request_id}: holds a block twice")
            if len(seq.blocks) * self.config.block_size < seq.num_computed:
                problems.append(f"{seq.request_id}: {seq.num_computed} computed tokens in {len(seq.blocks)} blocks")
        for seq in waiting:
            if seq.blocks:
                problems.append(f"{seq.request_id}: waiting but holds blocks")
        if len(running) > self.config.max_num_seqs:
            problems.append(f"{len(running)} running sequences, more than max_num_seqs")
        return problems

    def next_event_time(self) -> float | None:
        """End of the step in progress, or None when the engine is idle."""
        return None if self._batch is None else self._batch.end

    # -- driving ---------------------------------------------------------------------------

    def submit(self, request: EngineRequest, now: float) -> EngineSequence:
        """Queue ``request`` arriving at ``now``; start a step if the engine is idle."""
        refused = self.config.rejection(request)
        if refused is not None:
            raise ValueError(refused.message)
        if self._batch is not None and now > self._batch.end + 1e-9:
            raise ValueError(
                f"engine {self.name!r}: submit at {now!r} is past next_event_time()={self._batch.end!r}; "
                "call step() first."
            )
        hashes = self.config.block_hashes(request)
        seq = EngineSequence(request, now, hashes, num_tokens=len(request.prompt))
        self._scheduler.waiting.append(seq)
        self.stats.submitted += 1
        batch = self._batch
        if batch is None:
            # Wake up at ``now``: requests submitted at the same instant share the first step.
            self._batch = Batch(now, now, 0, [], 0, 0, 0)
        elif batch.max_steps > 1 and now < batch.end:
            batch.cut(now)
        return seq

    def abort(self, seq: EngineSequence | str, now: float) -> bool:
        """Remove a waiting or running sequence (or the one with this request id) at ``now``.

        Its blocks are released last-to-first, like a finished sequence's: blocks nothing else
        references join the free queue (evictable; those holding a full block of its tokens stay
        findable by hash until evicted). If the step in progress computes it, the step keeps its
        duration (the work was scheduled) but no longer advances it; a run of decode-only steps is
        cut at the first step boundary at or after ``now``. Returns False when the sequence is not
        in the engine (finished, already aborted, or unknown).
        """
        batch = self._batch
        if batch is not None and now > batch.end + 1e-9:
            raise ValueError(
                f"engine {self.name!r}: abort at {now!r} is past next_event_time()={batch.end!r}; call step() first."
            )
        target = self._find(seq)
        if target is None:
            return False
        if any(s is target for s in self._scheduler.waiting):
            self._scheduler.waiting.remove(target)
        else:
            self._scheduler.running.remove(target)
            if batch is not None:
                scheduled = [(s, n) for s, n in batch.scheduled if s is not target]
                if len(scheduled) != len(batch.scheduled):
                    batch.scheduled = scheduled
                    if batch.max_steps > 1 and now < batch.end:
                        batch.cut(now)
        self._pool.release(target.blocks)
        target.abort_time = now
        self.stats.aborted += 1
        return True

    def _find(self, seq: EngineSequence | str) -> EngineSequence | None:
        queued = (*self._scheduler.running, *self._scheduler.waiting)
        if isinstance(seq, EngineSequence):
            if seq.finished or seq.aborted:
                return None
            return next((s for s in queued if s is seq), None)
        return next((s for s in queued if s.request_id == seq), None)

    def step(self, now: float) -> StepResult:
        """Complete the step in progress (``now`` must be ``next_event_time()``) and start the next one."""
        batch = self._batch
        if batch is None:
            raise RuntimeError(f"engine {self.name!r}: step() called while idle (next_event_time() is None).")
        if not math.isclose(now, batch.end, rel_tol=1e-12, abs_tol=1e-9):
            raise ValueError(
                f"engine {self.name!r}: step() must be called at next_event_time()={batch.end!r} (got {now!r})."
            )
        result = self._scheduler.complete(batch)
        self._batch = self._scheduler.schedule(batch.end)
        return result
