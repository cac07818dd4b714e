"""Backend naming in the simulator (`SimulationConfig.backend_names`), and the default strategy's robustness to it.

Issue 24: on 7 engines whose caches hold ~4.8 long prompts each, bounded-load's hit rate moved 12
points between two namings of the same engines, because hash placement put a third of the
prompts on one engine. `benchmarks/bench_naming.py` sweeps namings and seeds; this runs its
tight workload on one seed and two namings.
"""

from __future__ import annotations

import functools

import attrs
import pytest

from kvroute.errors import ConfigError
from kvroute_simulator.driver import SimulationConfig, compare, simulate
from kvroute_simulator.workloads import make_workload

NAMINGS = ("i{index}", "e{index}", "http://10.0.0.{index}:8000", "engine-{index}")


class TestBackendNames:
    def test_instances_take_the_pattern(self) -> None:
        """Instances are named by the pattern, in the order they join."""
        arrivals = list(make_workload("short-prefix", requests=20, seed=0).arrivals())
        result = simulate(arrivals, "bounded-load", config=SimulationConfig(instances=3, backend_names="e{index}"))
        assert sorted(i.id for i in result.instances) == ["e0", "e1", "e2"]

    @pytest.mark.parametrize("pattern", ["e", "e{}", "e{name}", "{index", 7])
    def test_a_pattern_without_index_is_a_config_error(self, pattern: object) -> None:
        """A pattern that does not name instances apart by {index} is refused, saying what was expected."""
        with pytest.raises(ConfigError, match=r"pattern with \{index\}.*got"):
            SimulationConfig(backend_names=pattern)  # type: ignore[arg-type]


@functools.cache
def hit_rates(share_factor: str | None) -> list[float]:
    """bounded-load's hit rate on issue 24's shape (24 prompts of 8,000 tokens, caches of 4.8 prompts), per naming."""
    arrivals = list(make_workload("long-prefix", groups=24, requests=300, rate=6.0, seed=0).arrivals())
    options = {} if share_factor is None else {"bounded-load": {"share_factor": share_factor}}
    rates = []
    for naming in NAMINGS:
        config = SimulationConfig(instances=7, seed=0, backend_names=naming)
        config = attrs.evolve(config, engine=attrs.evolve(config.engine, capacity_blocks=2400))
        (result,) = compare(arrivals, ["bounded-load"], config, options=options, workload="long-prefix").results
        rates.append(result.hit_rate)
    return rates


class TestNamingRobustness:
    def test_default_is_within_8_percent_of_its_best_naming(self) -> None:
        """The default bounded-load's worst naming reaches at least 92 % of its best (measured 0.925: issue 24's 3 %
        target is not met yet, docs/performance.md)."""
        rates = hit_rates(None)
        assert min(rates) >= 0.92 * max(rates), rates

    def test_pure_hashing_depends_on_the_names(self) -> None:
        """Without the share bound one naming loses more than 8 % of the best one's hit rate (measured 0.81)."""
        rates = hit_rates("off")
        assert min(rates) < 0.92 * max(rates), rates
