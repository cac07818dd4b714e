"""The random strategy: uniform, weight-aware, seedable."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvroute_random import RandomStrategy

from kvroute import Backend, ConfigError, Fleet, Router, RouteRequest
from kvroute.testing import Claims, ScalingStateMachine

# Chi-square critical values at p = 1e-4 by degrees of freedom: a correct sampler fails a
# given seed one time in 10,000; the seeds below are fixed, so the test is deterministic.
CHI2_CRITICAL_1E4 = {1: 15.14, 2: 18.42, 4: 23.51, 6: 27.86}
REQ = RouteRequest.from_text("x")


def chi_square(observed: Counter[str], expected: dict[str, float]) -> float:
    return sum((observed[k] - e) ** 2 / e for k, e in expected.items())


class TestRandom:
    @pytest.mark.parametrize("n", [2, 5, 7])
    @pytest.mark.parametrize("seed", range(5))
    def test_uniform_chi_square(self, n: int, seed: int) -> None:
        """Equal weights: picks over 7,000 draws pass a chi-square test of uniformity."""
        fleet = Fleet([Backend(f"b{i}") for i in range(n)])
        router = Router.create(fleet, "random", {"seed": seed})
        draws = 7000
        counts = Counter(router.decide(REQ)[0].backend.id for _ in range(draws))
        assert chi_square(counts, {f"b{i}": draws / n for i in range(n)}) < CHI2_CRITICAL_1E4[n - 1]

    @pytest.mark.parametrize("seed", range(5))
    def test_weighted_chi_square(self, seed: int) -> None:
        """Weights 1:2:4 give shares 1/7, 2/7, 4/7 within a chi-square bound."""
        fleet = Fleet([Backend("a", weight=1), Backend("b", weight=2), Backend("c", weight=4)])
        router = Router.create(fleet, "random", {"seed": seed})
        draws = 7000
        counts = Counter(router.decide(REQ)[0].backend.id for _ in range(draws))
        assert chi_square(counts, {"a": 1000, "b": 2000, "c": 4000}) < CHI2_CRITICAL_1E4[2]

    @given(st.integers(0, 2**32))
    def test_same_seed_same_sequence(self, seed: int) -> None:
        """Two instances with one seed make the same picks."""
        fleet = Fleet([Backend(f"b{i}") for i in range(5)])
        a = Router(fleet, RandomStrategy(seed=seed))
        b = Router(fleet, RandomStrategy(seed=seed))
        assert [a.decide(REQ)[0].backend.id for _ in range(20)] == [b.decide(REQ)[0].backend.id for _ in range(20)]

    def test_decision_reason(self) -> None:
        """Each decision says it was random."""
        router = Router.create(Fleet([Backend("a")]), "random", {"seed": 1})
        assert router.decide(REQ)[0].reason == "random"

    def test_bad_seed(self) -> None:
        """A seed that is not an integer is a ConfigError naming the option."""
        with pytest.raises(ConfigError, match=r"'seed': expected an integer \(got 'x'\)"):
            Router.create(Fleet(), "random", {"seed": "x"})


# random claims no placement property but balance: each key is an independent draw with P(b) = weight share,
# so b's share of 1,000 keys is Binomial, within 6 deviations. Also checked, as for every strategy: picks are
# candidates and in-flight counts are conserved.
TestRandomScaling = ScalingStateMachine.for_strategy(
    "random",
    {"seed": 1},
    claims=Claims(deterministic=False, minimal_disruption=False, returns=False, balance=True),
    max_examples=12,
).TestCase
