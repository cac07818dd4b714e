"""Router: leasing, in-flight accounting, retries, errors and lifecycle hooks."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvroute
from kvroute import (
    Backend,
    BackendState,
    BaseStrategy,
    Decision,
    Fleet,
    KvrouteError,
    NoBackendAvailable,
    PluginManager,
    Router,
    RouteRequest,
)


class FirstStrategy(BaseStrategy):
    """Always the first candidate: makes router tests independent of any plugin."""

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Backend:
        return candidates[0].backend


def make_router(n: int = 3, strategy: Any = None) -> Router:
    fleet = Fleet([Backend(f"b{i}") for i in range(n)])
    return Router(fleet, strategy or FirstStrategy(), strategy_name="first")


REQ = RouteRequest.from_text("hello", model="m", request_id="r1")


def in_flight(router: Router) -> list[int]:
    return [s.in_flight for s in router.fleet]


class TestLeases:
    @pytest.mark.anyio
    async def test_async_lease_counts_and_releases(self) -> None:
        """A request counts in flight inside the block and not after it."""
        router = make_router()
        async with router.route(REQ) as lease:
            assert lease.backend.id == "b0" and in_flight(router) == [1, 0, 0]
            assert lease.decision.strategy == "first" and lease.decision.duration_s >= 0
        assert in_flight(router) == [0, 0, 0]
        assert lease.outcome is not None and lease.outcome.status == "ok"

    @pytest.mark.anyio
    async def test_exception_releases(self) -> None:
        """An exception in the block releases the lease and records an error outcome."""
        router = make_router()
        with pytest.raises(RuntimeError):
            async with router.route(REQ) as lease:
                raise RuntimeError("upstream broke")
        assert in_flight(router) == [0, 0, 0]
        assert lease.outcome is not None and lease.outcome.status == "error"
        assert "upstream broke" in (lease.outcome.error or "")

    @pytest.mark.anyio
    async def test_cancellation_releases(self) -> None:
        """Cancelling a task inside the block releases the lease with a cancelled outcome."""
        router = make_router()
        leases: list[kvroute.Lease] = []
        entered = anyio.Event()

        async def hold() -> None:
            async with router.route(REQ) as lease:
                leases.append(lease)
                entered.set()
                await anyio.sleep_forever()

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await entered.wait()
            assert in_flight(router) == [1, 0, 0]
            tg.cancel_scope.cancel()
        assert in_flight(router) == [0, 0, 0]
        assert leases[0].outcome is not None and leases[0].outcome.status == "cancelled"

    def test_lease_fail_marks_error_without_raising(self) -> None:
        """lease.fail() records an error outcome while the block exits normally."""
        router = make_router()
        with router.route(REQ) as lease:
            lease.fail("HTTP 502")
        assert lease.outcome is not None and (lease.outcome.status, lease.outcome.error) == ("error", "HTTP 502")

    def test_release_is_idempotent(self) -> None:
        """Releasing a lease twice only decrements once."""
        router = make_router()
        lease = router.acquire(REQ)
        router.release(lease)
        router.release(lease)
        assert in_flight(router) == [0, 0, 0]

    def test_threads(self) -> None:
        """Many threads leasing at once leave every count at zero and never lose an increment."""
        router = Router(Fleet([Backend("a"), Backend("b")]), FirstStrategy())
        peak: list[int] = []
        barrier = threading.Barrier(8)

        def work() -> None:
            barrier.wait()
            for _ in range(200):
                with router.route(REQ):
                    peak.append(router.fleet.get("a").in_flight)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert in_flight(router) == [0, 0]
        assert len(peak) == 1600 and max(peak) <= 8

    @given(st.lists(st.tuples(st.booleans(), st.integers(0, 2)), max_size=60))
    def test_in_flight_is_started_minus_finished(self, ops: list[tuple[bool, int]]) -> None:
        """For any interleaving of starts and finishes, each count equals started minus finished."""
        router = make_router(3, strategy=RoundRobin())
        open_leases: list[kvroute.Lease] = []
        started = {f"b{i}": 0 for i in range(3)}
        finished = dict.fromkeys(started, 0)
        for start, index in ops:
            if start or not open_leases:
                lease = router.acquire(REQ)
                open_leases.append(lease)
                started[lease.backend.id] += 1
            else:
                lease = open_leases.pop(index % len(open_leases))
                router.release(lease)
                finished[lease.backend.id] += 1
            for state in router.fleet:
                assert state.in_flight == started[state.id] - finished[state.id]


class RoundRobin(BaseStrategy):
    def __init__(self) -> None:
        self.i = 0

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> BackendState:
        self.i += 1
        return candidates[self.i % len(candidates)]


class TestDecisions:
    def test_exclude_for_retries(self) -> None:
        """Backends that already failed this request are excluded on the retry."""
        router = make_router()
        failed: set[str] = set()
        for _ in range(3):
            with router.route(REQ, exclude=failed) as lease:
                failed.add(lease.backend.id)
        assert failed == {"b0", "b1", "b2"}
        with pytest.raises(NoBackendAvailable, match="3 already failed this request"):
            router.acquire(REQ, exclude=failed)

    def test_no_backend_messages(self) -> None:
        """NoBackendAvailable says why: empty fleet, no backend for the model, or all unroutable."""
        with pytest.raises(NoBackendAvailable, match="the fleet is empty"):
            Router(Fleet(), FirstStrategy()).acquire(REQ)
        with pytest.raises(NoBackendAvailable, match="none of 1 serves model 'm'"):
            Router(Fleet([Backend("a", models=["x"])]), FirstStrategy()).acquire(REQ)
        router = make_router(2)
        router.fleet.drain("b0")
        router.fleet.set_healthy("b1", False)
        with pytest.raises(NoBackendAvailable, match="1 unhealthy, 1 draining"):
            router.acquire(REQ)

    def test_strategy_must_pick_a_candidate(self) -> None:
        """A strategy returning a backend outside the candidates is an error, not a silent misroute."""

        class Rogue(BaseStrategy):
            def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Backend:
                return Backend("elsewhere")

        with pytest.raises(KvrouteError, match="'elsewhere', which is not a candidate"):
            make_router(strategy=Rogue()).acquire(REQ)

    def test_strategy_must_return_a_backend(self) -> None:
        """A strategy returning something else is named in the error."""

        class Wrong(BaseStrategy):
            def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Any:
                return "b0"

        with pytest.raises(KvrouteError, match="returned str"):
            make_router(strategy=Wrong()).acquire(REQ)

    def test_decision_keeps_strategy_reason(self) -> None:
        """A Decision returned by the strategy keeps its reason and detail; the router adds name and timing."""

        class Explaining(BaseStrategy):
            def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
                return Decision(candidates[-1].backend, reason="spilled", spilled=True, detail={"spill_reason": "x"})

        decision, _ = make_router(strategy=Explaining()).decide(REQ)
        assert (decision.backend.id, decision.reason, decision.spilled) == ("b2", "spilled", True)
        assert decision.explain() == "first -> b2 (spilled: spill_reason=x)"


class Recorder:
    """A plugin object recording every lifecycle hook call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    @kvroute.hookimpl
    def kvroute_fleet_changed(self, fleet: Fleet, event: kvroute.FleetEvent) -> None:
        self.calls.append(("fleet", event.kind))

    @kvroute.hookimpl
    def kvroute_request_routed(self, request: RouteRequest, decision: Decision) -> None:
        self.calls.append(("routed", decision.backend.id))

    @kvroute.hookimpl
    def kvroute_request_finished(self, request: RouteRequest, decision: Decision, outcome: kvroute.Outcome) -> None:
        self.calls.append(("finished", outcome.status))


class TestStrategyCallbacksAndHooks:
    def test_lifecycle_hooks_fire(self) -> None:
        """Plugins see fleet changes, routed requests and finished requests."""
        pm = PluginManager(autoload=False)
        recorder = Recorder()
        pm.register(recorder, name="recorder")
        router = Router(Fleet([Backend("a")]), FirstStrategy(), plugins=pm)
        router.fleet.add(Backend("b"))
        with router.route(REQ):
            pass
        assert recorder.calls == [("fleet", "added"), ("routed", "a"), ("finished", "ok")]

    def test_strategy_callbacks(self) -> None:
        """The strategy hears of its initial members, of changes, and of each request's start and finish."""
        events: list[tuple[str, Any]] = []

        class Listening(FirstStrategy):
            def on_fleet_change(self, event: kvroute.FleetEvent, members: Sequence[BackendState]) -> None:
                events.append((event.kind, sorted(m.id for m in members)))

            def on_request_start(self, request: RouteRequest, decision: Decision) -> None:
                events.append(("start", decision.backend.id))

            def on_request_finish(self, request: RouteRequest, decision: Decision, outcome: kvroute.Outcome) -> None:
                events.append(("finish", outcome.status))

        router = Router(Fleet([Backend("a")]), Listening())
        router.fleet.add(Backend("b"))
        with router.route(REQ):
            pass
        router.close()
        router.fleet.remove("b")
        assert events == [("attached", ["a"]), ("added", ["a", "b"]), ("start", "a"), ("finish", "ok")]


class TestCreateByName:
    def test_unknown_strategy(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Naming a strategy nobody registered lists what is installed and how to install it."""
        with pytest.raises(kvroute.ConfigError, match=r"unknown strategy 'nope' \(installed: .*\)\. .*kvroute\[nope\]"):
            Router.create(Fleet(), "nope", plugins=PluginManager(autoload=False))

    def test_registered_factory_with_options(self) -> None:
        """A strategy registered by a plugin object is built with validated options."""
        made: list[dict[str, Any]] = []

        class Plugin:
            @kvroute.hookimpl
            def kvroute_register_strategies(self, register: Callable[..., None]) -> None:
                def factory(*, depth: int = 1) -> FirstStrategy:
                    made.append({"depth": depth})
                    return FirstStrategy()

                register("first", factory)

        pm = PluginManager(autoload=False)
        pm.register(Plugin(), name="p")
        router = Router.create(Fleet([Backend("a")]), "first", {"depth": 3}, plugins=pm)
        assert made == [{"depth": 3}] and router.strategy_name == "first"
        with pytest.raises(kvroute.ConfigError, match=r"has no option 'width' \(expected one of: depth\)"):
            Router.create(Fleet(), "first", {"width": 3}, plugins=pm)
