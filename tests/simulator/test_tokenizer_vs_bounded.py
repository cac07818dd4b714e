"""tokenizer-prefix against bounded-load on small seeded versions of every workload and of Mooncake traces.

tokenizer-prefix must reuse at least as much as bounded-load, and keep its busiest and idlest
instance within the same load bound. The one thing it pays that bounded-load may not is a *hot
head* (a prefix that more than one instance's share of the requests start with) computed once on
every instance instead of on one: bounded-load, keying on it, can put that whole share on one
instance (52.8 % of hot-prefix's requests here). So the hit rate may trail by at most that
replication cost, ``block_size * (instances - 1)`` tokens per hot block over the prompt tokens,
computed below from the arrivals themselves (zero when no prefix is hot).
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvroute_simulator.driver import Comparison, SimulationConfig, compare
from kvroute_simulator.workloads import WORKLOADS, Arrival, make_workload

FIXTURES = Path(__file__).parent / "fixtures"
#: Requests per generated workload: small enough for a test, large enough for families to repeat.
REQUESTS = 400
INSTANCES = 7
#: Per-workload options on top of ``requests``: long-prefix's 360 groups would barely repeat in 400 requests.
OPTIONS: dict[str, dict[str, Any]] = {"long-prefix": {"groups": 60}, "short-prefix": {"requests": 300}}
TRACES = ("trace-families", "trace-shared-head")


def shared_head_trace(path: Path, requests: int = 300, seed: int = 0) -> Path:
    """A Mooncake trace shaped like a production one: 80 % of requests start with the same 4 blocks."""
    rng = random.Random(seed)
    families = [[1000 + 10 * f + i for i in range(rng.randint(1, 4))] for f in range(30)]
    unique, stamp, lines = 100_000, 0.0, []
    for _ in range(requests):
        ids = [0, 1, 2, 3] if rng.random() < 0.8 else []
        ids += rng.choice(families)
        for _ in range(rng.randint(0, 2)):
            ids.append(unique)
            unique += 1
        stamp += rng.expovariate(4.0) * 1000
        record = {
            "timestamp": int(stamp),
            "input_length": len(ids) * 512 - rng.randint(0, 400),
            "output_length": rng.randint(20, 200),
            "hash_ids": ids,
        }
        lines.append(json.dumps(record) + "\n")
    path.write_text("".join(lines))
    return path


def case_arrivals(name: str, tmp: Path) -> tuple[list[Arrival], int]:
    """The arrivals of one case and the instances it runs on."""
    if name == "trace-families":  # six families of shared hash ids (tests/simulator's fixture)
        return list(make_workload("trace", path=FIXTURES / "mooncake_shared.jsonl").arrivals()), 4
    if name == "trace-shared-head":
        path = shared_head_trace(tmp / "shared_head.jsonl")
        return list(make_workload("trace", path=path).arrivals()), 8
    options = {"requests": REQUESTS, "seed": 0, **OPTIONS.get(name, {})}
    return list(make_workload(name, **options).arrivals()), INSTANCES


def hot_head_allowance(arrivals: list[Arrival], config: SimulationConfig, prompt_tokens: int) -> float:
    """Hit rate lost by computing every hot block once per instance: hot blocks * block_size * (instances - 1)."""
    size = config.engine.block_size
    counts: dict[int, int] = {}
    for arrival in arrivals:
        tokens = arrival.prompt.to_tuple()
        chain = hash(arrival.extra_key)
        for start in range(0, len(tokens) - size + 1, size):
            chain = hash((chain, tokens[start : start + size]))
            counts[chain] = counts.get(chain, 0) + 1
    hot = sum(1 for count in counts.values() if count * config.instances > len(arrivals))
    return hot * size * (config.instances - 1) / prompt_tokens


@functools.cache
def run(name: str, tmp: Path) -> tuple[Comparison, float]:
    """bounded-load (hash placement with bounded loads) and tokenizer-prefix (default options) over one case, and
    its hot-head allowance.

    bounded-load runs with ``share_factor=off``: its share bound (issues 23 and 24) also balances the recent
    requests below the in-flight cap, which tokenizer-prefix does not claim; the reference here is hash
    placement under the same load bound, as when these tests were written.
    """
    arrivals, instances = case_arrivals(name, tmp)
    config = SimulationConfig(instances=instances)
    options = {"bounded-load": {"share_factor": "off"}}
    comparison = compare(arrivals, ["bounded-load", "tokenizer-prefix"], config, options=options, workload=name)
    return comparison, hot_head_allowance(arrivals, config, comparison.prompt_tokens)


CASES = [*(name for name in WORKLOADS if name != "trace"), *TRACES]
#: Known gaps in the hit rate, with what was measured (the xfail is strict: remove it when the gap closes).
HIT_RATE_GAPS: dict[str, str] = {}
HIT_RATE_CASES = [
    pytest.param(name, marks=pytest.mark.xfail(reason=HIT_RATE_GAPS[name], strict=True))
    if name in HIT_RATE_GAPS
    else name
    for name in CASES
]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces")


class TestTokenizerPrefixVsBoundedLoad:
    @pytest.mark.parametrize("name", HIT_RATE_CASES)
    def test_hit_rate_at_least_bounded_loads(self, name: str, tmp: Path) -> None:
        """tokenizer-prefix's hit rate is at least bounded-load's, less only what spreading hot heads costs."""
        comparison, allowance = run(name, tmp)
        bounded, tokenizer = comparison.results
        assert tokenizer.hit_rate >= bounded.hit_rate - allowance, (
            f"{name}: expected tokenizer-prefix's hit rate >= bounded-load's {bounded.hit_rate:.4f} "
            f"- hot-head allowance {allowance:.4f} (got {tokenizer.hit_rate:.4f})"
        )

    @pytest.mark.parametrize("name", CASES)
    def test_busiest_and_idlest_within_the_load_bound(self, name: str, tmp: Path) -> None:
        """Its busiest instance is no busier, and its idlest no idler, than bounded-load's or the load_factor band."""
        comparison, _ = run(name, tmp)
        bounded, tokenizer = comparison.results
        fair = 1 / comparison.config.instances
        load_factor = 1.25  # both strategies' default
        most = max(bounded.share_max, load_factor * fair)
        least = min(bounded.share_min, fair / load_factor)
        assert least <= tokenizer.share_min and tokenizer.share_max <= most, (
            f"{name}: expected shares within [{least:.3f}, {most:.3f}] "
            f"(got {tokenizer.share_min:.3f} / {tokenizer.share_max:.3f})"
        )
