"""The continuous-batching scheduler of one engine: what each step computes, and what it completed.

Each step has a budget of ``max_num_batched_tokens``: running decodes take one token each
first, then running sequences still in prefill, then waiting sequences in arrival order
(FCFS) get the rest as chunks, while fewer than ``max_num_seqs`` run. A waiting sequence is
admitted with the longest run of its leading blocks found in the cache (at most
``num_tokens - 1`` tokens, so the last token is always computed and the first token
sampled, as vLLM does). When blocks run out, the most recently admitted sequence is
preempted (its blocks are freed and it is recomputed later). A decode-only step that would
repeat unchanged becomes one :class:`Batch` of many steps with closed-form durations.

With a CPU tier (:class:`~kvroute_simulator.kv_cache.HostTier`), blocks the GPU pool evicts
move there; a lookup continues past the GPU hit into the CPU tier, and the blocks found there
are copied back (the step that admits the sequence lasts ``CostModel.reload_ms`` longer) and
stored on the GPU again when the step ends.
"""

from __future__ import annotations

import collections
import math
from typing import Protocol

import attrs

from kvroute_simulator.engine_config import CostModel, EngineConfig
from kvroute_simulator.kv_cache import BlockPool, HostTier
from kvroute_simulator.sequences import EngineSequence

__all__ = ["GPU", "HOST", "Batch", "EngineStats", "KvEvents", "Scheduler", "StepResult"]

#: The tiers' names, as vLLM's KV events give them in ``medium``.
GPU = "GPU"
HOST = "CPU"


class KvEvents(Protocol):
    """Receives what happens to the blocks of one engine's tiers, at a time."""

    def stored(self, runs: list[tuple[EngineSequence, list[int]]], now: float) -> None:
        """Blocks became findable on the GPU: per sequence, the indexes of its newly stored blocks."""

    def removed(self, hashes: list[int], medium: str, now: float) -> None:
        """Blocks stopped being findable on the tier ``medium`` (GPU or CPU)."""

    def offloaded(self, hashes: list[int], now: float) -> None:
        """Blocks the GPU evicted became findable on the CPU tier."""


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
    #: Prompt tokens found on the CPU tier (part of ``hit_tokens``), and the seconds spent copying them back.
    cpu_hit_tokens: int = 0
    reload_time: float = 0.0
    #: Blocks the GPU evicted into the CPU tier, and blocks the CPU tier evicted for good.
    offloaded_blocks: int = 0
    cpu_evicted_blocks: int = 0
    aborted: int = 0
    steps: int = 0
    busy_time: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Prefix cache hits over queries, in tokens, both tiers (0 before any admission)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def gpu_hit_tokens(self) -> int:
        """Prompt tokens found on the GPU."""
        return self.hit_tokens - self.cpu_hit_tokens


@attrs.define
class Batch:
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
        """Return when the first ``steps`` steps of the run end (seconds)."""
        return self.start + (steps * self.d0 + self.slope * steps * (steps - 1) / 2) / 1000.0

    def cut(self, now: float) -> None:
        """End a decode-only run at the first step boundary at or after ``now``."""
        # Smallest m with end_after(m) >= now: solve slope/2 m^2 + (d0 - slope/2) m = elapsed.
        elapsed = (now - self.start) * 1000.0
        a, b = self.slope / 2, self.d0 - self.slope / 2
        m = math.ceil((-b + math.sqrt(b * b + 4 * a * elapsed)) / (2 * a)) if a > 0 else math.ceil(elapsed / b)
        m = max(1, min(m, self.steps))
        while m > 1 and self.end_after(m - 1) >= now:
            m -= 1
        while m < self.steps and self.end_after(m) < now:
            m += 1
        self.steps = m
        self.end = self.end_after(m)


class Scheduler:
    """The waiting queue and the running batch of one engine, and the steps that advance them.

    ``schedule`` plans the next step over the block pool; ``complete`` applies a planned step
    once its time has come. Counters go to ``stats``; ``events`` hears of blocks stored,
    removed and offloaded on each tier. ``host`` is the CPU tier, if any.
    """

    def __init__(
        self,
        config: EngineConfig,
        cost: CostModel,
        pool: BlockPool,
        stats: EngineStats,
        *,
        name: str,
        coalesce_decodes: bool,
        events: KvEvents,
        host: HostTier | None = None,
    ) -> None:
        self.config = config
        self.cost = cost
        self.pool = pool
        self.stats = stats
        self.name = name
        self.coalesce_decodes = coalesce_decodes
        self.events = events
        self.host = host
        self._bs = config.block_size
        self.waiting: collections.deque[EngineSequence] = collections.deque()
        self.running: list[EngineSequence] = []

    # -- blocks ----------------------------------------------------------------------------

    def _allocate(self, count: int, into: list[int], now: float) -> None:
        removed = self.pool.allocate(count, into)
        if removed:
            self.stats.evicted_blocks += len(removed)
            self.events.removed(removed, GPU, now)
            if self.host is not None:
                stored, dropped = self.host.offload(removed)
                if dropped:
                    self.stats.cpu_evicted_blocks += len(dropped)
                    self.events.removed(dropped, HOST, now)
                if stored:
                    self.stats.offloaded_blocks += len(stored)
                    self.events.offloaded(stored, now)

    def _preempt(self, seq: EngineSequence) -> None:
        self.pool.release(seq.blocks)
        seq.num_computed = 0
        seq.registered = 0
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _lookup(self, seq: EngineSequence) -> list[int]:
        """Return the cached blocks holding the longest prefix of ``seq`` (leaving >= 1 token to compute)."""
        if not seq.hashes:
            return []
        limit = self.config.lookup_limit(len(seq.hashes), seq.num_tokens)
        return self.pool.lookup(seq.hashes[:limit])

    def _host_hits(self, seq: EngineSequence, gpu_hits: int) -> int:
        """Return how many blocks after the GPU hit the CPU tier holds (within the lookup limit)."""
        if self.host is None or not seq.hashes:
            return 0
        limit = self.config.lookup_limit(len(seq.hashes), seq.num_tokens)
        return self.host.match(seq.hashes[gpu_hits:limit])

    def _register(self, seq: EngineSequence, stored: list[tuple[EngineSequence, list[int]]], now: float) -> None:
        """Make the newly completed full blocks of ``seq`` findable by hash (first writer wins)."""
        upto = self.config.stored_blocks(len(seq.hashes), seq.num_computed)
        if upto <= seq.registered:
            return
        new = self.pool.store(seq.hashes, seq.blocks, seq.registered, upto)
        seq.registered = upto
        if new:
            stored.append((seq, new))
            if self.host is not None and len(self.host):
                # Computed again on the GPU: the CPU copy goes, so that the tiers stay exclusive.
                gone = self.host.discard([seq.hashes[i] for i in new])
                if gone:
                    self.events.removed(gone, HOST, now)

    # -- scheduling ------------------------------------------------------------------------

    def schedule(self, now: float) -> Batch | None:
        """Plan the step starting at ``now`` (None when nothing is waiting or running)."""
        if not self.running and not self.waiting:
            return None
        bs = self._bs
        pool = self.pool
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
            while pool.num_free < need:
                victim = next((s for s in reversed(self.running) if id(s) not in taken and s is not seq), None)
                if victim is None:
                    return False
                self._preempt(victim)
                gone.add(id(victim))
            return True

        # 1. Running sequences: decodes first, then chunks of prompts still being computed.
        running = list(self.running)
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
        while not gone and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self._lookup(seq)
            n_hits = len(hits)
            n_host = self._host_hits(seq, n_hits)
            computed = (n_hits + n_host) * bs
            n = min(seq.num_tokens - computed, budget)
            need = -(-(computed + n) // bs) - n_hits
            touched = pool.unreferenced(hits)
            if need + touched > pool.num_free:
                break  # vLLM does not preempt running sequences for a waiting one
            self.waiting.popleft()
            if n_host:
                assert self.host is not None
                reloaded = seq.hashes[n_hits : n_hits + n_host]
                self.host.take(reloaded)  # before allocating: what the GPU evicts now may go to the CPU tier
                self.events.removed(reloaded, HOST, now)
            pool.touch(hits)
            seq.blocks = hits
            self._allocate(need, seq.blocks, now)
            seq.num_computed = computed
            seq.registered = n_hits
            reload_ms = cost.reload_ms(n_host * bs) if n_host else 0.0
            if seq.cached_tokens is None:
                seq.cached_tokens = computed
                self.stats.admitted += 1
                self.stats.prompt_tokens += seq.prompt_len
                self.stats.hit_tokens += computed
                self.stats.cpu_hit_tokens += n_host * bs
            self.stats.reload_time += reload_ms / 1000.0
            self.running.append(seq)
            taken.add(id(seq))
            scheduled.append((seq, n))
            budget -= n
            prefill_tokens += n
            step_ms += cost.prefill_ms(n, computed) + reload_ms

        if not scheduled:
            if self.running:
                raise RuntimeError(f"engine {self.name!r}: no running sequence could be scheduled.")
            if gone:
                # Everything was preempted: try again from the waiting queue at the same instant.
                return Batch(now, now, 0, [], 0, 0, len(gone))
            # The waiting head does not fit although nothing runs: the submit-time check prevents this.
            raise RuntimeError(f"engine {self.name!r}: the waiting request does not fit in an empty cache.")

        base = cost.decode_base_ms if decodes else cost.prefill_base_ms
        step_ms += base + decodes * cost.decode_per_seq_ms + cost.kv_read_ms_per_token * kv_context
        batch = Batch(now, now + step_ms / 1000.0, 1, scheduled, prefill_tokens, decodes, len(gone), d0=step_ms)
        # A decode-only step repeats unchanged until a sequence finishes or a request arrives, unless a
        # waiting sequence could be admitted meanwhile: it is blocked by seats or budget (which stay
        # so), not by memory (evictions can shorten its cache hit and let a budget-capped chunk fit).
        blocked = not self.waiting or len(self.running) >= self.config.max_num_seqs or budget <= 0
        if self.coalesce_decodes and blocked and decodes == len(scheduled) == len(self.running) and not gone:
            self._plan_run(batch)
        return batch

    def _plan_run(self, batch: Batch) -> None:
        """Extend a decode-only step into a run of steps until the first sequence finishes."""
        running = self.running
        k = min(s.request.output_len - s.generated for s in running)
        if k <= 1:
            return
        bs = self._bs
        free = self.pool.num_free

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

    # -- completion ------------------------------------------------------------------------

    def complete(self, batch: Batch) -> StepResult:
        """Apply ``batch`` at its end: computed tokens, first and last tokens, blocks made findable."""
        end = batch.end
        steps = batch.steps
        stats = self.stats
        bs = self._bs
        first: list[EngineSequence] = []
        done: list[EngineSequence] = []
        stored: list[tuple[EngineSequence, list[int]]] = []
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
                self._register(seq, stored, end)
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
                self._register(seq, stored, end)
                if seq.generated >= seq.request.output_len:
                    seq.finish_time = end
                    done.append(seq)
        stats.steps += steps
        stats.busy_time += end - batch.start
        stats.prefill_tokens += batch.prefill_tokens
        stats.output_tokens += sampled
        if done:
            finished = {id(s) for s in done}
            self.running = [s for s in self.running if id(s) not in finished]
            for seq in done:
                self.pool.release(seq.blocks)
            stats.finished += len(done)
        if stored:
            self.events.stored(stored, end)
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
