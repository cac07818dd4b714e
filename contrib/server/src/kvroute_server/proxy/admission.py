"""Admission: what happens to a request that no backend is predicted to serve within its objectives.

Off by default (``[admission] mode``, ``--admission``). When on, a request with objectives
(`kvroute_server.proxy.objectives`) is first decided in dry run (`Router.decide`): with SLO-aware choice the
strategy picks a backend predicted to meet the objectives whenever one exists, so a decision whose
`Decision.prediction` does not meet them means none can. Such a request is, by its priority class
(`AdmissionConfig.action`):

- **queued** in a bounded queue (one per process: each worker of ``--workers N`` has its own), ordered by class
  (critical first), then by deadline or by predicted service time. The queue is decided again when a request
  of this process finishes, when a held request leaves it, and every `RECHECK_S` seconds (engine telemetry
  changes predictions too); one request is admitted per pass, and the next pass runs only once the admitted
  one holds its lease, so that the pass sees it in flight (and a newcomer is judged only then, too). A request
  still held at its deadline (its TTFT objective after arrival, at most ``max_wait``) is answered at once: a
  critical one is sent anyway, any other gets 429 (its objective is already missed; sending it would take
  capacity from requests still in time). A full queue takes a request of a higher class by shedding its last
  entry of the lowest class; otherwise the newcomer is shed (or sent, if critical). The queue never holds more
  than ``queue_size``.
- **shed**: answered ``429`` with ``Retry-After`` and an OpenAI-style error body (``type``
  ``rate_limit_error``; ``code`` ``slo_unattainable``, ``admission_queue_full`` or ``slo_deadline_exceeded``).
  Critical requests are never shed.
- **sent** anyway.

A held request whose client leaves is cancelled like any other (`kvroute_server.proxy.client_watch`): it leaves
the queue in the ``finally`` of its wait and was never counted in flight, so nothing of it remains.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from kvroute.errors import KvrouteError
from kvroute.request import RouteRequest
from kvroute.router import Router
from kvroute.slo import Objectives, Prediction, Priority
from kvroute_server.config import AdmissionConfig
from kvroute_server.http.asgi import Send, openai_error, send_json
from kvroute_server.ops.metrics import ProxyMetrics, RequestOutcome
from kvroute_server.proxy.relay import Exchange, Header

__all__ = ["RECHECK_S", "Admission", "AdmissionQueue", "Held", "NoAdmission", "judge"]

#: Seconds between two decisions of the queue while it holds requests and nothing else woke it.
RECHECK_S = 0.05
#: Held requests looked at per pass, in order: one that cannot be served yet does not block the next ones.
SCAN = 16
#: Bounds of the ``Retry-After`` the proxy computes for a shed request, in seconds.
RETRY_AFTER_MIN, RETRY_AFTER_MAX = 1, 60

_RANK = {Priority.CRITICAL: 0, Priority.STANDARD: 1, Priority.SHEDDABLE: 2}
ADMITTED, EVICTED = "admitted", "evicted"


@attrs.define(eq=False)
class Held:
    """A request waiting in the admission queue."""

    request: RouteRequest
    priority: Priority
    #: Monotonic time by which it must be admitted (or answered).
    deadline: float
    #: Predicted TTFT plus predicted decode time when it was queued (the ``service_time`` order).
    service_s: float
    enqueued: float
    seq: int
    #: ``None`` while waiting; `ADMITTED` or `EVICTED` once the queue let go of it.
    result: str | None = None
    wake: asyncio.Event = attrs.field(factory=asyncio.Event)


class AdmissionQueue:
    """The bounded, ordered queue itself: no I/O, no clock, no waiting (the state machine test drives it).

    Order: class (critical first), then deadline or predicted service time, then arrival.
    """

    def __init__(self, bound: int, order: str = "deadline") -> None:
        if bound < 1:
            raise ValueError(f"'bound' must be >= 1 (got {bound}).")
        self.bound = bound
        self.order = order
        self._entries: list[tuple[tuple[int, float, int], Held]] = []

    def _key(self, held: Held) -> tuple[int, float, int]:
        second = held.deadline if self.order == "deadline" else held.service_s
        return (_RANK[held.priority], second, held.seq)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Held]:
        """The held requests in order (a copy: the queue may change while iterating)."""
        return iter([held for _, held in self._entries])

    def __contains__(self, held: object) -> bool:
        return isinstance(held, Held) and self._find(held) is not None

    def offer(self, held: Held) -> tuple[bool, Held | None]:
        """Hold ``held`` if there is room, or room made by evicting the last entry of a lower class.

        Returns (held it, the entry evicted for it or ``None``); the queue never grows past ``bound``.
        """
        if len(self._entries) >= self.bound:
            worst = self._entries[-1][1]
            if _RANK[held.priority] >= _RANK[worst.priority]:
                return False, None
            self._entries.pop()
            bisect.insort(self._entries, (self._key(held), held), key=lambda e: e[0])
            return True, worst
        bisect.insort(self._entries, (self._key(held), held), key=lambda e: e[0])
        return True, None

    def _find(self, held: Held) -> int | None:
        key = self._key(held)
        i = bisect.bisect_left(self._entries, key, key=lambda e: e[0])
        if i < len(self._entries) and self._entries[i][1] is held:
            return i
        return None

    def remove(self, held: Held) -> bool:
        """Take ``held`` out; ``False`` when it was not there (already admitted, evicted or removed)."""
        i = self._find(held)
        if i is None:
            return False
        del self._entries[i]
        return True


def judge(router: Router, request: RouteRequest, objectives: Objectives | None = None) -> Prediction | None:
    """The prediction that misses ``request``'s objectives (or ``objectives``, when given), or ``None`` when it meets
    them (or nothing can tell).

    A dry-run decision (`Router.decide`): nothing is counted in flight. No prediction (a strategy without a
    predictor), or no backend at all, is ``None``: the request goes on and the forwarder answers as ever.
    """
    try:
        decision, _ = router.decide(request)
    except KvrouteError:
        return None
    prediction = decision.prediction
    if prediction is None or prediction.meets(objectives or request.objectives) is not False:
        return None
    return prediction


def _retry_after(miss: Prediction | None, objectives: Objectives, fallback: int) -> int:
    """Seconds until a retry might be met: the predicted TTFT's excess over the objective, rounded up, bounded."""
    if miss is None or objectives.ttft_s is None:
        return fallback
    excess = miss.ttft_s - objectives.ttft_s
    return int(min(RETRY_AFTER_MAX, max(RETRY_AFTER_MIN, math.ceil(excess))))


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "none"
    ms = seconds * 1000
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.3g} ms"  # an objective of 0.001 ms is not "0 ms"


class Admission:
    """Holds, sheds or sends requests no backend is predicted to serve in time (see the module)."""

    def __init__(
        self,
        config: AdmissionConfig,
        router: Router,
        metrics: ProxyMetrics,
        *,
        retry_after_s: int = 1,
        clock: Callable[[], float] = time.monotonic,
        recheck_s: float = RECHECK_S,
    ) -> None:
        self.config = config
        self.recheck_s = recheck_s
        self.router = router
        self.proxy_metrics = metrics
        self.metrics = metrics.slo
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.queue = AdmissionQueue(config.queue_size, config.order)
        self._actions = {p: config.action(p.value) for p in Priority}
        self._seq = itertools.count()
        self._pass_scheduled = False
        #: Held requests admitted by a pass that do not hold their lease yet, and an event set while there are none:
        #: a newcomer is judged only then, so that it sees them in flight (else both could take the same room).
        self._in_transit = 0
        self._settled = asyncio.Event()
        self._settled.set()

    @classmethod
    def create(
        cls, config: AdmissionConfig, router: Router, metrics: ProxyMetrics, *, retry_after_s: int = 1
    ) -> Admission | NoAdmission:
        """The admission for ``config``: `NoAdmission` when its mode is ``off``."""
        if not config.enabled:
            return NoAdmission()
        return cls(config, router, metrics, retry_after_s=retry_after_s)

    # -- the request path -------------------------------------------------------------

    async def admit(self, request: RouteRequest, send: Send, ex: Exchange, id_header: Header) -> bool:
        """``True``: forward the request now; ``False``: it was answered (shed)."""
        objectives = request.objectives
        if objectives is None or not objectives.any:
            return True
        while self._in_transit:
            await self._settled.wait()
        miss = judge(self.router, request)
        priority = objectives.priority
        if miss is None:
            self.metrics.admitted(priority, "met")
            return True
        action = self._actions[priority]
        if action == "send":
            self.metrics.admitted(priority, "sent")
            return True
        if action == "shed":
            self.metrics.admitted(priority, "shed")
            await self._shed(send, ex, id_header, objectives, miss, "predicted_miss")
            return False
        return await self._hold(request, objectives, miss, send, ex, id_header)

    async def _hold(
        self,
        request: RouteRequest,
        objectives: Objectives,
        miss: Prediction,
        send: Send,
        ex: Exchange,
        id_header: Header,
    ) -> bool:
        priority = objectives.priority
        now = self.clock()
        wait = min(objectives.ttft_s or self.config.max_wait, self.config.max_wait)
        decode = (miss.tpot_s or 0.0) * (request.max_tokens or 0)
        held = Held(request, priority, now + wait, miss.ttft_s + decode, now, next(self._seq))
        accepted, evicted = self.queue.offer(held)
        if evicted is not None:
            evicted.result = EVICTED
            evicted.wake.set()
        if not accepted:
            if priority is Priority.CRITICAL:  # never shed
                self.metrics.admitted(priority, "sent")
                return True
            self.metrics.admitted(priority, "shed")
            await self._shed(send, ex, id_header, objectives, miss, "queue_full")
            return False
        self.metrics.admitted(priority, "queued")
        self.metrics.queue_length.set(len(self.queue))
        result = "cancelled"
        try:
            while True:
                if held.result == ADMITTED:
                    result = "admitted"
                    return True
                if held.result == EVICTED:
                    result = "shed"
                    await self._shed(send, ex, id_header, objectives, miss, "queue_full")
                    return False
                remaining = held.deadline - self.clock()
                if remaining <= 0:
                    self.queue.remove(held)
                    if priority is Priority.CRITICAL:
                        result = "sent_late"
                        return True
                    result = "shed"
                    await self._shed(send, ex, id_header, objectives, miss, "deadline", waited=self.clock() - now)
                    return False
                try:
                    async with asyncio.timeout(min(remaining, self.recheck_s)):
                        await held.wake.wait()
                    held.wake.clear()
                except TimeoutError:
                    self._kick()
        finally:
            if held.result == ADMITTED:  # it takes its lease as soon as this returns, before anything else runs
                self._in_transit -= 1
                if not self._in_transit:
                    self._settled.set()
            self.queue.remove(held)  # a client that left (cancelled) leaves nothing behind
            self.metrics.queue_length.set(len(self.queue))
            self.metrics.waited(priority, result, self.clock() - now)
            self._kick()  # the next pass runs after this task holds its lease (or has gone)

    async def _shed(
        self,
        send: Send,
        ex: Exchange,
        id_header: Header,
        objectives: Objectives,
        miss: Prediction | None,
        reason: str,
        *,
        waited: float | None = None,
    ) -> None:
        """Answer 429 with ``Retry-After`` and an OpenAI-style error body; count it by class and reason."""
        retry = _retry_after(miss, objectives, self.retry_after_s)
        wanted = f"TTFT {_ms(objectives.ttft_s)}, TPOT {_ms(objectives.tpot_s)}"
        predicted = f"TTFT {_ms(miss.ttft_s)}, TPOT {_ms(miss.tpot_s)}" if miss is not None else "unknown"
        if reason == "queue_full":
            message, code = (
                f"No backend is predicted to meet this request's objectives ({wanted}; best predicted {predicted}) "
                f"and the admission queue is full ({self.queue.bound} requests held).",
                "admission_queue_full",
            )
        elif reason == "deadline":
            message, code = (
                f"This request waited {_ms(waited)} for a backend predicted to meet its objectives ({wanted}) "
                "and its deadline passed.",
                "slo_deadline_exceeded",
            )
        else:
            message, code = (
                f"No backend is predicted to meet this request's objectives ({wanted}; best predicted {predicted}).",
                "slo_unattainable",
            )
        message += f" Retry after {retry} s."
        priority = objectives.priority
        self.metrics.shed(priority, reason)
        ex.status, ex.outcome, ex.error = 429, RequestOutcome.REJECTED, message
        self.proxy_metrics.child(self.proxy_metrics.rejected, "429").inc()
        body = openai_error(429, message, code=code)
        body["error"]["type"] = "rate_limit_error"
        await send_json(send, 429, body, [(b"retry-after", str(retry).encode()), id_header])

    # -- re-deciding ----------------------------------------------------------------------

    def _kick(self) -> None:
        """Have the queue decided again soon (once, however many ask before it runs)."""
        if self._pass_scheduled or not len(self.queue):
            return
        self._pass_scheduled = True
        asyncio.get_running_loop().call_soon(self._pass)

    def _pass(self) -> None:
        """Wake the held requests past their deadline (each answers for itself), then admit the first (in order,
        among the first `SCAN`) that a backend is predicted to meet."""
        self._pass_scheduled = False
        now = self.clock()
        for held in self.queue:
            if held.deadline <= now:
                held.wake.set()
        for held in itertools.islice(self.queue, SCAN):
            if held.deadline <= now:
                continue
            if self.judge_held(held, now) is None:
                self.queue.remove(held)
                held.result = ADMITTED
                self._in_transit += 1
                self._settled.clear()
                held.wake.set()
                return

    def judge_held(self, held: Held, now: float) -> Prediction | None:
        """`judge` for a held request: its TTFT objective less the time it has waited (its budget left)."""
        objectives = held.request.objectives
        if objectives is not None and objectives.ttft_s is not None:
            left = objectives.ttft_s - (now - held.enqueued)
            if left <= 0:
                return Prediction(math.inf)
            objectives = attrs.evolve(objectives, ttft_s=left)
        return judge(self.router, held.request, objectives)

    def wake(self) -> None:
        """Decide the queue again soon: a request of this process finished (its backend has room again), or time
        passed."""
        self._kick()

    def describe(self) -> dict[str, Any]:
        """The settings and this process's queue, for the status page."""
        c = self.config
        return {
            "mode": c.mode,
            "queue_size": c.queue_size,
            "order": c.order,
            "max_wait_s": c.max_wait,
            "actions": {p.value: a for p, a in self._actions.items()},
            "held_here": len(self.queue),
        }


class NoAdmission:
    """Admission turned off: every request is forwarded at once."""

    queue = None

    async def admit(self, request: RouteRequest, send: Send, ex: Exchange, id_header: Header) -> bool:
        """Always ``True``."""
        return True

    def wake(self) -> None:
        """Nothing to decide."""

    def describe(self) -> None:
        """``None``: no admission."""
        return None
