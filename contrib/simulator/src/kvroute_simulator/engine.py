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
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from typing import Protocol

import attrs
import structlog

from kvroute_simulator._validators import flag, non_negative_number, positive_integer, positive_share
from kvroute_simulator.tokens import TokenSeq, root_hash

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

GB = 10**9


@attrs.frozen
class ModelSpec:
    """The model dimensions that size the KV cache."""

    name: str
    num_layers: int = attrs.field(validator=positive_integer)
    num_kv_heads: int = attrs.field(validator=positive_integer)
    head_dim: int = attrs.field(validator=positive_integer)
    weight_bytes: int = attrs.field(validator=positive_integer)
    dtype_bytes: int = attrs.field(default=2, validator=positive_integer)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token: layers x KV heads x head dim x 2 (K, V) x dtype bytes."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes


@attrs.frozen
class HardwareSpec:
    """The accelerators of one instance and the share of their memory the engine may use."""

    num_gpus: int = attrs.field(default=8, validator=positive_integer)
    gpu_memory_bytes: int = attrs.field(default=80 * GB, validator=positive_integer)
    #: The share of GPU memory the engine may use, as vLLM's ``gpu_memory_utilization``: in (0, 1].
    memory_utilization: float = attrs.field(default=0.9, validator=positive_share)


#: Llama-3.1-70B: 80 layers, 8 KV heads (GQA) of dim 128; ~70.6 B parameters = ~141 GB in fp16/bf16.
LLAMA_3_1_70B = ModelSpec(
    "meta-llama/Llama-3.1-70B-Instruct", num_layers=80, num_kv_heads=8, head_dim=128, weight_bytes=140 * GB
)
#: One p5.48xlarge-like instance: 8 x H100 80 GB, vLLM's default gpu_memory_utilization 0.9.
H100_X8 = HardwareSpec()


def kv_capacity_blocks(model: ModelSpec = LLAMA_3_1_70B, hardware: HardwareSpec = H100_X8, block_size: int = 16) -> int:
    """Return how many KV blocks fit: (GPUs x memory x utilization - weights) / (bytes per token x block size)."""
    budget = hardware.num_gpus * hardware.gpu_memory_bytes * hardware.memory_utilization - model.weight_bytes
    if budget <= 0:
        raise ValueError(f"the weights ({model.weight_bytes} B) do not fit in the usable memory of {hardware!r}.")
    return int(budget // (model.kv_bytes_per_token * block_size))


#: 8 x 80 GB x 0.9 - 140 GB = 436 GB; / 327,680 B per token = 1,330,566 tokens = 83,160 blocks of 16.
DEFAULT_CAPACITY_BLOCKS = kv_capacity_blocks()


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Scheduler and cache settings of one engine (vLLM's names and defaults)."""

    block_size: int = attrs.field(default=16, validator=positive_integer)
    capacity_blocks: int = attrs.field(default=DEFAULT_CAPACITY_BLOCKS, validator=positive_integer)
    max_num_batched_tokens: int = attrs.field(default=8192, validator=positive_integer)
    max_num_seqs: int = attrs.field(default=256, validator=positive_integer)
    max_model_len: int = attrs.field(default=131_072, validator=positive_integer)
    enable_prefix_caching: bool = attrs.field(default=True, validator=flag)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the KV cache holds."""
        return self.capacity_blocks * self.block_size

    def rejection(self, request: EngineRequest) -> Rejection | None:
        """Return why an engine with these settings refuses ``request`` (None when it accepts it).

        vLLM answers such a request with HTTP 400 and goes on serving the others.
        """
        total = len(request.prompt) + request.output_len
        if total > self.max_model_len:
            return Rejection(
                f"prompt + output longer than max_model_len={self.max_model_len:,} tokens",
                f"request {request.request_id!r}: prompt + output must be at most max_model_len="
                f"{self.max_model_len} tokens (got {total}).",
            )
        blocks = -(-total // self.block_size)
        if blocks > self.capacity_blocks:
            return Rejection(
                f"more KV blocks than the whole cache (capacity_blocks={self.capacity_blocks:,})",
                f"request {request.request_id!r}: needs {blocks} KV blocks, more than the "
                f"cache's capacity_blocks={self.capacity_blocks}.",
            )
        return None

    def block_hashes(self, request: EngineRequest) -> list[int]:
        """Return the hashes by which the engine finds ``request``'s blocks (none without prefix caching)."""
        return request.block_hashes(self.block_size) if self.enable_prefix_caching else []

    def lookup_limit(self, num_hashes: int, num_tokens: int) -> int:
        """Return how many leading blocks a lookup may reuse: hashed full blocks, leaving >= 1 token to compute."""
        return min(num_hashes, (num_tokens - 1) // self.block_size)

    def stored_blocks(self, num_hashes: int, num_computed: int) -> int:
        """Return how many leading blocks are findable by hash once ``num_computed`` tokens are computed."""
        return min(num_hashes, num_computed // self.block_size)


@attrs.frozen
class Rejection:
    """Why an engine refuses a request at submit: ``reason`` names the limit, ``message`` the request and its size."""

    reason: str
    message: str


@attrs.frozen(kw_only=True)
class CostModel:
    """Step duration of Llama-3.1-70B on 8 x H100 (tensor parallel 8), in milliseconds.

    A step costs a base, plus per prefill chunk of ``n`` new tokens over ``c`` tokens
    already in the KV cache ``prefill_per_token_ms * n + attention_ms * n * (c + (n + 1) / 2)``
    (each new token attends over everything before it, so a cold prompt of L tokens costs
    ``prefill_base_ms + 0.040 L + 5.6e-7 L (L + 1)``), plus per decoding sequence with
    context ``t`` ``decode_per_seq_ms + kv_read_ms_per_token * t``. The base is
    ``decode_base_ms`` when the step decodes anything, ``prefill_base_ms`` otherwise.
    """

    prefill_base_ms: float = attrs.field(default=9.8, validator=non_negative_number)
    prefill_per_token_ms: float = attrs.field(default=0.040, validator=non_negative_number)
    attention_ms: float = attrs.field(default=1.12e-6, validator=non_negative_number)
    decode_base_ms: float = attrs.field(default=15.0, validator=non_negative_number)
    decode_per_seq_ms: float = attrs.field(default=0.040, validator=non_negative_number)
    kv_read_ms_per_token: float = attrs.field(default=2.0e-5, validator=non_negative_number)

    def prefill_ms(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Return the cost of one prefill chunk, without the step base."""
        n = new_tokens
        return self.prefill_per_token_ms * n + self.attention_ms * n * (cached_tokens + (n + 1) / 2)

    def decode_ms(self, context_tokens: int) -> float:
        """Return the cost of decoding one token for one sequence, without the step base."""
        return self.decode_per_seq_ms + self.kv_read_ms_per_token * context_tokens

    def cold_prefill_ms(self, tokens: int) -> float:
        """Return the duration of a prefill-only step computing one cold prompt of ``tokens``."""
        return self.prefill_base_ms + self.prefill_ms(tokens)


@attrs.frozen
class EngineRequest:
    """What an engine knows of a request: its tokens, how many it will generate, its cache key.

    ``output_tokens`` are the tokens it will generate, when known (a multi-turn
    conversation's answer): their full blocks are cached like the prompt's, so the next
    turn can hit them. ``extra_key`` (LoRA name, cache_salt) is mixed into the first block.
    """

    request_id: str
    prompt: TokenSeq
    output_len: int = attrs.field(validator=positive_integer)
    output_tokens: tuple[int, ...] | None = attrs.field(default=None, kw_only=True)
    extra_key: str | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if len(self.prompt) < 1:
            raise ValueError(f"request {self.request_id!r}: the prompt must hold at least one token (got 0).")
        if self.output_tokens is not None and len(self.output_tokens) != self.output_len:
            raise ValueError(
                f"request {self.request_id!r}: 'output_tokens' must hold output_len={self.output_len} tokens "
                f"(got {len(self.output_tokens)})."
            )

    def block_hashes(self, block_size: int) -> list[int]:
        """Return the hashes of the full blocks of every known token (prompt, then known output)."""
        seq = self.prompt if self.output_tokens is None else self.prompt.extend(self.output_tokens)
        return seq.block_hashes(block_size, root_hash(self.extra_key))


@attrs.define(eq=False)
class EngineSequence:
    """One request inside an engine, with its progress and its timings (seconds, virtual time)."""

    request: EngineRequest
    arrival: float
    hashes: list[int] = attrs.field(repr=False)
    num_tokens: int
    num_computed: int = 0
    generated: int = 0
    blocks: list[int] = attrs.field(factory=list, repr=False)
    registered: int = 0
    cached_tokens: int | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    abort_time: float | None = None

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        """Prompt tokens."""
        return len(self.request.prompt)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the end of the step that produced the first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def finished(self) -> bool:
        """Whether every output token has been generated."""
        return self.finish_time is not None

    @property
    def aborted(self) -> bool:
        """Whether the sequence was aborted before it finished."""
        return self.abort_time is not None


@attrs.frozen
class StepResult:
    """What one call to :meth:`Engine.step` completed: one step, or a run of decode-only steps."""

    start: float
    end: float
    steps: int
    prefill_tokens: int
    decode_tokens: int
    first_tokens: tuple[EngineSequence, ...]
    finished: tuple[EngineSequence, ...]
    preempted: int = 0

    @property
    def duration(self) -> float:
        """Seconds from the first step's start to the last step's end."""
        return self.end - self.start


@attrs.define
class EngineStats:
    """Counters of one engine, in vLLM's terms (prefix cache queries and hits are in tokens)."""

    submitted: int = 0
    admitted: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    prefill_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    evicted_blocks: int = 0
    aborted: int = 0
    steps: int = 0
    busy_time: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Prefix cache hits over queries, in tokens (0 before any admission)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class KvEventListener(Protocol):
    """Receives an engine's KV cache events, as vLLM publishes BlockStored and BlockRemoved."""

    def blocks_stored(self, engine: Engine, hashes: list[int], now: float) -> None:
        """Blocks with these hashes became findable in ``engine``'s cache."""

    def blocks_removed(self, engine: Engine, hashes: list[int], now: float) -> None:
        """Blocks with these hashes were evicted from ``engine``'s cache."""


@attrs.define
class _Batch:
    """The step (or run of decode-only steps) in progress."""

    start: float
    end: float
    steps: int
    scheduled: list[tuple[EngineSequence, int]]
    prefill_tokens: int
    decodes: int
    preempted: int
    # Decode-only runs: duration of step j is d0 + slope * j (contexts grow by one per step).
    d0: float = 0.0
    slope: float = 0.0
    max_steps: int = 1

    def end_after(self, steps: int) -> float:
        return self.start + (steps * self.d0 + self.slope * steps * (steps - 1) / 2) / 1000.0


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
        self.coalesce_decodes = coalesce_decodes
        self.cost = cost or CostModel()
        self.name = name
        self.listener = listener
        self.stats = EngineStats()
        self._bs = self.config.block_size
        self._capacity = self.config.capacity_blocks
        self._fresh = 0  # ids below were used at least once; ids above were never used
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._block_hash: list[int | None] = [None] * self._capacity
        self._ref: list[int] = [0] * self._capacity
        self._cached: dict[int, int] = {}
        self._waiting: collections.deque[EngineSequence] = collections.deque()
        self._running: list[EngineSequence] = []
        self._batch: _Batch | None = None

    # -- observation ---------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Sequences admitted to the running batch (vLLM's num_requests_running)."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued, not yet admitted or preempted (num_requests_waiting)."""
        return len(self._waiting)

    @property
    def in_flight(self) -> int:
        """Sequences submitted and not finished."""
        return len(self._running) + len(self._waiting)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that are not referenced by a running sequence (including evictable cached ones)."""
        return self._capacity - self._fresh + len(self._free)

    @property
    def kv_usage(self) -> float:
        """Share of blocks referenced by running sequences (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.num_free_blocks / self._capacity

    @property
    def cached_blocks(self) -> int:
        """Blocks findable by hash (referenced or not)."""
        return len(self._cached)

    def is_cached(self, block_hash: int) -> bool:
        """Whether a block with this hash is in the cache."""
        return block_hash in self._cached

    def cached_prefix_tokens(self, request: EngineRequest) -> int:
        """Return how many leading prompt tokens of ``request`` are in the cache now (whole blocks)."""
        n = 0
        for h in request.block_hashes(self._bs)[: len(request.prompt) // self._bs]:
            if h not in self._cached:
                break
            n += 1
        return n * self._bs

    def audit(self) -> list[str]:
        """Return the broken invariants of the block pool and the scheduler (empty when consistent)."""
        problems: list[str] = []
        refs = collections.Counter(b for seq in self._running for b in seq.blocks)
        for b in range(self._capacity):
            if self._ref[b] != refs.get(b, 0):
                problems.append(f"block {b}: ref {self._ref[b]} but {refs.get(b, 0)} running references")
            if b >= self._fresh and (self._ref[b] or b in self._free or self._block_hash[b] is not None):
                problems.append(f"block {b}: never allocated but in use")
        for b in self._free:
            if self._ref[b]:
                problems.append(f"block {b}: in the free queue with ref {self._ref[b]}")
        unreferenced = sum(1 for b in range(self._fresh) if self._ref[b] == 0)
        if unreferenced != len(self._free):
            problems.append(f"{unreferenced} used blocks are unreferenced but the free queue holds {len(self._free)}")
        for h, b in self._cached.items():
            if self._block_hash[b] != h:
                problems.append(f"hash {h}: maps to block {b}, which holds {self._block_hash[b]}")
        for seq in self._running:
            if len(set(seq.blocks)) != len(seq.blocks):
                problems.append(f"{seq.request_id}: holds a block twice")
            if len(seq.blocks) * self._bs < seq.num_computed:
                problems.append(f"{seq.request_id}: {seq.num_computed} computed tokens in {len(seq.blocks)} blocks")
        for seq in self._waiting:
            if seq.blocks:
                problems.append(f"{seq.request_id}: waiting but holds blocks")
        if len(self._running) > self.config.max_num_seqs:
            problems.append(f"{len(self._running)} running sequences, more than max_num_seqs")
        return problems

    def next_event_time(self) -> float | None:
        """End of the step in progress, or None when the engine is idle."""
        return None if self._batch is None else self._batch.end

    # -- driving -------------------------------------------------------------------------

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
        self._waiting.append(seq)
        self.stats.submitted += 1
        batch = self._batch
        if batch is None:
            # Wake up at ``now``: requests submitted at the same instant share the first step.
            self._batch = _Batch(now, now, 0, [], 0, 0, 0)
        elif batch.max_steps > 1 and now < batch.end:
            self._cut_run(batch, now)
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
        if any(s is target for s in self._waiting):
            self._waiting.remove(target)
        else:
            self._running.remove(target)
            if batch is not None:
                scheduled = [(s, n) for s, n in batch.scheduled if s is not target]
                if len(scheduled) != len(batch.scheduled):
                    batch.scheduled = scheduled
                    if batch.max_steps > 1 and now < batch.end:
                        self._cut_run(batch, now)
        self._release(target.blocks)
        target.abort_time = now
        self.stats.aborted += 1
        return True

    def _find(self, seq: EngineSequence | str) -> EngineSequence | None:
        if isinstance(seq, EngineSequence):
            if seq.finished or seq.aborted:
                return None
            return next((s for s in (*self._running, *self._waiting) if s is seq), None)
        return next((s for s in (*self._running, *self._waiting) if s.request_id == seq), None)

    def step(self, now: float) -> StepResult:
        """Complete the step in progress (``now`` must be ``next_event_time()``) and start the next one."""
        batch = self._batch
        if batch is None:
            raise RuntimeError(f"engine {self.name!r}: step() called while idle (next_event_time() is None).")
        if not math.isclose(now, batch.end, rel_tol=1e-12, abs_tol=1e-9):
            raise ValueError(
                f"engine {self.name!r}: step() must be called at next_event_time()={batch.end!r} (got {now!r})."
            )
        result = self._complete(batch)
        self._batch = None
        self._start_batch(batch.end)
        return result

    # -- block pool ----------------------------------------------------------------------

    def _allocate(self, count: int, into: list[int], now: float) -> None:
        """Append ``count`` new blocks to ``into`` (never-used first, then the LRU head, dropping its hash)."""
        fresh_left = self._capacity - self._fresh
        take = min(count, fresh_left)
        if take:
            into.extend(range(self._fresh, self._fresh + take))
            for b in range(self._fresh, self._fresh + take):
                self._ref[b] = 1
            self._fresh += take
            count -= take
        if not count:
            return
        free, block_hash, cached, ref = self._free, self._block_hash, self._cached, self._ref
        removed: list[int] = []
        for _ in range(count):
            b, _none = free.popitem(last=False)
            h = block_hash[b]
            if h is not None:
                block_hash[b] = None
                if cached.get(h) == b:
                    del cached[h]
                    removed.append(h)
            ref[b] = 1
            into.append(b)
        if removed:
            self.stats.evicted_blocks += len(removed)
            if self.listener is not None:
                self.listener.blocks_removed(self, removed, now)

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each block, last block first; unreferenced blocks join the free queue's tail."""
        ref, free = self._ref, self._free
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
        blocks.clear()

    def _preempt(self, seq: EngineSequence) -> None:
        self._release(seq.blocks)
        seq.num_computed = 0
        seq.registered = 0
        seq.preemptions += 1
        self.stats.preemptions += 1
        self._running.remove(seq)
        self._waiting.appendleft(seq)

    # -- scheduling ----------------------------------------------------------------------

    def _start_batch(self, now: float) -> None:
        if not self._running and not self._waiting:
            return
        bs = self._bs
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[EngineSequence, int]] = []
        taken: set[int] = set()  # id() of sequences scheduled in this step
        gone: set[int] = set()  # id() of sequences preempted in this step
        cost = self.cost
        step_ms = 0.0
        decodes = 0
        prefill_tokens = 0
        kv_context = 0

        def make_room(seq: EngineSequence, need: int) -> bool:
            """Preempt the latest unscheduled running sequences until ``need`` blocks are free."""
            while self.num_free_blocks < need:
                victim = next((s for s in reversed(self._running) if id(s) not in taken and s is not seq), None)
                if victim is None:
                    return False
                self._preempt(victim)
                gone.add(id(victim))
            return True

        # 1. Running sequences: decodes first, then chunks of prompts still being computed.
        running = list(self._running)
        for decode_pass in (True, False):
            for seq in running:
                if budget <= 0:
                    break
                if id(seq) in taken or id(seq) in gone:
                    continue
                remaining = seq.num_tokens - seq.num_computed
                is_decode = remaining == 1 and seq.generated > 0
                if is_decode != decode_pass:
                    continue
                n = min(remaining, budget)
                need = -(-(seq.num_computed + n) // bs) - len(seq.blocks)
                if need > 0:
                    if not make_room(seq, need):
                        self._preempt(seq)
                        gone.add(id(seq))
                        continue
                    self._allocate(need, seq.blocks, now)
                taken.add(id(seq))
                scheduled.append((seq, n))
                budget -= n
                if is_decode:
                    decodes += 1
                    kv_context += seq.num_computed + 1
                else:
                    prefill_tokens += n
                    step_ms += cost.prefill_ms(n, seq.num_computed)

        # 2. Waiting sequences, FCFS, while budget and seats last (not in a step that preempted).
        while not gone and self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting[0]
            hits = self._lookup(seq)
            n_hits = len(hits)
            computed = n_hits * bs
            n = min(seq.num_tokens - computed, budget)
            need = -(-(computed + n) // bs) - n_hits
            touched = sum(1 for b in hits if self._ref[b] == 0)
            if need + touched > self.num_free_blocks:
                break  # vLLM does not preempt running sequences for a waiting one
            self._waiting.popleft()
            self._touch(hits)
            seq.blocks = hits
            self._allocate(need, seq.blocks, now)
            seq.num_computed = computed
            seq.registered = n_hits
            if seq.cached_tokens is None:
                seq.cached_tokens = computed
                self.stats.admitted += 1
                self.stats.prompt_tokens += seq.prompt_len
                self.stats.hit_tokens += computed
            self._running.append(seq)
            taken.add(id(seq))
            scheduled.append((seq, n))
            budget -= n
            prefill_tokens += n
            step_ms += cost.prefill_ms(n, computed)

        if not scheduled:
            if self._running:
                raise RuntimeError(f"engine {self.name!r}: no running sequence could be scheduled.")
            if gone:
                # Everything was preempted: try again from the waiting queue at the same instant.
                self._batch = _Batch(now, now, 0, [], 0, 0, len(gone))
                return
            # The waiting head does not fit although nothing runs: the submit-time check prevents this.
            raise RuntimeError(f"engine {self.name!r}: the waiting request does not fit in an empty cache.")

        base = cost.decode_base_ms if decodes else cost.prefill_base_ms
        step_ms += base + decodes * cost.decode_per_seq_ms + cost.kv_read_ms_per_token * kv_context
        batch = _Batch(now, now + step_ms / 1000.0, 1, scheduled, prefill_tokens, decodes, len(gone), d0=step_ms)
        # A decode-only step repeats unchanged until a sequence finishes or a request arrives, unless a
        # waiting sequence could be admitted meanwhile: it is blocked by seats or budget (which stay
        # so), not by memory (evictions can shorten its cache hit and let a budget-capped chunk fit).
        blocked = not self._waiting or len(self._running) >= self.config.max_num_seqs or budget <= 0
        if self.coalesce_decodes and blocked and decodes == len(scheduled) == len(self._running) and not gone:
            self._plan_run(batch)
        self._batch = batch

    def _plan_run(self, batch: _Batch) -> None:
        """Extend a decode-only step into a run of steps until the first sequence finishes."""
        running = self._running
        k = min(s.request.output_len - s.generated for s in running)
        if k <= 1:
            return
        bs = self._bs
        free = self.num_free_blocks

        def need(steps: int) -> int:
            return sum(max(0, -(-(s.num_computed + steps) // bs) - len(s.blocks)) for s in running)

        if need(k) > free:  # memory runs out before the first finish: the largest run that fits
            lo, hi = 1, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if need(mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
            if k <= 1:
                return
        batch.slope = self.cost.kv_read_ms_per_token * len(running)
        batch.max_steps = k
        batch.steps = k
        batch.end = batch.end_after(k)

    def _cut_run(self, batch: _Batch, now: float) -> None:
        """End a decode-only run at the first step boundary at or after ``now``."""
        # Smallest m with end_after(m) >= now: solve slope/2 m^2 + (d0 - slope/2) m = elapsed.
        elapsed = (now - batch.start) * 1000.0
        a, b = batch.slope / 2, batch.d0 - batch.slope / 2
        m = math.ceil((-b + math.sqrt(b * b + 4 * a * elapsed)) / (2 * a)) if a > 0 else math.ceil(elapsed / b)
        m = max(1, min(m, batch.steps))
        while m > 1 and batch.end_after(m - 1) >= now:
            m -= 1
        while m < batch.steps and batch.end_after(m) < now:
            m += 1
        batch.steps = m
        batch.end = batch.end_after(m)

    def _lookup(self, seq: EngineSequence) -> list[int]:
        """Return the cached blocks holding the longest prefix of ``seq`` (leaving >= 1 token to compute)."""
        if not seq.hashes:
            return []
        limit = self.config.lookup_limit(len(seq.hashes), seq.num_tokens)
        cached = self._cached
        hits: list[int] = []
        for h in seq.hashes[:limit]:
            b = cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _touch(self, blocks: list[int]) -> None:
        ref, free = self._ref, self._free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    # -- completion ----------------------------------------------------------------------

    def _complete(self, batch: _Batch) -> StepResult:
        end = batch.end
        steps = batch.steps
        stats = self.stats
        bs = self._bs
        first: list[EngineSequence] = []
        done: list[EngineSequence] = []
        stored: list[int] = []
        sampled = 0
        if steps > 1:
            # A decode-only run: every running sequence computed (and sampled) ``steps`` tokens.
            for seq, _n in batch.scheduled:
                need = -(-(seq.num_computed + steps) // bs) - len(seq.blocks)
                if need > 0:
                    self._allocate(need, seq.blocks, end)
                seq.num_computed += steps
                seq.num_tokens += steps
                seq.generated += steps
                sampled += steps
                self._register(seq, stored)
                if seq.generated >= seq.request.output_len:
                    seq.finish_time = end
                    done.append(seq)
        else:
            for seq, n in batch.scheduled:
                seq.num_computed += n
                if seq.num_computed == seq.num_tokens:
                    seq.generated += 1
                    seq.num_tokens += 1
                    sampled += 1
                    if seq.generated == 1:
                        seq.first_token_time = end
                        first.append(seq)
                self._register(seq, stored)
                if seq.generated >= seq.request.output_len:
                    seq.finish_time = end
                    done.append(seq)
        stats.steps += steps
        stats.busy_time += end - batch.start
        stats.prefill_tokens += batch.prefill_tokens
        stats.output_tokens += sampled
        if done:
            finished = {id(s) for s in done}
            self._running = [s for s in self._running if id(s) not in finished]
            for seq in done:
                self._release(seq.blocks)
            stats.finished += len(done)
        if stored and self.listener is not None:
            self.listener.blocks_stored(self, stored, end)
        return StepResult(
            batch.start,
            end,
            steps,
            batch.prefill_tokens,
            batch.decodes * steps,
            tuple(first),
            tuple(done),
            batch.preempted,
        )

    def _register(self, seq: EngineSequence, stored: list[int]) -> None:
        """Make the newly completed full blocks of ``seq`` findable by hash (first writer wins)."""
        upto = self.config.stored_blocks(len(seq.hashes), seq.num_computed)
        if upto <= seq.registered:
            return
        cached, block_hash, hashes, blocks = self._cached, self._block_hash, seq.hashes, seq.blocks
        for i in range(seq.registered, upto):
            h = hashes[i]
            if h not in cached:
                b = blocks[i]
                cached[h] = b
                block_hash[b] = h
                stored.append(h)
        seq.registered = upto


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
