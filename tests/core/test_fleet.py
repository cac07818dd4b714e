"""Fleet membership, versions and events."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvroute import (
    Backend,
    BackendState,
    BaseStrategy,
    ConfigError,
    EngineLoad,
    Fleet,
    FleetEvent,
    KvrouteError,
    Router,
    RouteRequest,
    UnknownBackend,
)


def make_fleet(n: int = 3) -> Fleet:
    return Fleet([Backend(f"b{i}", f"http://b{i}") for i in range(n)])


class TestBackend:
    def test_validation(self) -> None:
        """A backend needs a non-empty id and a positive weight, and says what it got."""
        with pytest.raises(ValueError, match="'id' must be a non-empty string"):
            Backend("")
        with pytest.raises(ValueError, match=r"'weight' must be > 0 \(got 0.0\)"):
            Backend("a", weight=0)

    def test_models_filter(self) -> None:
        """A backend with no declared models serves any; otherwise only the declared ones."""
        assert Backend("a").serves("anything")
        b = Backend("b", models=["m1"])
        assert b.serves("m1") and not b.serves("m2") and b.serves(None)

    def test_labels_are_read_only(self) -> None:
        """Labels cannot be changed after creation (the identity is frozen)."""
        b = Backend("a", labels={"zone": "x"})
        with pytest.raises(TypeError):
            b.labels["zone"] = "y"  # type: ignore[index]


class TestFleet:
    def test_version_counts_changes(self) -> None:
        """Every routing-relevant change bumps the version; no-op changes do not."""
        fleet = make_fleet(2)
        assert fleet.version == 2
        fleet.drain("b0")
        assert fleet.version == 3
        assert fleet.drain("b0") is None and fleet.version == 3
        fleet.set_healthy("b1", False)
        fleet.set_weight("b1", 2)
        fleet.remove("b0")
        assert fleet.version == 6 and len(fleet) == 1

    def test_candidates_exclude_unroutable(self) -> None:
        """Unhealthy, draining, excluded and wrong-model backends are not candidates."""
        fleet = Fleet([Backend("a"), Backend("b"), Backend("c"), Backend("d", models=["other"])])
        fleet.drain("a")
        fleet.set_healthy("b", False)
        assert [s.id for s in fleet.candidates("m")] == ["c"]
        assert fleet.candidates("m", exclude={"c"}) == []
        assert {s.id for s in fleet.candidates("other")} == {"c", "d"}

    def test_events_reach_subscribers(self) -> None:
        """Subscribers see each change with its kind, backend and new version; unsubscribe stops them."""
        fleet = make_fleet(1)
        seen: list[FleetEvent] = []
        unsubscribe = fleet.subscribe(seen.append)
        fleet.add(Backend("x"))
        fleet.set_healthy("x", False)
        unsubscribe()
        fleet.remove("x")
        assert [(e.kind, e.backend.id if e.backend else None, e.version) for e in seen] == [
            ("added", "x", 2),
            ("unhealthy", "x", 3),
        ]

    def test_duplicate_and_unknown_ids(self) -> None:
        """Adding an existing id and naming an unknown id both fail clearly."""
        fleet = make_fleet(1)
        with pytest.raises(ConfigError, match="already in the fleet"):
            fleet.add(Backend("b0"))
        with pytest.raises(UnknownBackend, match=r"no backend with id 'zz' \(known: b0\)"):
            fleet.remove("zz")

    def test_bad_weight_is_config_error(self) -> None:
        """Setting a non-positive weight is refused with the value shown."""
        fleet = make_fleet(1)
        with pytest.raises(ConfigError, match="got -1"):
            fleet.set_weight("b0", -1)

    def test_load_freshness(self) -> None:
        """Engine load older than load_max_age is reported stale and not returned as fresh."""
        fleet = make_fleet(1)
        state = fleet.get("b0")
        assert state.fresh_load() is None and not state.load_is_stale()
        fleet.update_load("b0", EngineLoad(running=3, observed_at=100.0))
        assert state.fresh_load(now=105.0) is not None
        assert state.fresh_load(now=111.0) is None and state.load_is_stale(now=111.0)
        assert fleet.version == 1  # load updates are not membership changes


class TestDeclaredChanges:
    def test_models_and_labels_change_in_place_with_one_event_each(self) -> None:
        """set_models/set_labels keep the state object, emit `models`/`labels` once, and nothing when unchanged."""
        fleet = Fleet([Backend("a", models=["m1"])])
        state, events = fleet.get("a"), []
        fleet.subscribe(events.append)
        fleet.set_models("a", ["m2"])
        fleet.set_labels("a", {"zone": "b"})
        assert fleet.set_models("a", {"m2"}) is None and fleet.set_labels("a", {"zone": "b"}) is None
        assert [e.kind for e in events] == ["models", "labels"]
        assert fleet.get("a") is state and [s.id for s in fleet.candidates("m2")] == ["a"]
        assert dict(state.backend.labels) == {"zone": "b"}


class TestServedModels:
    def test_reported_models_replace_declared_ones(self) -> None:
        """Once a backend's engine reported its models, candidates filter on them; None restores the declared ones."""
        fleet = Fleet([Backend("a", models=["m1"]), Backend("b")])
        fleet.set_served_models("b", ["m2"])
        assert [s.id for s in fleet.candidates("m1")] == ["a"]
        assert [s.id for s in fleet.candidates("m2")] == ["b"]
        fleet.set_served_models("a", ["m2"])
        assert [s.id for s in fleet.candidates("m1")] == []
        assert fleet.get("a").models == frozenset({"m2"}) and fleet.models() == {"m2"}
        fleet.set_served_models("a", None)
        assert fleet.get("a").models == frozenset({"m1"}) and fleet.models() == {"m1", "m2"}

    def test_an_empty_report_serves_any_model(self) -> None:
        """An engine reporting no model is treated like a backend declaring none: it serves any."""
        fleet = Fleet([Backend("a", models=["m1"])])
        fleet.set_served_models("a", [])
        assert fleet.get("a").serves("anything") and fleet.get("a").serves(None)

    def test_changes_are_models_events(self) -> None:
        """A change of served models is a 'models' event with a version bump; the same models again is none."""
        fleet = make_fleet(1)
        seen: list[FleetEvent] = []
        fleet.subscribe(seen.append)
        assert fleet.set_served_models("b0", ["m"]) is not None
        assert fleet.set_served_models("b0", ("m",)) is None
        assert [(e.kind, e.version) for e in seen] == [("models", 2)]
        with pytest.raises(UnknownBackend, match="no backend with id 'zz'"):
            fleet.set_served_models("zz", ["m"])

    def test_readded_backend_forgets_reported_models(self) -> None:
        """A backend removed and added again has its models reported anew (its state starts unknown)."""
        fleet = make_fleet(1)
        router = Router(fleet, First())
        lease = router.acquire(REQ)
        fleet.set_served_models("b0", ["m"])
        fleet.remove("b0")
        fleet.add(Backend("b0"))
        assert fleet.get("b0").served_models is None and fleet.get("b0") is lease.state
        router.release(lease)


class First(BaseStrategy):
    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> BackendState:
        return candidates[0]


REQ = RouteRequest.from_text("hello")


class TestInFlightAcrossMembership:
    def test_readded_backend_keeps_running_requests(self) -> None:
        """Removing a backend and adding the same id back keeps counting the requests still running on it."""
        fleet = make_fleet(1)
        router = Router(fleet, First())
        leases = [router.acquire(REQ), router.acquire(REQ)]
        fleet.remove("b0")
        assert fleet.in_flight("b0") == 2
        fleet.add(Backend("b0", "http://b0"))
        assert fleet.get("b0").in_flight == 2
        newer = router.acquire(REQ)
        assert fleet.get("b0").in_flight == 3
        for lease in [*leases, newer]:
            router.release(lease)
        assert fleet.get("b0").in_flight == 0 and fleet.in_flight("b0") == 0

    def test_readded_backend_is_otherwise_fresh(self) -> None:
        """The re-added member takes the new identity and a new member's health, drain and load."""
        fleet = make_fleet(1)
        router = Router(fleet, First())
        lease = router.acquire(REQ)
        fleet.update_load("b0", EngineLoad(running=5))
        fleet.set_weight("b0", 3)
        fleet.drain("b0")
        fleet.set_healthy("b0", False)
        fleet.remove("b0")
        fleet.add(Backend("b0", "http://elsewhere"))
        state = fleet.get("b0")
        assert (state.backend.url, state.weight, state.healthy, state.draining, state.load) == (
            "http://elsewhere",
            1.0,
            True,
            False,
            None,
        )
        assert state.in_flight == 1 and lease.state is state
        router.release(lease)
        assert state.in_flight == 0

    def test_release_after_removal(self) -> None:
        """A lease released after its backend left (and did not come back) is counted off; a later add starts at 0."""
        fleet = make_fleet(2)
        router = Router(fleet, First())
        lease = router.acquire(REQ)
        fleet.remove("b0")
        router.release(lease)
        assert lease.outcome is not None and lease.outcome.status == "ok"
        assert fleet.in_flight("b0") == 0 and [s.in_flight for s in fleet] == [0]
        fleet.add(Backend("b0"))
        assert fleet.get("b0").in_flight == 0

    def test_idle_removal_forgets_the_state(self) -> None:
        """A backend removed with nothing in flight comes back as a new state object."""
        fleet = make_fleet(1)
        old = fleet.get("b0")
        fleet.remove("b0")
        fleet.add(Backend("b0"))
        assert fleet.get("b0") is not old and fleet.in_flight("unknown") == 0

    def test_counts_change_only_through_the_fleet(self) -> None:
        """Finishing more requests than started, or starting on a non-member, is an error saying what it got."""
        fleet = make_fleet(1)
        state = fleet.get("b0")
        with pytest.raises(KvrouteError, match=r"backend 'b0' has no request in flight \(got in_flight=0\)"):
            fleet.request_finished(state)
        fleet.remove("b0")
        with pytest.raises(UnknownBackend, match="backend 'b0' is not a member of this fleet"):
            fleet.request_started(state)


class TestWhenIdle:
    def test_called_once_when_the_last_request_finishes(self) -> None:
        """A waiter runs when the backend's last request in flight finishes, not before and not again."""
        fleet = make_fleet(1)
        state = fleet.get("b0")
        calls: list[str] = []
        fleet.request_started(state)
        fleet.request_started(state)
        fleet.when_idle("b0", lambda: calls.append("idle"))
        fleet.request_finished(state)
        assert calls == []
        fleet.request_finished(state)
        assert calls == ["idle"]
        fleet.request_started(state)
        fleet.request_finished(state)
        assert calls == ["idle"]

    def test_cancelled_waiter_is_not_called(self) -> None:
        """The function `when_idle` returns takes the waiter back; other backends' waiters are untouched."""
        fleet = make_fleet(2)
        calls: list[str] = []
        cancel = fleet.when_idle("b0", lambda: calls.append("b0"))
        fleet.when_idle("b1", lambda: calls.append("b1"))
        cancel()
        for backend_id in ("b0", "b1"):
            state = fleet.get(backend_id)
            fleet.request_started(state)
            fleet.request_finished(state)
        assert calls == ["b1"]
