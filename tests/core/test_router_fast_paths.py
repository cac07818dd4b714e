"""The router's per-request shortcuts give what the general paths give.

`Router` copies a strategy's `Decision` field by field instead of ``attrs.evolve``, finds the
picked candidate by identity before comparing ids, and skips converting a `Status` it was given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from kvroute import Backend, BackendState, BaseStrategy, Decision, Fleet, Prediction, Router, RouteRequest, SpillReason
from kvroute.strategy import Status

REQ = RouteRequest.from_text("hello", model="m", request_id="r1")

#: A value for every field of `Decision` that differs from its default, except the two the router sets.
EVERY_FIELD: dict[str, Any] = {
    "reason": "spilled",
    "key": 0xC0FFEE,
    "spilled": True,
    "detail": {"home": "b0", "rank": 1},
    "spill_reason": SpillReason.LOAD_FACTOR,
    "data_parallel_rank": 3,
    "prediction": Prediction(ttft_s=0.25, tpot_s=0.04),
}
ROUTER_SETS = ("strategy", "duration_s")


class Returning(BaseStrategy):
    """Returns what ``make`` builds from the candidates."""

    def __init__(self, make: Any) -> None:
        self.make = make

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Any:
        return self.make(candidates)


@attrs.frozen
class TracedDecision(Decision):
    """A third party's decision type with a field of its own."""

    trace: str = ""


def router_for(make: Any) -> Router:
    return Router(Fleet([Backend("b0"), Backend("b1")]), Returning(make), strategy_name="s")


class TestDecisionCopy:
    def test_covers_every_field(self) -> None:
        """The test data sets every `Decision` field the strategy owns, so the copy below is checked for all."""
        names = {field.name for field in attrs.fields(Decision)}
        assert names == {"backend", *EVERY_FIELD, *ROUTER_SETS}, (
            "Decision's fields changed: add the new one to EVERY_FIELD and to kvroute.router._stamped"
        )

    def test_every_field_survives(self) -> None:
        """The leased decision is the strategy's, every field kept, with the router's strategy name and timing."""
        router = router_for(lambda candidates: Decision(candidates[1].backend, **EVERY_FIELD))
        with router.route(REQ) as lease:
            got = lease.decision
        assert type(got) is Decision
        assert got == Decision(router.fleet.get("b1").backend, **EVERY_FIELD, strategy="s", duration_s=got.duration_s)
        assert got.duration_s >= 0 and lease.state is router.fleet.get("b1")

    def test_subclass_keeps_its_type_and_fields(self) -> None:
        """A `Decision` subclass comes back as that subclass with its own fields, stamped by the router."""
        router = router_for(lambda candidates: TracedDecision(candidates[0].backend, reason="why", trace="t-1"))
        decision, state = router.decide(REQ)
        assert type(decision) is TracedDecision
        assert (decision.trace, decision.reason, decision.strategy) == ("t-1", "why", "s")
        assert state is router.fleet.get("b0")


class TestCandidateLookup:
    def test_equal_backend_that_is_another_object(self) -> None:
        """A picked backend equal to a candidate's, but a copy, still finds that candidate by id."""
        router = router_for(lambda candidates: attrs.evolve(candidates[1].backend))
        with router.route(REQ) as lease:
            assert lease.state is router.fleet.get("b1")
            assert lease.backend is not lease.state.backend and lease.backend == lease.state.backend
        assert [s.in_flight for s in router.fleet] == [0, 0]

    def test_backend_state_pick(self) -> None:
        """A strategy returning a candidate's `BackendState` has that state leased."""
        router = router_for(lambda candidates: candidates[1])
        with router.route(REQ) as lease:
            assert lease.state is router.fleet.get("b1") and lease.backend.id == "b1"


class TestReleaseStatus:
    @pytest.mark.parametrize("status", [Status.CANCELLED, "cancelled"])
    def test_member_or_its_value(self, status: Status | str) -> None:
        """``release`` takes a `Status` or its text and records the member."""
        router = router_for(lambda candidates: candidates[0])
        outcome = router.release(router.acquire(REQ), status, "client left")
        assert outcome.status is Status.CANCELLED and outcome.error == "client left"

    def test_unknown_text_is_refused(self) -> None:
        """A status text that names no `Status` raises ValueError."""
        router = router_for(lambda candidates: candidates[0])
        lease = router.acquire(REQ)
        with pytest.raises(ValueError, match="'finished' is not a valid Status"):
            router.release(lease, "finished")
