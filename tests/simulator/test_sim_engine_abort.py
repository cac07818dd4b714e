"""Aborting a request in the simulator's engine model: blocks released, prefix blocks unpinned, steps unaffected."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvroute_simulator.engine import Engine, EngineConfig, EngineRequest, EngineSequence
from kvroute_simulator.tokens import TokenSeq

BS = 16


def tokens(seed: int, n: int) -> tuple[int, ...]:
    """Return ``n`` deterministic word ids."""
    return tuple(random.Random(seed).choices(range(8, 32_000), k=n))


def request(rid: str, prompt: TokenSeq | tuple[int, ...], output_len: int = 1) -> EngineRequest:
    return EngineRequest(rid, prompt if isinstance(prompt, TokenSeq) else TokenSeq.of(prompt), output_len)


def drain(engine: Engine, until: float | None = None) -> None:
    """Step ``engine`` until idle (or until ``until``)."""
    while (t := engine.next_event_time()) is not None and (until is None or t <= until):
        engine.step(t)


def step_until(engine: Engine, done: object) -> float:
    """Step until ``done()`` holds; returns the time of the last step."""
    t = 0.0
    while not done():  # type: ignore[operator]
        t = engine.next_event_time()  # type: ignore[assignment]
        assert t is not None, "the engine went idle first"
        engine.step(t)
    return t


def small(**kw: int) -> Engine:
    """A small engine stepped one decode at a time (so a test can stop between any two tokens)."""
    return Engine(EngineConfig(capacity_blocks=kw.pop("blocks", 64), **kw), name="t", coalesce_decodes=False)


class TestAbortWaiting:
    def test_a_waiting_request_leaves_without_running(self) -> None:
        """A queued request that is aborted is never admitted; the running one is unaffected."""
        engine = small(max_num_seqs=1)
        a = engine.submit(request("a", tokens(1, 40), 5), 0.0)
        b = engine.submit(request("b", tokens(2, 40), 5), 0.0)
        assert engine.num_waiting == 1 or engine.num_running == 0
        assert engine.abort(b, 0.0) is True
        assert b.aborted and not b.finished and engine.in_flight == 1 and engine.stats.aborted == 1
        drain(engine)
        assert a.finished and b.first_token_time is None and engine.stats.admitted == 1
        assert engine.audit() == []

    def test_aborting_a_queued_request_changes_nothing_for_the_others(self) -> None:
        """Submitting and at once aborting a request gives the other requests the timings they had without it."""

        def run(with_ghost: bool) -> list[tuple[float | None, float | None, int | None]]:
            engine = small(blocks=40, max_num_seqs=2, max_num_batched_tokens=64)
            seqs = []
            for i in range(6):
                now = 0.01 * i
                drain(engine, until=now)
                if with_ghost:
                    ghost = engine.submit(request(f"g{i}", tokens(100 + i, 50), 8), now)
                    assert engine.abort(ghost, now)
                seqs.append(engine.submit(request(f"r{i}", tokens(i % 2, 60) + tokens(10 + i, 20), 6), now))
            drain(engine)
            assert engine.audit() == []
            return [(s.first_token_time, s.finish_time, s.cached_tokens) for s in seqs]

        assert run(True) == run(False)


class TestAbortRunning:
    def test_its_blocks_are_freed_at_once(self) -> None:
        """Aborting a decoding request releases every block it held and its batch seat."""
        engine = small(blocks=64)
        a = engine.submit(request("a", tokens(3, 100), 50), 0.0)
        now = step_until(engine, lambda: a.generated >= 3)
        held = len(a.blocks)
        assert held == -(-a.num_computed // BS) and engine.num_free_blocks == 64 - held
        assert engine.abort(a, now)
        assert engine.num_free_blocks == 64 and engine.kv_usage == 0.0 and engine.num_running == 0
        assert a.blocks == [] and engine.audit() == []
        drain(engine)
        assert not a.finished and a.generated == 3

    def test_blocks_it_filled_stay_findable_until_evicted(self) -> None:
        """The full blocks an aborted request computed stay in the prefix cache: its prompt hits again."""
        engine = small(blocks=64)
        prompt = tokens(4, 100)
        a = engine.submit(request("a", prompt, 50), 0.0)
        now = step_until(engine, lambda: a.generated >= 1)
        engine.abort(a, now)
        b = engine.submit(request("b", prompt, 2), now)
        drain(engine)
        assert b.cached_tokens == (len(prompt) - 1) // BS * BS

    def test_shared_prefix_blocks_are_unpinned_then_evictable(self) -> None:
        """Blocks shared with another running request stay pinned by it; once no one holds them they can be evicted."""
        engine = small(blocks=40)
        prefix = tokens(5, 64)  # 4 full blocks
        warm = engine.submit(request("warm", prefix + tokens(50, 4), 1), 0.0)
        drain(engine)
        assert warm.finished and engine.num_free_blocks == 40
        a = engine.submit(request("a", prefix + tokens(51, 40), 200), 1.0)
        b = engine.submit(request("b", prefix + tokens(52, 40), 200), 1.0)
        now = step_until(engine, lambda: a.generated >= 1 and b.generated >= 1)
        assert a.cached_tokens == b.cached_tokens == 64
        private_a = len(a.blocks) - 4
        free_before = engine.num_free_blocks
        engine.abort(a, now)
        assert engine.num_free_blocks == free_before + private_a  # the 4 shared blocks are still b's
        engine.abort(b, now)
        assert engine.num_free_blocks == 40 and engine.audit() == []
        probe = request("probe", prefix + tokens(53, 10))
        assert engine.cached_prefix_tokens(probe) == 64  # unpinned, not dropped
        big = engine.submit(request("big", tokens(6, 40 * BS - 1), 1), now)  # prompt + output fill every block
        drain(engine)
        assert big.finished and engine.cached_prefix_tokens(probe) == 0  # evicted like any free block
        assert engine.audit() == []

    def test_the_step_in_progress_keeps_its_time_but_not_the_tokens(self) -> None:
        """Aborted during a step that prefills it and another request: the step ends as planned, only the other
        advances."""
        engine = small(blocks=64)
        a = engine.submit(request("a", tokens(7, 90), 4), 0.0)
        b = engine.submit(request("b", tokens(8, 90), 4), 0.0)
        engine.step(0.0)  # the wake-up: both are scheduled in the step now in progress
        end = engine.next_event_time()
        assert end is not None and end > 0
        engine.abort(a, end / 2)
        assert engine.next_event_time() == end
        engine.step(end)
        assert b.generated == 1 and a.generated == 0 and a.first_token_time is None
        drain(engine)
        assert b.finished and engine.audit() == []

    def test_a_decode_run_is_cut_at_the_next_step_boundary(self) -> None:
        """Aborting one of two sequences in a coalesced decode run ends the run at the first boundary after now."""
        engine = Engine(EngineConfig(capacity_blocks=200), coalesce_decodes=True)
        a = engine.submit(request("a", tokens(9, 40), 400), 0.0)
        b = engine.submit(request("b", tokens(10, 40), 400), 0.0)
        step_until(engine, lambda: a.generated >= 1)
        run_end = engine.next_event_time()
        assert run_end is not None
        start = engine._batch.start  # type: ignore[union-attr]
        now = start + (run_end - start) / 3
        engine.abort(b, now)
        cut = engine.next_event_time()
        assert cut is not None and now <= cut < run_end
        drain(engine)
        assert a.finished and a.generated == 400 and not b.finished and engine.audit() == []

    def test_an_aborted_seat_goes_to_the_next_waiting_request(self) -> None:
        """With one seat, aborting the running request lets the queued one start at the next step, not after it."""

        def ttft_of_second(abort_first: bool) -> float:
            engine = small(blocks=64, max_num_seqs=1)
            first = engine.submit(request("a", tokens(11, 40), 300), 0.0)
            second = engine.submit(request("b", tokens(12, 40), 2), 0.0)
            now = step_until(engine, lambda: first.generated >= 2)
            if abort_first:
                engine.abort(first, now)
            drain(engine)
            assert second.ttft is not None
            return second.ttft

        assert ttft_of_second(True) < ttft_of_second(False) / 10


class TestAbortArguments:
    def test_finished_already_aborted_or_unknown_answer_false(self) -> None:
        """abort() is a no-op returning False for a finished, an aborted or an unknown request."""
        engine = small()
        done = engine.submit(request("done", tokens(13, 20), 1), 0.0)
        drain(engine)
        assert done.finished and engine.abort(done, 1.0) is False
        live = engine.submit(request("live", tokens(14, 20), 50), 1.0)
        assert engine.abort("live", 1.0) is True and live.aborted
        assert engine.abort(live, 1.0) is False and engine.abort("nobody", 1.0) is False
        assert engine.stats.aborted == 1

    def test_abort_past_the_pending_event_is_refused(self) -> None:
        """Like submit, abort must not be called past next_event_time() (step first)."""
        engine = small()
        seq = engine.submit(request("a", tokens(15, 30), 20), 0.0)
        engine.step(0.0)
        end = engine.next_event_time()
        assert end is not None
        with pytest.raises(ValueError, match="past next_event_time"):
            engine.abort(seq, end + 1.0)


class TestAbortProperties:
    @given(seed=st.integers(0, 10_000), aborts=st.lists(st.integers(0, 9), max_size=6, unique=True))
    @settings(max_examples=40, deadline=None)
    def test_every_block_comes_back(self, seed: int, aborts: list[int]) -> None:
        """Whatever is aborted and when, the pool stays consistent and the engine ends with every block free."""
        rng = random.Random(seed)
        engine = Engine(
            EngineConfig(capacity_blocks=60, max_num_seqs=3, max_num_batched_tokens=96),
            coalesce_decodes=rng.random() < 0.5,
        )
        shared = tokens(seed, 48)
        seqs: list[EngineSequence] = []
        now = 0.0
        for i in range(10):
            now += rng.uniform(0, 0.05)
            drain(engine, until=now)
            prompt = (shared if rng.random() < 0.6 else ()) + tokens(seed * 31 + i, rng.randint(1, 60))
            seqs.append(engine.submit(request(f"r{i}", prompt, rng.randint(1, 40)), now))
            for j in aborts:
                if j <= i and rng.random() < 0.3:
                    engine.abort(seqs[j], now)
            assert engine.audit() == []
        drain(engine)
        assert all(s.finished != s.aborted for s in seqs)
        assert engine.in_flight == 0 and engine.num_free_blocks == 60 and engine.audit() == []


class AbortMachine(RuleBasedStateMachine):
    """Random submits, steps and aborts on a small cache keep the block pool and the scheduler consistent."""

    @initialize(
        blocks=st.integers(30, 120), budget=st.integers(16, 128), seats=st.integers(1, 4), coalesce=st.booleans()
    )
    def setup(self, blocks: int, budget: int, seats: int, coalesce: bool) -> None:
        config = EngineConfig(capacity_blocks=blocks, max_num_batched_tokens=budget, max_num_seqs=seats)
        self.engine = Engine(config, coalesce_decodes=coalesce)
        self.blocks = blocks
        self.now = 0.0
        self.prefixes = [TokenSeq.of(tokens(700 + i, 48)) for i in range(2)]
        self.seqs: list[EngineSequence] = []

    @rule(prefix=st.integers(0, 1), suffix=st.integers(0, 80), output=st.integers(1, 50), delay=st.floats(0, 0.1))
    def submit(self, prefix: int, suffix: int, output: int, delay: float) -> None:
        self.now += delay
        drain(self.engine, until=self.now)
        prompt = self.prefixes[prefix].extend(tokens(len(self.seqs) + 1, suffix))
        self.seqs.append(self.engine.submit(request(f"r{len(self.seqs)}", prompt, output), self.now))

    @rule()
    def step(self) -> None:
        t = self.engine.next_event_time()
        if t is not None:
            self.now = max(self.now, t)
            self.engine.step(t)

    @precondition(lambda self: hasattr(self, "engine") and any(not (s.finished or s.aborted) for s in self.seqs))
    @rule(pick=st.integers(0, 1000), fraction=st.floats(0, 1))
    def abort(self, pick: int, fraction: float) -> None:
        live = [s for s in self.seqs if not (s.finished or s.aborted)]
        t = self.engine.next_event_time()
        if t is not None:
            self.now = max(self.now, self.now + (t - self.now) * fraction)
        assert self.engine.abort(live[pick % len(live)], self.now) is True

    @rule()
    def finish_all(self) -> None:
        drain(self.engine)
        assert all(s.finished or s.aborted for s in self.seqs)
        assert self.engine.in_flight == 0 and self.engine.num_free_blocks == self.blocks

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "engine"):
            assert self.engine.audit() == []
            assert self.engine.in_flight == sum(not (s.finished or s.aborted) for s in self.seqs)


TestAbortMachine = AbortMachine.TestCase
TestAbortMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
