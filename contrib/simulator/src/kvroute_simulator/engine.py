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
* **CPU tier** (``cpu_capacity_blocks`` > 0). Blocks the GPU evicts move to a CPU tier (LRU,
  exclusive with the GPU); a lookup continues past the GPU hit into it, and blocks found there
  are copied back at ``CostModel.reload_ms`` instead of recomputed.
* **Data parallelism** (``data_parallel_size`` > 1, :class:`DataParallelEngine`). One instance
  holds that many full engine copies (ranks), each with its own KV cache of
  ``capacity_blocks``, queue and scheduler, behind one endpoint. A request names its rank, or
  the instance's balancer picks the rank with the lowest ``4 x waiting + running``, as vLLM's
  DP coordinator does (not cache-aware).

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
from collections.abc import Iterator, Sequence
from typing import Protocol

import attrs
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
from kvroute_simulator.kv_cache import BlockPool, HostTier
from kvroute_simulator.scheduler import GPU, HOST, Batch, EngineStats, Scheduler, StepResult
from kvroute_simulator.sequences import EngineRequest, EngineSequence

__all__ = [
    "DEFAULT_CAPACITY_BLOCKS",
    "H100_X8",
    "LLAMA_3_1_70B",
    "GPU",
    "HOST",
    "CostModel",
    "DataParallelEngine",
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
    "StoredRun",
    "final_computed_tokens",
    "ideal_hit_tokens",
    "kv_capacity_blocks",
    "engine_ranks",
    "make_engine",
]

log = structlog.get_logger(__name__)


@attrs.frozen
class StoredRun:
    """Consecutive blocks of one request that became findable on the GPU (one vLLM ``BlockStored``).

    ``parent`` is the hash of the block before the first (None when the run starts the
    request); ``tokens`` are the blocks' tokens, ``block_size`` per hash.
    """

    request: EngineRequest
    hashes: tuple[int, ...]
    parent: int | None
    tokens: tuple[int, ...]


class KvEventListener(Protocol):
    """Receives an engine's KV cache events, as vLLM publishes BlockStored and BlockRemoved with their ``medium``."""

    def blocks_stored(self, engine: Engine, run: StoredRun, now: float) -> None:
        """Blocks became findable on ``engine``'s GPU."""

    def blocks_removed(self, engine: Engine, hashes: list[int], medium: str, now: float) -> None:
        """Blocks were evicted from (or, on the CPU tier, copied back out of) the tier ``medium``."""

    def blocks_offloaded(self, engine: Engine, hashes: list[int], now: float) -> None:
        """Blocks the GPU evicted became findable on the CPU tier (``medium`` CPU)."""


def _runs(indexes: list[int]) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each run of consecutive integers in the sorted ``indexes``."""
    start = prev = indexes[0]
    for i in indexes[1:]:
        if i != prev + 1:
            yield start, prev + 1
            start = i
        prev = i
    yield start, prev + 1


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
        #: This engine's data-parallel rank in its instance (0 alone).
        self.rank = 0
        self.listener = listener
        self._pool = BlockPool(self.config.capacity_blocks)
        self._host = HostTier(self.config.cpu_capacity_blocks) if self.config.cpu_capacity_blocks else None
        self._scheduler = Scheduler(
            self.config,
            cost or CostModel(),
            self._pool,
            EngineStats(),
            name=name,
            coalesce_decodes=coalesce_decodes,
            events=self,
            host=self._host,
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

    # -- KV events (the scheduler's `KvEvents`, passed on to the listener) -----------------

    def stored(self, runs: list[tuple[EngineSequence, list[int]]], now: float) -> None:
        listener = self.listener
        if listener is None:
            return
        bs = self.config.block_size
        for seq, indexes in runs:
            request = seq.request
            tokens = request.prompt.to_tuple()
            if request.output_tokens is not None:
                tokens += request.output_tokens
            for start, end in _runs(indexes):
                run = StoredRun(
                    request,
                    tuple(seq.hashes[start:end]),
                    seq.hashes[start - 1] if start else None,
                    tokens[start * bs : end * bs],
                )
                listener.blocks_stored(self, run, now)

    def removed(self, hashes: list[int], medium: str, now: float) -> None:
        if self.listener is not None:
            self.listener.blocks_removed(self, hashes, medium, now)

    def offloaded(self, hashes: list[int], now: float) -> None:
        if self.listener is not None:
            self.listener.blocks_offloaded(self, hashes, now)

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
        """Blocks findable by hash on the GPU (referenced or not)."""
        return self._pool.num_cached

    @property
    def cpu_cached_blocks(self) -> int:
        """Blocks findable on the CPU tier (0 without one)."""
        return 0 if self._host is None else len(self._host)

    def is_cpu_cached(self, block_hash: int) -> bool:
        """Whether a block with this hash is on the CPU tier."""
        return self._host is not None and block_hash in self._host

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
        if self._host is not None:
            both = sum(1 for h in self._host._lru if self._pool.is_cached(h))
            if both:
                problems.append(f"{both} blocks are findable on both the GPU and the CPU tier")
            if len(self._host) > self._host.capacity:
                problems.append(f"the CPU tier holds {len(self._host)} blocks, more than its capacity")
        if len(running) > self.config.max_num_seqs:
            problems.append(f"{len(running)} running sequences, more than max_num_seqs")
        return problems

    def next_event_time(self) -> float | None:
        """End of the step in progress, or None when the engine is idle."""
        return None if self._batch is None else self._batch.end

    # -- driving ---------------------------------------------------------------------------

    def submit(self, request: EngineRequest, now: float, rank: int | None = None) -> EngineSequence:
        """Queue ``request`` arriving at ``now``; start a step if the engine is idle.

        ``rank`` is the data-parallel rank the request names: only 0 (or None) is in range here.
        """
        if rank not in (None, 0):
            raise ValueError(f"data_parallel_rank {rank} is out of range [0, 1).")
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


class DataParallelEngine:
    """One instance with ``data_parallel_size`` ranks: full engine copies behind one endpoint.

    Each rank is an :class:`Engine` with its own KV cache of ``capacity_blocks`` (and CPU tier),
    waiting queue and scheduler; ranks share nothing. ``submit`` takes the rank a request names
    (vLLM's ``X-data-parallel-rank``) or lets the balancer pick: the rank with the lowest
    ``4 x waiting + running``, the lowest index on ties, as vLLM's DP coordinator (which sees no
    cache). Same driving protocol as :class:`Engine`: ``next_event_time`` is the earliest rank's,
    ``step`` completes that rank's step. ``listener`` hears every rank (``engine.rank`` tells them apart).
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
        self.ranks: list[Engine] = []
        for rank in range(self.config.data_parallel_size):
            engine = Engine(
                self.config, cost, name=f"{name}/dp{rank}", listener=listener, coalesce_decodes=coalesce_decodes
            )
            engine.rank = rank
            self.ranks.append(engine)
        #: Requests each rank took: named by the request, and picked by the balancer.
        self.routed = [0] * len(self.ranks)
        self.balanced = [0] * len(self.ranks)

    @property
    def size(self) -> int:
        """Ranks."""
        return len(self.ranks)

    def pick(self) -> int:
        """The rank vLLM's balancer gives a request that names none: lowest ``4 x waiting + running``."""
        scores = [4 * e.num_waiting + e.num_running for e in self.ranks]
        return scores.index(min(scores))

    def check_rank(self, rank: int) -> None:
        """Raise ``ValueError`` with vLLM's message for a rank outside ``0 .. size - 1``."""
        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"data_parallel_rank {rank} is out of range [0, {len(self.ranks)}).")

    def place(self, request: EngineRequest, now: float, rank: int | None = None) -> tuple[int, EngineSequence]:
        """Queue ``request`` on ``rank`` (None: the balancer's pick); return the rank and the sequence.

        ``ValueError`` for a rank out of range (vLLM's message) or a request the rank refuses.
        """
        if rank is not None:
            self.check_rank(rank)
        chosen = self.pick() if rank is None else rank
        seq = self.ranks[chosen].submit(request, now)
        (self.balanced if rank is None else self.routed)[chosen] += 1
        return chosen, seq

    def submit(self, request: EngineRequest, now: float, rank: int | None = None) -> EngineSequence:
        """Queue ``request`` on ``rank`` (None: the balancer's pick); see `place`."""
        return self.place(request, now, rank)[1]

    def rank_of(self, seq: EngineSequence) -> int | None:
        """The rank holding ``seq`` while it is waiting or running (None otherwise)."""
        for engine in self.ranks:
            if engine._find(seq) is not None:
                return engine.rank
        return None

    def abort(self, seq: EngineSequence | str, now: float) -> bool:
        """Abort the sequence on whichever rank holds it (see `Engine.abort`)."""
        return any(engine.abort(seq, now) for engine in self.ranks)

    def next_event_time(self) -> float | None:
        """The earliest end of a step in progress on any rank (None when every rank is idle)."""
        times = [t for t in (e.next_event_time() for e in self.ranks) if t is not None]
        return min(times) if times else None

    def step(self, now: float) -> StepResult:
        """Complete the step of the rank whose step ends first (``now`` must be ``next_event_time()``)."""
        engine = min(
            (e for e in self.ranks if e.next_event_time() is not None),
            key=lambda e: e.next_event_time() or 0.0,
            default=None,
        )
        if engine is None:
            raise RuntimeError(f"engine {self.name!r}: step() called while idle (next_event_time() is None).")
        return engine.step(now)

    # -- observation (the instance as a whole) ------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """Every rank's counters added up (a new object)."""
        total = EngineStats()
        for field in attrs.fields(EngineStats):
            setattr(total, field.name, sum(getattr(e.stats, field.name) for e in self.ranks))
        return total

    @property
    def num_running(self) -> int:
        return sum(e.num_running for e in self.ranks)

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self.ranks)

    @property
    def in_flight(self) -> int:
        return sum(e.in_flight for e in self.ranks)

    @property
    def kv_usage(self) -> float:
        """Share of all ranks' blocks held by running sequences."""
        return sum(e.kv_usage for e in self.ranks) / len(self.ranks)

    def audit(self) -> list[str]:
        """Every rank's broken invariants, prefixed by the rank."""
        return [f"rank {e.rank}: {p}" for e in self.ranks for p in e.audit()]


def make_engine(
    config: EngineConfig | None = None,
    cost: CostModel | None = None,
    *,
    name: str = "engine",
    listener: KvEventListener | None = None,
    coalesce_decodes: bool = True,
) -> Engine | DataParallelEngine:
    """An :class:`Engine`, or a :class:`DataParallelEngine` when ``config.data_parallel_size`` > 1."""
    config = config or EngineConfig()
    kind = DataParallelEngine if config.data_parallel_size > 1 else Engine
    return kind(config, cost, name=name, listener=listener, coalesce_decodes=coalesce_decodes)


def engine_ranks(engine: Engine | DataParallelEngine) -> Sequence[Engine]:
    """The ranks of an instance: its engines (one without data parallelism)."""
    return engine.ranks if isinstance(engine, DataParallelEngine) else [engine]
