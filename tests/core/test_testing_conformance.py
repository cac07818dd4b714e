"""kvroute.testing: the conformance suite passes real strategies and catches broken ones."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest

import kvroute
from kvroute import BackendState, KvrouteError, RouteRequest
from kvroute.testing import StrategyConformance, varied_requests


class TestRandomConformance(StrategyConformance):
    strategy = "random"
    options: ClassVar[dict[str, object]] = {"seed": 1}


class TestLeastOutstandingConformance(StrategyConformance):
    strategy = "least-outstanding"


class TestThirdPartyConformance(StrategyConformance):
    strategy = "p2c"


class Stubborn(kvroute.BaseStrategy):
    """Returns the first member it was told about, even when that one is not a candidate."""

    def __init__(self) -> None:
        self.first: BackendState | None = None

    def on_fleet_change(self, event: kvroute.FleetEvent, members: Sequence[BackendState]) -> None:
        if self.first is None and members:
            self.first = members[0]

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> BackendState:
        return self.first or candidates[0]


class Scribbler(kvroute.BaseStrategy):
    """Writes the in-flight count of what it reads: forbidden."""

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> BackendState:
        candidates[0].in_flight += 1
        return candidates[0]


class StubbornSuite(StrategyConformance):
    strategy = "stubborn"
    factory = Stubborn


class ScribblerSuite(StrategyConformance):
    strategy = "scribbler"
    factory = Scribbler


class TestConformanceCatchesDefects:
    def test_non_candidate_pick_fails(self) -> None:
        """A strategy that returns a drained backend fails the unroutable check."""
        with pytest.raises((KvrouteError, AssertionError)):
            StubbornSuite().test_unroutable_and_excluded_never_picked()

    def test_writing_states_fails(self) -> None:
        """A strategy that changes in-flight counts fails the read-only check."""
        with pytest.raises(AssertionError):
            ScribblerSuite().test_pick_does_not_write_states()

    def test_factory_suite_skips_installation_check(self) -> None:
        """With a factory there is no entry point to look for: the check is skipped, not passed."""
        with pytest.raises(pytest.skip.Exception):
            StubbornSuite().test_is_installed()


class TestVariedRequests:
    def test_shapes(self) -> None:
        """The sample covers affinity keys, LoRA adapters, salts, token ids, chat bodies and a 40 KB text."""
        requests = varied_requests()
        assert any(r.affinity_key for r in requests) and any(r.lora for r in requests)
        assert any(r.cache_salt for r in requests) and any(r.token_ids for r in requests)
        assert any(r.endpoint == "chat" for r in requests) and max(len(r.text) for r in requests) >= 40000
