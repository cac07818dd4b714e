"""Admission's accounting under any interleaving: the real `Admission` and `Router`, driven by a state machine.

Requests arrive (with objectives and a priority class), are held, admitted, shed, finish, or their clients
leave while held or while running; the clock moves past deadlines. The requests run as tasks on one event loop
that the machine steps, exactly as the proxy's request path runs them: `Admission.admit`, then a lease from the
router, released when the request ends, then `Admission.wake`. The backends are `kvroute.Fleet` members and the
strategy is a real `kvroute.BaseStrategy` that predicts TTFT from the in-flight count of its pick, so what the
queue may admit follows from the accounting alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvroute import Backend, Fleet, Router
from kvroute.backend import BackendState
from kvroute.request import RouteRequest
from kvroute.slo import Objectives, Prediction, Priority
from kvroute.strategy import BaseStrategy, Decision
from kvroute_server.config import AdmissionConfig
from kvroute_server.ops.metrics import ProxyMetrics
from kvroute_server.proxy.admission import Admission, judge
from kvroute_server.proxy.relay import Exchange

#: The TTFT every request asks for, and what each request in flight on a backend adds to its prediction:
#: a backend meets a new request while it has at most one in flight, so the fleet of two serves four in time.
OBJECTIVE_S = 0.25
PER_REQUEST_S = 0.1
BACKENDS = ("b0", "b1")
CAPACITY = 4
QUEUE_SIZE = 3


class PredictingLeastLoaded(BaseStrategy):
    """Picks the backend with the fewest requests in flight and predicts TTFT from that count."""

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
        best = min(candidates, key=lambda s: (s.in_flight, s.id))
        return Decision(best.backend, reason="least", prediction=Prediction(PER_REQUEST_S * (best.in_flight + 1)))


async def _sink(message: Any) -> None:
    """An ASGI ``send`` that keeps nothing: the answers' bytes are not what this test looks at."""


class AdmissionMachine(RuleBasedStateMachine):
    """Requests through the real admission queue and router; the invariants compare with a plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.fleet = Fleet()
        for name in BACKENDS:
            self.fleet.add(Backend(id=name, url=f"http://{name}.invalid"))
        self.router = Router(self.fleet, PredictingLeastLoaded(), strategy_name="least")
        self.metrics = ProxyMetrics(self.fleet, "least")
        self.now = 0.0
        config = AdmissionConfig(mode="queue", queue_size=QUEUE_SIZE, max_wait=10.0, sheddable="queue")
        self.admission = Admission(config, self.router, self.metrics, clock=lambda: self.now, recheck_s=3600.0)
        self.tasks: dict[int, asyncio.Task[str]] = {}
        self.priority: dict[int, Priority] = {}
        #: Requests holding a lease now (the model of the router's in-flight counts).
        self.leased: set[int] = set()
        #: Requests sent while predicted to miss (critical ones over a full queue or past their deadline).
        self.forced: set[int] = set()
        self.done: dict[int, asyncio.Future[None]] = {}
        self.ended: dict[int, str] = {}
        self.count = 0

    async def _request(self, i: int, priority: Priority) -> str:
        request = RouteRequest.from_text(f"prompt {i}", model="m", request_id=f"r{i}")
        request = attrs.evolve(request, objectives=Objectives(OBJECTIVE_S, None, priority))
        ex = Exchange(request.request_id, 0.0)
        try:
            if not await self.admission.admit(request, _sink, ex, (b"x-request-id", request.request_id.encode())):
                return f"shed:{ex.status}"
            if judge(self.router, request) is not None:
                # Only a critical request is ever sent while no backend is predicted to meet it.
                assert priority is Priority.CRITICAL, f"a {priority} request was sent over capacity"
                self.forced.add(i)
            with self.router.route(request):
                self.leased.add(i)
                try:
                    await self.done[i]
                finally:
                    self.leased.discard(i)
            return "done"
        finally:
            self.admission.wake()

    def _settle(self) -> None:
        """Run the loop until every task has gone as far as it can without outside events."""
        for _ in range(50):
            self.loop.run_until_complete(asyncio.sleep(0))
        for i, task in list(self.tasks.items()):
            if task.done():
                self.ended[i] = "cancelled" if task.cancelled() else task.result()
                del self.tasks[i]
                self.forced.discard(i)

    @rule(priority=st.sampled_from(list(Priority)))
    def arrive(self, priority: Priority) -> None:
        """A request with a TTFT objective arrives."""
        i = self.count
        self.count += 1
        self.priority[i] = priority
        self.done[i] = self.loop.create_future()
        self.tasks[i] = self.loop.create_task(self._request(i, priority))
        self._settle()

    @precondition(lambda self: self.leased)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A running request's answer ends."""
        i = data.draw(st.sampled_from(sorted(self.leased)))
        self.done[i].set_result(None)
        self._settle()

    @precondition(lambda self: self.leased)
    @rule(data=st.data(), priority=st.sampled_from(list(Priority)))
    def finish_as_one_arrives(self, data: st.DataObject, priority: Priority) -> None:
        """A running request's answer ends and a request arrives in the same turn of the loop: the pass its end
        triggers runs before the newcomer is judged, and the request it admits resumes after."""
        i = data.draw(st.sampled_from(sorted(self.leased)))
        self.done[i].set_result(None)
        j = self.count
        self.count += 1
        self.priority[j] = priority
        self.done[j] = self.loop.create_future()

        def arrive() -> None:
            self.tasks[j] = self.loop.create_task(self._request(j, priority))

        self.loop.call_soon(arrive)
        self._settle()

    @precondition(lambda self: self.tasks)
    @rule(data=st.data())
    def disconnect(self, data: st.DataObject) -> None:
        """A client leaves, whether its request is held, running, or being answered."""
        i = data.draw(st.sampled_from(sorted(self.tasks)))
        self.tasks[i].cancel()
        self._settle()

    @rule(seconds=st.sampled_from([0.05, 0.2, 0.3]))
    def time_passes(self, seconds: float) -> None:
        """The clock moves on (deadlines are 0.25 s after arrival); the queue is decided again."""
        self.now += seconds
        self.loop.call_soon(self.admission.wake)
        self._settle()

    @invariant()
    def queue_is_bounded(self) -> None:
        """The queue never holds more than its bound, and its gauge says how many it holds."""
        assert len(self.admission.queue) <= QUEUE_SIZE
        assert self.metrics.slo.queue_length._value.get() == len(self.admission.queue)

    @invariant()
    def in_flight_matches_leases(self) -> None:
        """The fleet counts exactly the requests that hold a lease: held and shed requests count nowhere."""
        assert sum(s.in_flight for s in self.fleet) == len(self.leased)

    @invariant()
    def admitted_within_capacity(self) -> None:
        """Admission never sends more than the fleet is predicted to serve in time, beyond the critical requests
        it had to send anyway."""
        assert len(self.leased) <= CAPACITY + len(self.forced & self.leased)

    @invariant()
    def nothing_held_that_could_go(self) -> None:
        """After the loop settles, every held request is one that no backend is predicted to meet within the time
        its objective has left."""
        for held in self.admission.queue:
            assert self.admission.judge_held(held, self.now) is not None

    @invariant()
    def held_requests_are_live(self) -> None:
        """Every held request belongs to a task still waiting: no trace of a request that has gone."""
        live = {f"r{i}" for i in self.tasks}
        assert {held.request.request_id for held in self.admission.queue} <= live

    def teardown(self) -> None:
        """Every client leaves: nothing stays queued or counted in flight."""
        try:
            for task in self.tasks.values():
                task.cancel()
            self._settle()
            assert not self.tasks
            assert len(self.admission.queue) == 0
            assert self.metrics.slo.queue_length._value.get() == 0
            assert all(s.in_flight == 0 for s in self.fleet)
        finally:
            self.loop.close()


AdmissionMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestAdmissionAccounting = AdmissionMachine.TestCase
