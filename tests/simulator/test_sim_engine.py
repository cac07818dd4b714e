"""The simulator's engine model: KV cache reuse and eviction, chunked prefill, costs and timings."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvroute_simulator.engine import (
    DEFAULT_CAPACITY_BLOCKS,
    LLAMA_3_1_70B,
    CostModel,
    Engine,
    EngineConfig,
    EngineRequest,
    EngineSequence,
    StepResult,
    ideal_hit_tokens,
    kv_capacity_blocks,
)
from kvroute_simulator.tokens import TokenSeq


def tokens(seed: int, n: int) -> tuple[int, ...]:
    """Return ``n`` deterministic word ids."""
    return tuple(random.Random(seed).choices(range(8, 32_000), k=n))


def request(rid: str, prompt: TokenSeq | tuple[int, ...], output_len: int = 1, **kw: object) -> EngineRequest:
    seq = prompt if isinstance(prompt, TokenSeq) else TokenSeq.of(prompt)
    return EngineRequest(rid, seq, output_len, **kw)  # type: ignore[arg-type]


def drain(engine: Engine, until: float | None = None) -> list[StepResult]:
    """Step ``engine`` until idle (or until ``until``); return the step results."""
    results = []
    while (t := engine.next_event_time()) is not None and (until is None or t <= until):
        results.append(engine.step(t))
    return results


def serve(engine: Engine, req: EngineRequest, now: float) -> EngineSequence:
    """Submit ``req`` at ``now`` and run the engine until idle."""
    seq = engine.submit(req, now)
    drain(engine)
    return seq


class TestCapacity:
    def test_llama_70b_kv_bytes_per_token(self) -> None:
        """Llama-3.1-70B holds 80 x 8 x 128 x 2 x 2 = 327,680 bytes of KV per token."""
        assert LLAMA_3_1_70B.kv_bytes_per_token == 327_680

    def test_default_capacity_on_8_h100(self) -> None:
        """8 x 80 GB at 0.9 minus 140 GB of weights leaves 83,160 blocks of 16 tokens (1,330,560 tokens)."""
        assert DEFAULT_CAPACITY_BLOCKS == kv_capacity_blocks() == 83_160
        assert EngineConfig().capacity_tokens == 1_330_560

    def test_invalid_config_names_the_field(self) -> None:
        """A non-positive setting is rejected with its name and value."""
        with pytest.raises(ValueError, match=r"'max_num_seqs' must be a positive integer \(got 0\)"):
            EngineConfig(max_num_seqs=0)


class TestCostModel:
    def test_cold_prefill_matches_the_calibration(self) -> None:
        """A cold prompt of L tokens costs 9.8 + 0.040 L + 5.6e-7 L (L + 1) ms."""
        cost = CostModel()
        for n in (1, 1000, 8000):
            assert cost.cold_prefill_ms(n) == pytest.approx(9.8 + 0.040 * n + 5.6e-7 * n * (n + 1))

    def test_attention_over_a_cached_prefix_costs_more(self) -> None:
        """A chunk attending over a long cached prefix costs more than the same chunk cold."""
        cost = CostModel()
        assert cost.prefill_ms(200, cached_tokens=8000) > cost.prefill_ms(200) + 1.0

    def test_decode_cost_grows_with_context(self) -> None:
        """Decoding with a longer context reads more KV and costs more."""
        cost = CostModel()
        assert cost.decode_ms(8000) > cost.decode_ms(100)


class TestPrefixReuse:
    def test_repeated_prompt_hits(self) -> None:
        """A prompt served twice hits the cache for every full block but the last token's."""
        engine = Engine()
        prompt = tokens(1, 1000)
        first = serve(engine, request("a", prompt), 0.0)
        second = serve(engine, request("b", prompt), 10.0)
        assert first.cached_tokens == 0
        assert second.cached_tokens == (1000 - 1) // 16 * 16
        assert engine.stats.hit_tokens == second.cached_tokens
        assert engine.stats.prompt_tokens == 2000

    def test_shared_prefix_hits_up_to_the_divergence(self) -> None:
        """Two prompts sharing 320 tokens and then differing reuse exactly the 20 shared blocks."""
        engine = Engine()
        shared = TokenSeq.of(tokens(1, 320))
        serve(engine, request("a", shared.extend(tokens(2, 100))), 0.0)
        second = serve(engine, request("b", shared.extend(tokens(3, 100))), 10.0)
        assert second.cached_tokens == 320

    def test_fully_cached_prompt_recomputes_its_last_token(self) -> None:
        """A prompt of exactly 4 blocks reuses 3: at least one token is always computed."""
        engine = Engine()
        prompt = tokens(1, 64)
        serve(engine, request("a", prompt), 0.0)
        assert serve(engine, request("b", prompt), 10.0).cached_tokens == 48

    def test_extra_key_separates_caches(self) -> None:
        """The same prompt under another cache_salt or LoRA does not hit."""
        engine = Engine()
        prompt = tokens(1, 500)
        serve(engine, request("a", prompt, extra_key="tenant-a"), 0.0)
        other = serve(engine, request("b", prompt, extra_key="tenant-b"), 10.0)
        same = serve(engine, request("c", prompt, extra_key="tenant-a"), 20.0)
        assert other.cached_tokens == 0
        assert same.cached_tokens > 0

    def test_known_output_tokens_are_cached_for_the_next_turn(self) -> None:
        """With its answer known, a turn's output blocks are hit by the next turn's prompt."""
        engine = Engine()
        prompt = TokenSeq.of(tokens(1, 100))
        answer = tokens(2, 60)
        serve(engine, request("t0", prompt, 60, output_tokens=answer), 0.0)
        follow = prompt.extend(answer).extend(tokens(3, 40))
        second = serve(engine, request("t1", follow), 10.0)
        # 159 tokens were computed in turn 0 (the last sampled token never is): 9 full blocks.
        assert second.cached_tokens == 144

    def test_disabled_prefix_caching_never_hits(self) -> None:
        """With enable_prefix_caching off, a repeated prompt is computed again."""
        engine = Engine(EngineConfig(enable_prefix_caching=False))
        prompt = tokens(1, 500)
        serve(engine, request("a", prompt), 0.0)
        assert serve(engine, request("b", prompt), 10.0).cached_tokens == 0

    def test_ideal_hit_tokens_counts_every_earlier_prefix(self) -> None:
        """The upper bound counts the blocks any earlier request left, as one infinite cache would."""
        shared = TokenSeq.of(tokens(1, 160))
        reqs = [request(str(i), shared.extend(tokens(10 + i, 50))) for i in range(3)]
        hits, total = ideal_hit_tokens(reqs)
        assert (hits, total) == (2 * 160, 3 * 210)


class TestEviction:
    def small_engine(self, blocks: int) -> Engine:
        return Engine(EngineConfig(capacity_blocks=blocks, block_size=16))

    def test_lru_block_is_evicted_first(self) -> None:
        """When space runs out, the least recently used unreferenced prefix is evicted, not a recently hit one."""
        engine = self.small_engine(40)
        a, b, c = (tokens(i, 160 + 1) for i in (1, 2, 3))  # 10 full blocks + 1 token each
        serve(engine, request("a", a), 0.0)
        serve(engine, request("b", b), 1.0)
        serve(engine, request("a2", a), 2.0)  # A is now more recent than B
        serve(engine, request("c", c), 3.0)
        serve(engine, request("d", tokens(4, 160 + 1)), 4.0)  # needs 11 blocks: evicts B's first
        assert serve(engine, request("a3", a), 5.0).cached_tokens == 160
        assert serve(engine, request("b2", b), 6.0).cached_tokens < 160
        assert engine.stats.evicted_blocks > 0

    def test_a_finished_sequence_loses_its_last_blocks_first(self) -> None:
        """Blocks are freed last-to-first, so eviction trims a cached prompt from its end and keeps its prefix."""
        engine = self.small_engine(12)
        prompt = tokens(1, 161)  # 10 full blocks + 1 token: 11 blocks
        serve(engine, request("a", prompt), 0.0)
        serve(engine, request("b", tokens(2, 33)), 1.0)  # 3 blocks: 1 never used + 2 evicted
        assert serve(engine, request("a2", prompt), 2.0).cached_tokens == 9 * 16

    def test_blocks_of_running_sequences_are_never_evicted(self) -> None:
        """A long-running sequence's prompt blocks stay cached while other prompts churn through the cache."""
        engine = self.small_engine(64)
        pinned = engine.submit(request("pinned", tokens(1, 320), output_len=300), 0.0)
        now = 0.0
        for i in range(20):
            now += 0.05
            drain(engine, until=now)
            engine.submit(request(f"churn{i}", tokens(100 + i, 300)), now)
            drain(engine, until=now + 0.04)
            assert not engine.audit()
            assert all(engine.is_cached(h) for h in pinned.hashes[:20])
        assert engine.stats.evicted_blocks > 0
        assert not pinned.finished
        assert pinned.preemptions == 0

    def test_out_of_blocks_preempts_the_latest_sequence(self) -> None:
        """When decodes need blocks that are not there, the most recently admitted sequence is preempted and later
        finishes."""
        engine = self.small_engine(24)
        first = engine.submit(request("first", tokens(1, 150), output_len=150), 0.0)
        second = engine.submit(request("second", tokens(2, 150), output_len=150), 0.0)
        drain(engine)
        assert second.preemptions >= 1
        assert first.preemptions == 0
        assert first.finished and second.finished
        assert engine.stats.preemptions == second.preemptions

    def test_request_larger_than_the_cache_is_rejected(self) -> None:
        """A request whose prompt and output cannot fit in the whole cache is refused at submit."""
        engine = self.small_engine(8)
        with pytest.raises(ValueError, match="more than the cache's capacity_blocks=8"):
            engine.submit(request("big", tokens(1, 200)), 0.0)


class TestChunkedPrefill:
    def test_long_prompt_is_split_by_the_token_budget(self) -> None:
        """A 300-token prompt under a 64-token budget takes 5 steps of at most 64 tokens."""
        engine = Engine(EngineConfig(max_num_batched_tokens=64))
        seq = engine.submit(request("a", tokens(1, 300)), 0.0)
        results = [r for r in drain(engine) if r.steps]
        assert [r.prefill_tokens for r in results] == [64, 64, 64, 64, 44]
        assert seq.first_token_time == results[-1].end

    def test_decodes_take_the_budget_first(self) -> None:
        """While two sequences decode, a new prompt's chunks get the budget minus two tokens."""
        engine = Engine(EngineConfig(max_num_batched_tokens=64))
        engine.submit(request("d1", tokens(1, 10), output_len=500), 0.0)
        engine.submit(request("d2", tokens(2, 10), output_len=500), 0.0)
        drain(engine, until=0.05)
        engine.submit(request("p", tokens(3, 300)), 0.05)
        results = drain(engine, until=0.6)
        mixed = [r for r in results if r.prefill_tokens]
        assert mixed[0].decode_tokens == 2
        assert all(r.prefill_tokens + r.decode_tokens <= 64 for r in results if r.steps == 1)
        assert [r.prefill_tokens for r in mixed] == [62, 62, 62, 62, 52]

    def test_waiting_requests_are_admitted_first_come_first_served(self) -> None:
        """With one seat, requests get their first token in arrival order."""
        engine = Engine(EngineConfig(max_num_seqs=1))
        seqs = [engine.submit(request(f"r{i}", tokens(i, 100), output_len=5), 0.0) for i in range(4)]
        drain(engine)
        times = [s.first_token_time for s in seqs]
        assert times == sorted(times)
        assert all(b is not None and a is not None and b > a for a, b in itertools.pairwise(times))

    @settings(max_examples=30)
    @given(
        budget=st.integers(16, 600),
        seats=st.integers(1, 8),
        lengths=st.lists(st.integers(1, 900), min_size=1, max_size=8),
    )
    def test_every_step_respects_budget_and_seats(self, budget: int, seats: int, lengths: list[int]) -> None:
        """No step computes more tokens than max_num_batched_tokens, and every request finishes."""
        engine = Engine(EngineConfig(max_num_batched_tokens=budget, max_num_seqs=seats, capacity_blocks=400))
        seqs = [engine.submit(request(f"r{i}", tokens(i, n), output_len=3), 0.0) for i, n in enumerate(lengths)]
        while (t := engine.next_event_time()) is not None:
            result = engine.step(t)
            if result.steps == 1:
                assert result.prefill_tokens + result.decode_tokens <= budget
            assert engine.num_running <= seats
        assert all(s.finished for s in seqs)


class TestTimings:
    def test_cached_prompt_ttft_far_below_cold(self) -> None:
        """An 8,000-token prompt whose prefix is cached gets its first token over 10x sooner than cold."""
        engine = Engine()
        prefix = TokenSeq.of(tokens(1, 8000))
        cold = serve(engine, request("cold", prefix.extend(tokens(2, 200))), 0.0)
        warm = serve(engine, request("warm", prefix.extend(tokens(3, 200))), 10.0)
        assert cold.ttft is not None and warm.ttft is not None
        assert warm.ttft * 10 < cold.ttft
        assert 0.3 < cold.ttft < 0.5  # 9.8 + 0.04 L + 5.6e-7 L^2 ms for L = 8,204 tokens

    def test_ttft_ends_at_the_step_that_samples_the_first_token(self) -> None:
        """TTFT is arrival to the end of the prefill step, including waiting for the step in progress."""
        engine = Engine()
        engine.submit(request("busy", tokens(1, 4000)), 0.0)
        drain(engine, until=0.01)
        late = engine.submit(request("late", tokens(2, 100)), 0.01)
        drain(engine)
        busy_end = CostModel().cold_prefill_ms(4000) / 1000
        assert late.first_token_time == pytest.approx(busy_end + CostModel().cold_prefill_ms(100) / 1000)
        assert late.ttft == pytest.approx(late.first_token_time - 0.01)

    def test_arrival_cuts_a_decode_run_at_the_next_step_boundary(self) -> None:
        """A request arriving during a long decode-only stretch starts at the first step boundary after it."""
        engine = Engine()
        engine.submit(request("decoder", tokens(1, 50), output_len=1000), 0.0)
        drain(engine, until=0.2)
        before = engine.next_event_time()
        assert before is not None and before > 5.0  # one coalesced run up to the finish
        newcomer = engine.submit(request("new", tokens(2, 100)), 0.5)
        cut = engine.next_event_time()
        assert cut is not None and 0.5 <= cut < 0.5 + 0.02
        drain(engine)
        assert newcomer.first_token_time is not None
        assert 0.5 < newcomer.first_token_time < cut + 0.03

    def test_step_must_be_called_at_the_event_time(self) -> None:
        """Calling step at another time than next_event_time is a driver bug and raises."""
        engine = Engine()
        engine.submit(request("a", tokens(1, 10)), 0.0)
        with pytest.raises(ValueError, match="next_event_time"):
            engine.step(5.0)

    def test_submit_past_a_pending_event_raises(self) -> None:
        """Submitting later than a step that has not been completed is a driver bug and raises."""
        engine = Engine()
        engine.submit(request("a", tokens(1, 10)), 0.0)
        with pytest.raises(ValueError, match="call step"):
            engine.submit(request("b", tokens(2, 10)), 1.0)

    @settings(max_examples=25)
    @given(
        seed=st.integers(0, 10_000),
        n=st.integers(1, 12),
        blocks=st.sampled_from([60, 120, 4000]),
    )
    def test_coalesced_decodes_match_step_by_step(self, seed: int, n: int, blocks: int) -> None:
        """Coalescing decode-only steps gives the same first-token and finish times as stepping one by one."""
        rng = random.Random(seed)
        shared = TokenSeq.of(tokens(seed, 64))
        reqs = [
            (
                rng.uniform(0, 3),
                request(f"r{i}", shared.extend(tokens(seed + i + 1, rng.randint(1, 200))), rng.randint(1, 120)),
            )
            for i in range(n)
        ]
        reqs.sort(key=lambda x: x[0])
        outcomes = []
        for coalesce in (True, False):
            engine = Engine(EngineConfig(capacity_blocks=blocks, max_num_batched_tokens=128), coalesce_decodes=coalesce)
            seqs = []
            for at, req in reqs:
                drain(engine, until=at)
                seqs.append(engine.submit(req, at))
            drain(engine)
            outcomes.append([(s.first_token_time, s.finish_time, s.cached_tokens) for s in seqs])
            stats = engine.stats
            outcomes.append([stats.steps, stats.output_tokens, stats.hit_tokens, stats.preemptions])
        assert outcomes[1] == outcomes[3]
        for (f1, e1, c1), (f2, e2, c2) in zip(outcomes[0], outcomes[2], strict=True):
            assert f1 == pytest.approx(f2, rel=1e-9) and e1 == pytest.approx(e2, rel=1e-9) and c1 == c2


class EngineMachine(RuleBasedStateMachine):
    """Random submits and steps on a small cache keep the block pool consistent."""

    @initialize(blocks=st.integers(30, 200), budget=st.integers(16, 256), seats=st.integers(1, 6))
    def setup(self, blocks: int, budget: int, seats: int) -> None:
        self.engine = Engine(EngineConfig(capacity_blocks=blocks, max_num_batched_tokens=budget, max_num_seqs=seats))
        self.now = 0.0
        self.prefixes = [TokenSeq.of(tokens(900 + i, 80)) for i in range(3)]
        self.seqs: list[EngineSequence] = []
        self.count = 0

    @rule(prefix=st.integers(0, 2), suffix=st.integers(0, 100), output=st.integers(1, 60), delay=st.floats(0, 0.2))
    def submit(self, prefix: int, suffix: int, output: int, delay: float) -> None:
        self.now += delay
        drain(self.engine, until=self.now)
        self.count += 1
        prompt = self.prefixes[prefix].extend(tokens(self.count, suffix))
        self.seqs.append(self.engine.submit(request(f"r{self.count}", prompt, output), self.now))

    @rule()
    def step(self) -> None:
        t = self.engine.next_event_time()
        if t is not None:
            self.now = max(self.now, t)
            self.engine.step(t)

    @rule()
    def finish_all(self) -> None:
        drain(self.engine)
        assert all(s.finished for s in self.seqs)
        assert self.engine.in_flight == 0

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "engine"):
            assert self.engine.audit() == []


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
