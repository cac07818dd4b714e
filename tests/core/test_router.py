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
        """Threads leasing at once never lose an increment or a decrement: all held means exactly 8, all released 0."""
        router = Router(Fleet([Backend("a"), Backend("b")]), FirstStrategy())
        threads, rounds = 8, 40
        held_counts: list[int] = []
        released_counts: list[int] = []
        barrier = threading.Barrier(threads)
        errors: list[BaseException] = []

        def work() -> None:
            try:
                for _ in range(rounds):
                    for _ in range(25):  # unsynchronised churn between the checkpoints
                        with router.route(REQ):
                            pass
                    lease = router.acquire(REQ)
                    barrier.wait()
                    held_counts.append(router.fleet.get("a").in_flight)  # every thread holds exactly one lease
                    barrier.wait()
                    router.release(lease)
                    barrier.wait()
                    released_counts.append(router.fleet.get("a").in_flight)  # and none does now
                    barrier.wait()
            except BaseException as exc:  # surface failures of worker threads in the test
                errors.append(exc)
                barrier.abort()

        workers = [threading.Thread(target=work) for _ in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(timeout=120)
        assert errors == [] and not any(t.is_alive() for t in workers)
        assert held_counts == [threads] * (threads * rounds)
        assert released_counts == [0] * (threads * rounds)
        assert in_flight(router) == [0, 0]

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

    def test_no_backend_message_counts_only_backends_serving_the_model(self) -> None:
        """A backend whose engine reports other models is neither 'serving it' nor 'already failed this request'."""
        fleet = Fleet([Backend("a"), Backend("b"), Backend("c")])
        fleet.set_served_models("c", ["other"])
        fleet.set_healthy("b", False)
        router = Router(fleet, FirstStrategy(), strategy_name="first")
        with pytest.raises(NoBackendAvailable) as raised:
            router.acquire(REQ, exclude={"a"})
        assert str(raised.value) == (
            "no backend available for model 'm': of 2 serving it, 1 unhealthy, 0 draining, "
            "1 already failed this request."
        )
        fleet.set_served_models("a", ["other"])
        fleet.set_served_models("b", ["other"])
        with pytest.raises(NoBackendAvailable, match="none of 3 serves model 'm'"):
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
                return Decision(
                    candidates[-1].backend, reason="spilled", spilled=True, detail={"home": "b1"}, spill_reason="x"
                )

        decision, _ = make_router(strategy=Explaining()).decide(REQ)
        assert (decision.backend.id, decision.reason, decision.spilled) == ("b2", "spilled", True)
        assert decision.explain() == "first -> b2 (spilled: home=b1, spill_reason=x)"


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


class RecordingLog:
    """Stands in for a module's structlog logger: keeps each event and its fields."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _record(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    exception = error = warning = info = debug = _record


@pytest.fixture
def logs(monkeypatch: pytest.MonkeyPatch) -> RecordingLog:
    """Records what kvroute.plugins and kvroute.router log."""
    recording = RecordingLog()
    monkeypatch.setattr(kvroute.plugins, "log", recording)
    monkeypatch.setattr(kvroute.router, "log", recording)
    return recording


class Faulty:
    """A plugin whose lifecycle hooks raise."""

    @kvroute.hookimpl
    def kvroute_fleet_changed(self, fleet: Fleet, event: kvroute.FleetEvent) -> None:
        raise RuntimeError("fleet hook broke")

    @kvroute.hookimpl
    def kvroute_request_routed(self, request: RouteRequest, decision: Decision) -> None:
        raise RuntimeError("routed hook broke")

    @kvroute.hookimpl
    def kvroute_request_finished(self, request: RouteRequest, decision: Decision, outcome: kvroute.Outcome) -> None:
        raise RuntimeError("finished hook broke")


class LastStrategy(BaseStrategy):
    """Always the last candidate, so a leaked count shows as [0, 0, 1]."""

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Backend:
        return candidates[-1].backend


def faulty_router(strategy: Any = None) -> tuple[Router, Recorder]:
    """Three backends; a recording plugin, then a faulty one (pluggy calls the faulty one first)."""
    pm = PluginManager(autoload=False)
    recorder = Recorder()
    pm.register(recorder, name="recorder")
    pm.register(Faulty(), name="faulty")
    return Router(Fleet([Backend(f"b{i}") for i in range(3)]), strategy or LastStrategy(), plugins=pm), recorder


class TestPluginFailures:
    def test_raising_routed_hook_still_routes(self, logs: RecordingLog) -> None:
        """A routed hook that raises is logged with its plugin's name; the request is routed and counted once."""
        router, recorder = faulty_router()
        lease = router.acquire(REQ)
        assert lease.backend.id == "b2" and in_flight(router) == [0, 0, 1]
        router.release(lease)
        assert in_flight(router) == [0, 0, 0]
        assert ("routed", "b2") in recorder.calls  # the other plugin was still called
        failures = [f for e, f in logs.events if e == "plugin_hook_failed" and f["hook"] == "kvroute_request_routed"]
        assert failures == [
            {
                "plugin": "faulty",
                "distribution": None,
                "version": None,
                "hook": "kvroute_request_routed",
                "error": "RuntimeError: routed hook broke",
            }
        ]

    @pytest.mark.anyio
    async def test_raising_finished_hook_keeps_the_block_exception(self, logs: RecordingLog) -> None:
        """The exception raised in the block propagates, not the one a finished hook raised."""
        router, recorder = faulty_router()
        error = ValueError("upstream broke")
        with pytest.raises(ValueError) as raised:
            async with router.route(REQ) as lease:
                raise error
        assert raised.value is error and in_flight(router) == [0, 0, 0]
        assert lease.outcome is not None and lease.outcome.status == "error"
        assert ("finished", "error") in recorder.calls
        assert ("plugin_hook_failed", "faulty", "kvroute_request_finished") in {
            (e, f["plugin"], f["hook"]) for e, f in logs.events
        }

    def test_raising_finished_hook_after_a_good_block(self, logs: RecordingLog) -> None:
        """A block that succeeds stays a success when a finished hook raises."""
        router, _ = faulty_router()
        with router.route(REQ) as lease:
            pass
        assert lease.outcome is not None and lease.outcome.status == "ok" and in_flight(router) == [0, 0, 0]

    def test_raising_fleet_hook_does_not_undo_the_change(self, logs: RecordingLog) -> None:
        """A fleet_changed hook that raises is logged; the change stands and the strategy heard of it."""
        seen: list[str] = []

        class Listening(LastStrategy):
            def on_fleet_change(self, event: kvroute.FleetEvent, members: Sequence[BackendState]) -> None:
                seen.append(event.kind)

        router, recorder = faulty_router(Listening())
        router.fleet.add(Backend("b3"))
        assert "b3" in router.fleet and seen == ["attached", "added"] and ("fleet", "added") in recorder.calls
        assert ("plugin_hook_failed", "kvroute_fleet_changed") in {(e, f["hook"]) for e, f in logs.events}

    def test_strategy_start_failure_refuses_cleanly(self, logs: RecordingLog) -> None:
        """on_request_start raising refuses the request with a KvrouteError naming the strategy; nothing is counted."""
        finished: list[str] = []

        class Broken(LastStrategy):
            def on_request_start(self, request: RouteRequest, decision: Decision) -> None:
                raise RuntimeError("bookkeeping broke")

            def on_request_finish(self, request: RouteRequest, decision: Decision, outcome: kvroute.Outcome) -> None:
                finished.append(outcome.status)

        router, recorder = faulty_router(Broken())
        router.strategy_name = "broken"
        refused = r"strategy 'broken' failed in on_request_start for backend 'b2'"
        with pytest.raises(KvrouteError, match=refused) as raised:
            router.acquire(REQ)
        assert isinstance(raised.value, kvroute.StrategyError) and isinstance(raised.value.__cause__, RuntimeError)
        assert in_flight(router) == [0, 0, 0] and finished == [] and recorder.calls == []

    def test_strategy_finish_failure_is_logged(self, logs: RecordingLog) -> None:
        """on_request_finish raising is logged with the strategy's name; the count drops and the block's error wins."""

        class Broken(LastStrategy):
            def on_request_finish(self, request: RouteRequest, decision: Decision, outcome: kvroute.Outcome) -> None:
                raise RuntimeError("bookkeeping broke")

        router = Router(Fleet([Backend("a")]), Broken(), strategy_name="broken")
        error = ValueError("upstream broke")
        with pytest.raises(ValueError) as raised, router.route(REQ):
            raise error
        assert raised.value is error and in_flight(router) == [0]
        assert logs.events == [
            (
                "strategy_callback_failed",
                {
                    "strategy": "broken",
                    "callback": "on_request_finish",
                    "backend": "a",
                    "error": "RuntimeError: bookkeeping broke",
                },
            )
        ]

    def test_interrupt_in_routed_hook_releases(self) -> None:
        """A KeyboardInterrupt from a routed hook propagates and the lease it interrupted is released."""
        finished: list[str] = []

        class Interrupting:
            @kvroute.hookimpl
            def kvroute_request_routed(self, request: RouteRequest, decision: Decision) -> None:
                raise KeyboardInterrupt

        class Listening(LastStrategy):
            def on_request_finish(self, request: RouteRequest, decision: Decision, outcome: kvroute.Outcome) -> None:
                finished.append(outcome.status)

        pm = PluginManager(autoload=False)
        pm.register(Interrupting(), name="interrupting")
        router = Router(Fleet([Backend("a")]), Listening(), plugins=pm)
        with pytest.raises(KeyboardInterrupt):
            router.acquire(REQ)
        assert in_flight(router) == [0] and finished == ["cancelled"]

    def test_failure_reaches_standard_logging(self, caplog: pytest.LogCaptureFixture) -> None:
        """The failure is an ERROR record of logger kvroute.plugins naming the event, the plugin and the hook."""
        router, _ = faulty_router()
        with caplog.at_level("ERROR", logger="kvroute"):
            router.release(router.acquire(REQ))
        records = [r for r in caplog.records if r.name == "kvroute.plugins" and r.levelname == "ERROR"]
        assert len(records) == 2
        text = records[0].getMessage()
        assert "plugin_hook_failed" in text and "faulty" in text and "kvroute_request_routed" in text

    def test_lifecycle_wrapper_refused(self) -> None:
        """A lifecycle hook implemented as a wrapper is refused at registration, naming the plugin and the hook."""

        class Wrapping:
            @kvroute.hookimpl(wrapper=True)
            def kvroute_request_routed(self, request: RouteRequest, decision: Decision) -> Any:
                return (yield)

        pm = PluginManager(autoload=False)
        refused = r"plugin 'wrapping' implements lifecycle hook kvroute_request_routed as a wrapper"
        with pytest.raises(kvroute.PluginLoadError, match=refused):
            pm.register(Wrapping(), name="wrapping")
        assert "wrapping" not in {p.name for p in pm.plugins()}
        assert not pm.has_implementations("kvroute_request_routed")
