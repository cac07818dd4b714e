"""Router in-flight accounting under faulty plugins, cancellation and membership churn (stateful).

The machine leases requests through real ``with`` / ``async with`` blocks, releases them
normally, with an exception or by cancelling their task, turns faults on and off in the
strategy's callbacks and in lifecycle hooks, and removes and re-adds backends. A model
keeps started-minus-finished per backend id; the invariants compare the fleet with it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator, Sequence
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import kvroute
from kvroute import (
    Backend,
    BackendState,
    BaseStrategy,
    Decision,
    Fleet,
    FleetEvent,
    KvrouteError,
    Lease,
    NoBackendAvailable,
    Outcome,
    PluginManager,
    Router,
    RouteRequest,
)

IDS = ("b0", "b1", "b2")
REQ = RouteRequest.from_text("hello", model="m", request_id="r1")
STRATEGY = "steering"

#: 200 derandomized examples of up to 40 steps each (a few seconds).
MACHINE_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class BlockError(Exception):
    """Raised inside a request's block by the machine."""


class Steering(BaseStrategy):
    """Picks the candidate the machine asks for; its request callbacks raise when told to."""

    def __init__(self) -> None:
        self.index = 0
        self.fail_start = False
        self.fail_finish = False
        self.started = 0
        self.finished = 0

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> BackendState:
        return candidates[self.index % len(candidates)]

    def on_request_start(self, request: RouteRequest, decision: Decision) -> None:
        if self.fail_start:
            raise RuntimeError("start bookkeeping broke")
        self.started += 1

    def on_request_finish(self, request: RouteRequest, decision: Decision, outcome: Outcome) -> None:
        self.finished += 1
        if self.fail_finish:
            raise RuntimeError("finish bookkeeping broke")


class Hooks:
    """Lifecycle hooks that count their calls and raise when told to."""

    def __init__(self) -> None:
        self.fail_fleet = self.fail_routed = self.fail_finished = False
        self.routed = self.finished = 0

    @kvroute.hookimpl
    def kvroute_fleet_changed(self, fleet: Fleet, event: FleetEvent) -> None:
        if self.fail_fleet:
            raise RuntimeError("fleet hook broke")

    @kvroute.hookimpl
    def kvroute_request_routed(self, request: RouteRequest, decision: Decision) -> None:
        self.routed += 1
        if self.fail_routed:
            raise RuntimeError("routed hook broke")

    @kvroute.hookimpl
    def kvroute_request_finished(self, request: RouteRequest, decision: Decision, outcome: Outcome) -> None:
        self.finished += 1
        if self.fail_finished:
            raise RuntimeError("finished hook broke")


class RecordingLog:
    """Stands in for a module's structlog logger: keeps each event and its fields."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _record(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    exception = error = warning = info = debug = _record

    def failures(self) -> Counter[tuple[str, str, str]]:
        """(event, plugin or strategy, hook or callback) of every failure logged."""
        found: Counter[tuple[str, str, str]] = Counter()
        for event, fields in self.events:
            if event == "plugin_hook_failed":
                found[(event, fields["plugin"], fields["hook"])] += 1
            elif event == "strategy_callback_failed":
                found[(event, fields["strategy"], fields["callback"])] += 1
        return found


def hold(router: Router, request: RouteRequest) -> Generator[Lease, BaseException | None, None]:
    """Keep a lease inside a real ``with`` block; send ``None`` to leave it, or an exception to raise in it."""
    with router.route(request) as lease:
        error = yield lease
        if error is not None:
            raise error


class AccountingMachine(RuleBasedStateMachine):
    def __init__(self, logs: RecordingLog) -> None:
        super().__init__()
        self.logs = logs
        logs.events.clear()
        self.fleet = Fleet([Backend(i) for i in IDS])
        self.strategy = Steering()
        self.steady, self.faulty = Hooks(), Hooks()
        plugins = PluginManager(autoload=False)
        plugins.register(self.steady, name="steady")
        plugins.register(self.faulty, name="faulty")  # registered last, so pluggy's order calls it first
        self.router = Router(self.fleet, self.strategy, strategy_name=STRATEGY, plugins=plugins)
        self.model = dict.fromkeys(IDS, 0)  # started minus finished, per backend id
        self.held: list[tuple[Generator[Lease, BaseException | None, None], Lease]] = []
        self.expected_failures: Counter[tuple[str, str, str]] = Counter()

    # -- bookkeeping of the model ----------------------------------------------------------

    def _routed(self, lease: Lease) -> None:
        self.model[lease.backend.id] += 1
        if self.faulty.fail_routed:
            self.expected_failures[("plugin_hook_failed", "faulty", "kvroute_request_routed")] += 1

    def _finished(self, lease: Lease, status: str) -> None:
        assert lease.outcome is not None and lease.outcome.status == status
        self.model[lease.backend.id] -= 1
        if self.faulty.fail_finished:
            self.expected_failures[("plugin_hook_failed", "faulty", "kvroute_request_finished")] += 1
        if self.strategy.fail_finish:
            self.expected_failures[("strategy_callback_failed", STRATEGY, "on_request_finish")] += 1

    def _changed_fleet(self) -> None:
        if self.faulty.fail_fleet:
            self.expected_failures[("plugin_hook_failed", "faulty", "kvroute_fleet_changed")] += 1

    def _expected_pick(self, index: int) -> str | None:
        candidates = self.fleet.candidates(REQ.model)
        return candidates[index % len(candidates)].id if candidates else None

    def _remove(self, backend_id: str) -> None:
        self.fleet.remove(backend_id)
        self._changed_fleet()

    def _add(self, backend_id: str) -> None:
        self.fleet.add(Backend(backend_id))
        self._changed_fleet()

    # -- rules -----------------------------------------------------------------------------

    @rule(
        fleet_hook=st.booleans(),
        routed_hook=st.booleans(),
        finished_hook=st.booleans(),
        strategy_start=st.booleans(),
        strategy_finish=st.booleans(),
    )
    def set_faults(
        self, fleet_hook: bool, routed_hook: bool, finished_hook: bool, strategy_start: bool, strategy_finish: bool
    ) -> None:
        self.faulty.fail_fleet, self.faulty.fail_routed = fleet_hook, routed_hook
        self.faulty.fail_finished = finished_hook
        self.strategy.fail_start, self.strategy.fail_finish = strategy_start, strategy_finish

    @rule(index=st.integers(0, 5))
    def acquire(self, index: int) -> None:
        self.strategy.index = index
        expected = self._expected_pick(index)
        block = hold(self.router, REQ)
        if expected is None:
            with pytest.raises(NoBackendAvailable):
                next(block)
        elif self.strategy.fail_start:
            with pytest.raises(KvrouteError, match=f"strategy '{STRATEGY}' failed in on_request_start"):
                next(block)
        else:
            lease = next(block)
            assert lease.backend.id == expected
            self.held.append((block, lease))
            self._routed(lease)

    @precondition(lambda self: self.held)
    @rule(which=st.integers(0, 100))
    def release_ok(self, which: int) -> None:
        block, lease = self.held.pop(which % len(self.held))
        with pytest.raises(StopIteration):
            block.send(None)
        self._finished(lease, "ok")

    @precondition(lambda self: self.held)
    @rule(which=st.integers(0, 100))
    def release_with_error(self, which: int) -> None:
        block, lease = self.held.pop(which % len(self.held))
        error = BlockError(f"request on {lease.backend.id} broke")
        with pytest.raises(BlockError) as raised:
            block.send(error)
        assert raised.value is error  # the block's own exception, not a hook's or a callback's
        self._finished(lease, "error")

    @precondition(lambda self: self.fleet.candidates(REQ.model) and not self.strategy.fail_start)
    @rule(index=st.integers(0, 5), churn=st.sampled_from(["none", "remove", "remove-and-re-add"]))
    def cancel(self, index: int, churn: str) -> None:
        """A task holding a lease is cancelled, after its backend stayed, left, or left and came back."""
        self.strategy.index = index
        expected = self._expected_pick(index)
        leases: list[Lease] = []

        async def scenario() -> None:
            entered = anyio.Event()

            async def task() -> None:
                async with self.router.route(REQ) as lease:
                    leases.append(lease)
                    entered.set()
                    await anyio.sleep_forever()

            async with anyio.create_task_group() as tg:
                tg.start_soon(task)
                await entered.wait()
                assert leases[0].backend.id == expected
                self._routed(leases[0])
                self.check_counts()
                if churn != "none":
                    self._remove(leases[0].backend.id)
                if churn == "remove-and-re-add":
                    self._add(leases[0].backend.id)
                tg.cancel_scope.cancel()

        anyio.run(scenario)
        self._finished(leases[0], "cancelled")

    @precondition(lambda self: len(self.fleet) > 0)
    @rule(which=st.integers(0, 100))
    def remove(self, which: int) -> None:
        present = [i for i in IDS if i in self.fleet]
        self._remove(present[which % len(present)])

    @precondition(lambda self: len(self.fleet) < len(IDS))
    @rule(which=st.integers(0, 100))
    def re_add(self, which: int) -> None:
        absent = [i for i in IDS if i not in self.fleet]
        self._add(absent[which % len(absent)])

    @rule()
    def release_all(self) -> None:
        self._release_all()
        self.check_all_zero()

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def check_counts(self) -> None:
        for backend_id in IDS:
            if backend_id in self.fleet:
                assert self.fleet.get(backend_id).in_flight == self.model[backend_id], backend_id
        for backend_id in IDS:
            assert self.fleet.in_flight(backend_id) == self.model[backend_id], backend_id

    @invariant()
    def callbacks_balance(self) -> None:
        """Each routed request is started and finished once for the strategy and for every plugin."""
        held = len(self.held)
        assert self.strategy.started - self.strategy.finished == held
        assert self.steady.routed - self.steady.finished == held
        assert self.faulty.routed - self.faulty.finished == held
        assert self.steady.routed == self.faulty.routed  # the faulty plugin never kept the steady one from running

    @invariant()
    def every_failure_logged_once(self) -> None:
        assert self.logs.failures() == self.expected_failures

    # -- the end ---------------------------------------------------------------------------

    def _release_all(self) -> None:
        while self.held:
            self.release_ok(0)

    def check_all_zero(self) -> None:
        assert self.model == dict.fromkeys(IDS, 0)
        assert [self.fleet.in_flight(i) for i in IDS] == [0, 0, 0]
        assert [s.in_flight for s in self.fleet] == [0] * len(self.fleet)

    def teardown(self) -> None:
        self._release_all()
        self.check_all_zero()
        for backend_id in IDS:
            if backend_id not in self.fleet:
                self._add(backend_id)
        assert [s.in_flight for s in self.fleet] == [0, 0, 0]  # nothing left over for re-added backends


class TestRouterAccounting:
    def test_in_flight_is_started_minus_finished(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Under faults, errors, cancellation and churn, each count is started minus finished and ends at zero."""
        logs = RecordingLog()
        monkeypatch.setattr(kvroute.plugins, "log", logs)
        monkeypatch.setattr(kvroute.router, "log", logs)
        run_state_machine_as_test(lambda: AccountingMachine(logs), settings=MACHINE_SETTINGS)
