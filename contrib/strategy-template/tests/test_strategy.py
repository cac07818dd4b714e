"""The template strategy held to kvroute's conformance suite, its scaling state machine, and its own claims."""

from __future__ import annotations

from collections import Counter

import pytest

import kvroute
from kvroute.testing import Claims, ScalingStateMachine, StrategyConformance, sample_requests

NAME = "template-rendezvous"  # the entry-point name in pyproject.toml
OPTIONS = {"prefix_length": 1024}


class TestConformance(StrategyConformance):
    """The contract every kvroute strategy keeps (picks are candidates, leases balance, options checked...)."""

    strategy = NAME
    options = OPTIONS
    deterministic = True


# Scale the fleet at random and check the placement claims: deterministic across replicas, minimal
# movement on scale-out and scale-in, keys return to a backend that comes back, weighted balance.
TestScaling = ScalingStateMachine.for_strategy(NAME, OPTIONS, claims=Claims(), max_examples=15, steps=25).TestCase


def router(*weights: float) -> kvroute.Router:
    fleet = kvroute.Fleet([kvroute.Backend(f"b{i}", weight=w) for i, w in enumerate(weights)])
    return kvroute.Router.create(fleet, NAME, OPTIONS)


class TestRendezvous:
    def test_same_prefix_same_backend(self) -> None:
        """Requests sharing their first prefix_length characters go to one backend, whatever follows."""
        r = router(1, 1, 1, 1)
        shared = "x" * 1024
        chosen = {r.decide(kvroute.RouteRequest.from_text(shared + f"tail {i}"))[0].backend.id for i in range(20)}
        assert len(chosen) == 1

    def test_decision_explains_itself(self) -> None:
        """The decision names the strategy, carries the key and the reason 'rendezvous'."""
        decision, _ = router(1, 1).decide(kvroute.RouteRequest.from_text("hello"))
        assert decision.reason == "rendezvous" and decision.key is not None
        assert decision.explain().startswith(f"{NAME} -> b")

    def test_weights_set_shares(self) -> None:
        """A backend of weight 3 receives about three times the keys of a backend of weight 1."""
        r = router(1, 3)
        counts = Counter(r.decide(req)[0].backend.id for req in sample_requests(4000, seed=5))
        assert 2.5 < counts["b1"] / counts["b0"] < 3.5

    @pytest.mark.parametrize(
        "value, message", [(12, "between 1024 and 65536 (got 12)"), ("lots", "expected an integer")]
    )
    def test_bad_prefix_length(self, value: object, message: str) -> None:
        """A bad prefix_length is a ConfigError saying what was expected and what was got."""
        with pytest.raises(kvroute.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            kvroute.PluginManager().create_strategy(NAME, {"prefix_length": value})

    def test_option_from_the_command_line(self) -> None:
        """An option given as a string (as --option passes it) is converted."""
        strategy = kvroute.PluginManager().create_strategy(NAME, {"prefix-length": "2048"})
        assert strategy.prefix_length == 2048  # type: ignore[attr-defined]
