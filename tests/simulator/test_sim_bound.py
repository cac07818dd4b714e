"""The hit-rate upper bound: the engine's own caching rules, and no strategy above it on any workload."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.plugins import PluginManager
from kvroute_simulator.driver import SimulationConfig, compare
from kvroute_simulator.engine import Engine, EngineConfig, EngineRequest, ideal_hit_tokens
from kvroute_simulator.tokens import TokenSeq
from kvroute_simulator.workloads import WORKLOADS, Arrival, make_workload

FIXTURES = Path(__file__).parent / "fixtures"

#: A Mooncake trace made for these tests: 80 lines whose hash ids come from six shared
#: families (so prefixes repeat), and line 41 with 135,155 tokens, over max_model_len.
SHARED_TRACE = FIXTURES / "mooncake_shared.jsonl"


def tokens(seed: int, n: int) -> tuple[int, ...]:
    """Return ``n`` deterministic word ids."""
    return tuple(random.Random(seed).choices(range(8, 32_000), k=n))


def served_alone(requests: list[EngineRequest], config: EngineConfig) -> tuple[int, int]:
    """Serve each request to completion, one at a time, on one engine; return its (hit, prompt) tokens."""
    engine = Engine(config, coalesce_decodes=False)
    now = 0.0
    for request in requests:
        if config.rejection(request) is not None:
            continue
        engine.submit(request, now)
        while (t := engine.next_event_time()) is not None:
            engine.step(t)
            now = t
        now += 1.0
    assert engine.stats.evicted_blocks == 0, "the engine must be large enough to keep everything"
    return engine.stats.hit_tokens, engine.stats.prompt_tokens


@st.composite
def request_lists(draw: st.DrawFn) -> list[EngineRequest]:
    """Requests that share pieces: conversations whose turns extend earlier prompts and answers, salts."""
    pieces = [TokenSeq.of(tokens(seed, draw(st.integers(1, 40)))) for seed in range(4)]
    requests: list[EngineRequest] = []
    conversations: list[TokenSeq] = []
    for i in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["piece", "turn", "fresh"]))
        if kind == "turn" and conversations:
            base = conversations[draw(st.integers(0, len(conversations) - 1))]
        elif kind == "piece":
            base = pieces[draw(st.integers(0, len(pieces) - 1))]
        else:
            base = TokenSeq.of(tokens(1000 + i, draw(st.integers(1, 30))))
        prompt = base.extend(tokens(2000 + i, draw(st.integers(0, 25))))
        output_len = draw(st.integers(1, 40))
        known = draw(st.booleans())
        answer = tokens(3000 + i, output_len) if known else None
        salt = draw(st.sampled_from([None, None, "tenant-a"]))
        requests.append(EngineRequest(f"r{i}", prompt, output_len, output_tokens=answer, extra_key=salt))
        if answer is not None:
            conversations.append(prompt.extend(answer))
    return requests


class TestIdealHitTokens:
    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(
        requests=request_lists(),
        block_size=st.sampled_from([4, 16]),
        prefix_caching=st.booleans(),
        max_model_len=st.sampled_from([60, 131_072]),
    )
    def test_equals_one_engine_that_keeps_everything(
        self, requests: list[EngineRequest], block_size: int, prefix_caching: bool, max_model_len: int
    ) -> None:
        """The bound is exactly what one engine that never evicts hits serving the requests in order, refusals aside."""
        config = EngineConfig(
            block_size=block_size,
            capacity_blocks=4096,
            enable_prefix_caching=prefix_caching,
            max_model_len=max_model_len,
        )
        assert ideal_hit_tokens(requests, config) == served_alone(requests, config)

    def test_a_turn_hits_the_previous_answer(self) -> None:
        """A turn whose prompt holds the previous prompt and answer hits both, as the engine cached them."""
        first = TokenSeq.of(tokens(1, 100))
        answer = tokens(2, 60)
        second = first.extend(answer).extend(tokens(3, 30))
        requests = [
            EngineRequest("t0", first, len(answer), output_tokens=answer),
            EngineRequest("t1", second, 10),
        ]
        # Turn 0 computed 100 + 60 - 1 = 159 tokens (the last sampled one never is): 9 full blocks.
        assert ideal_hit_tokens(requests) == (9 * 16, 100 + 190)
        assert served_alone(requests, EngineConfig()) == (9 * 16, 100 + 190)

    def test_refused_requests_count_nowhere(self) -> None:
        """A request over max_model_len adds neither hits nor prompt tokens, and leaves no block to hit."""
        shared = tokens(1, 64)
        requests = [
            EngineRequest("long", TokenSeq.of(shared + tokens(2, 100)), 10),
            EngineRequest("a", TokenSeq.of(shared + tokens(3, 10)), 10),
            EngineRequest("b", TokenSeq.of(shared + tokens(4, 10)), 10),
        ]
        assert ideal_hit_tokens(requests, EngineConfig(max_model_len=120)) == (64, 2 * 74)

    def test_no_hit_without_prefix_caching(self) -> None:
        """With prefix caching off the engine never hits, so neither does the bound."""
        prompt = TokenSeq.of(tokens(1, 100))
        requests = [EngineRequest(str(i), prompt, 5) for i in range(3)]
        assert ideal_hit_tokens(requests, EngineConfig(enable_prefix_caching=False)) == (0, 300)


SMALL_WORKLOADS: dict[str, dict[str, Any]] = {
    "long-prefix": {"groups": 12, "prefix_tokens": 1000, "requests": 150, "rate": 15.0},
    "hot-prefix": {"groups": 6, "prefix_tokens": 800, "requests": 150, "rate": 15.0},
    "short-prefix": {"groups": 8, "requests": 150, "rate": 15.0},
    "multi-turn": {"requests": 150, "rate": 2.0, "think_time": 3.0},
    "multi-turn-short": {"requests": 150, "rate": 2.0, "think_time": 3.0},
    "rag": {"documents": 40, "requests": 150, "rate": 10.0},
    "agentic": {"preamble_tokens": 1000, "tool_tokens": (50, 400), "requests": 150, "rate": 1.0, "fanout_share": 0.3},
    "trace": {"path": SHARED_TRACE},
}
STRATEGIES = ["random", "consistent-hash", "bounded-load", "least-outstanding", "p2c", "tokenizer-prefix"]
CASES = [
    *((name, options, SimulationConfig(instances=3)) for name, options in SMALL_WORKLOADS.items()),
    ("long-prefix", {"groups": 10, "prefix_tokens": 1000, "requests": 120, "concurrency": 8}, SimulationConfig()),
    ("multi-turn", {"requests": 150, "rate": 2.0, "think_time": 0.5}, SimulationConfig(instances=2, closed_loop=False)),
    (
        "rag",
        {"documents": 40, "requests": 150, "rate": 10.0},
        SimulationConfig(engine=EngineConfig(capacity_blocks=400)),
    ),
]


@pytest.fixture(scope="module")
def plugins() -> PluginManager:
    return PluginManager()


class TestNoStrategyBeatsTheBound:
    def test_every_built_in_workload_is_covered(self) -> None:
        """The cases below run every workload the simulator offers."""
        assert {name for name, _options, _config in CASES} == set(WORKLOADS)

    @pytest.mark.parametrize(("workload", "options", "config"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
    def test_hit_rate_at_most_the_bound(
        self, workload: str, options: dict[str, Any], config: SimulationConfig, plugins: PluginManager
    ) -> None:
        """Every strategy's hit rate is at most the bound, over the same accepted requests' prompt tokens."""
        arrivals: list[Arrival] = list(make_workload(workload, **options).arrivals())
        names = [name for name in STRATEGIES if name in plugins.strategies]
        assert {"random", "consistent-hash", "bounded-load"} <= set(names)
        comparison = compare(arrivals, names, config, workload=workload, plugins=plugins)
        assert 0 < comparison.upper_bound_hit_rate < 1
        for result in comparison.results:
            served = sum(i.prompt_tokens for i in result.instances)
            assert served == comparison.prompt_tokens, result.strategy
            assert result.rejected == comparison.rejected
            assert result.hit_rate <= comparison.upper_bound_hit_rate + 1e-12, (
                f"{result.strategy} hit {result.hit_rate:.4f} above the bound {comparison.upper_bound_hit_rate:.4f}"
            )

    def test_the_trace_fixture_has_a_refused_request(self, plugins: PluginManager) -> None:
        """The trace case covers a request over max_model_len: refused by every strategy, outside the bound."""
        arrivals = list(make_workload("trace", path=SHARED_TRACE).arrivals())
        comparison = compare(arrivals, ["random"], SimulationConfig(instances=3), plugins=plugins)
        assert comparison.rejected == 1
        assert comparison.results[0].completed == len(arrivals) - 1
