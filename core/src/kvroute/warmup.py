"""Warm join: let a backend that joins the fleet take its share of the prefixes gradually, or warm.

When a backend joins, hash placement hands it about 1/(N+1) of the prefix keys at once, and
every one of them is cold there while its old home still holds the blocks. Two mechanisms,
usable alone or together, soften that; both are synchronous, do no I/O and take the time
from the caller (a monotonic clock in the proxy, virtual time in the simulator):

* **Slow start** (as Envoy's): `SlowStart.begin` lowers the backend's weight to
  ``initial`` of it and `WeightRamp.advance` raises it in ``steps`` equal steps to the full
  weight over ``period`` seconds. With weighted rendezvous hashing a key only ever moves
  *to* a backend whose weight rises, so the keys move in ``steps`` batches instead of at once.
  Each step is one `Fleet.set_weight` (one ``weight`` event)::

      ramp = SlowStart(period=60.0).begin(fleet, "b7", now=time.monotonic())
      while (due := ramp.advance(time.monotonic())) is not None:
          await anyio.sleep(due - time.monotonic())

* **Pre-fill**: `HotPrefixes` counts, for the requests routed recently, the prefix each
  shares with others (a chat request's messages before its newest user message). When a
  backend joins, `warm_plan` asks the router, in a dry run (`Router.decide`), which of the
  hottest prefixes it will own; the caller sends each one's `HotPrefix.body` (the prefix
  alone, ``max_tokens`` 1) to that backend, a few at a time, while the backend is drained
  (`Fleet.drain`), and undrains it when they are done. Those requests compute the blocks
  that the prefix's first live requests would otherwise compute while a user waits. As the
  backend is drained, they delay no live request; bound the warm-up's time (``anyio.fail_after``)
  and undrain in any case, so a stuck pre-fill cannot keep a backend out of the fleet.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import attrs
from attrs import validators as v

from kvroute.fleet import Fleet
from kvroute.hashing import hash_parts
from kvroute.logs import get_logger
from kvroute.request import RouteRequest, render_messages
from kvroute.router import Router
from kvroute.validators import FINITE_NUMBER, NUMBER, expect, positive_integer

__all__ = ["HotPrefix", "HotPrefixes", "SlowStart", "WeightRamp", "prefix_body", "warm_plan"]

log = get_logger(__name__)


_period = expect("a positive number of seconds", *FINITE_NUMBER, v.gt(0))
_initial = expect("a fraction in (0, 1] of the backend's weight", *NUMBER, v.gt(0), v.le(1))


@attrs.frozen
class SlowStart:
    """Ramp a joining backend's weight from ``initial`` of it to all of it over ``period`` seconds.

    The weight rises in ``steps`` equal steps, the last at ``period``: at ``elapsed`` seconds
    it is ``initial + (1 - initial) * k / steps`` of the full weight, ``k`` the steps that are due.
    """

    period: float = attrs.field(validator=_period)
    initial: float = attrs.field(default=0.1, validator=_initial)
    steps: int = attrs.field(default=10, validator=positive_integer)

    def fraction(self, elapsed: float) -> float:
        """The share of the full weight ``elapsed`` seconds after the join (1.0 from ``period`` on)."""
        if elapsed >= self.period:
            return 1.0
        due = max(0, math.floor(elapsed / self.period * self.steps + 1e-9))
        return self.initial + (1.0 - self.initial) * due / self.steps

    def begin(self, fleet: Fleet, backend_id: str, now: float) -> WeightRamp:
        """Set ``backend_id``'s weight to ``initial`` of its current weight and return the ramp to advance."""
        weight = fleet.get(backend_id).backend.weight
        ramp = WeightRamp(self, fleet, backend_id, weight, now)
        ramp.advance(now)
        return ramp


@attrs.define
class WeightRamp:
    """One backend's slow start in progress (built by `SlowStart.begin`)."""

    slow_start: SlowStart
    fleet: Fleet
    backend_id: str
    #: The weight the ramp ends at: the backend's weight when it began.
    weight: float
    started: float

    def advance(self, now: float) -> float | None:
        """Set the weight due at ``now``; return when the next step is due, or None when the ramp is over.

        The ramp is over at ``period``, or as soon as the backend left the fleet.
        """
        if self.backend_id not in self.fleet:
            return None
        elapsed = now - self.started
        fraction = self.slow_start.fraction(elapsed)
        self.fleet.set_weight(self.backend_id, self.weight * fraction)
        if fraction >= 1.0:
            log.info("slow_start_done", backend=self.backend_id, weight=self.weight)
            return None
        interval = self.slow_start.period / self.slow_start.steps
        due = math.floor(elapsed / interval + 1e-9) + 1
        return self.started + due * interval


def _last_user(request: RouteRequest) -> int:
    """Index of the newest user message of a chat request (-1 when there is none, or for completions)."""
    messages = request.messages
    if request.endpoint != "chat" or not messages:
        return -1
    return max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)


def prefix_body(request: RouteRequest) -> dict[str, Any] | None:
    """The prefix-only request that warms an engine for ``request``, or None when it has no shared part.

    For a chat request: its messages before the newest user message (the system prompt, the
    earlier turns), with ``max_tokens`` 1, the same model and ``cache_salt``, and the fields
    that shape the prompt (``tools``, ``chat_template_kwargs``...). A completions request, or a
    chat whose first message is its newest user message, has none.
    """
    last_user = _last_user(request)
    if last_user <= 0:
        return None
    assert request.messages is not None
    body: dict[str, Any] = dict(request.prompt_options or {})
    body.update(model=request.model, messages=list(request.messages[:last_user]), max_tokens=1)
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    return body


def _prefix_text(request: RouteRequest, last_user: int) -> str:
    """The routing text of the messages before ``last_user`` (sliced from ``request.text`` when offsets are known)."""
    offsets = request.message_offsets
    if offsets is not None:
        return request.text[: offsets[last_user]]
    assert request.messages is not None
    return render_messages(request.messages[:last_user])


@attrs.define
class HotPrefix:
    """A prefix recent requests shared: its warming ``body``, the latest ``request`` that had it, how many did."""

    body: Mapping[str, Any]
    request: RouteRequest
    count: int = 1


@attrs.define
class HotPrefixes:
    """The prefixes of recent requests with how many requests shared each; at most ``capacity``, newest kept.

    Feed it every routed request (`observe`); `hottest` lists the prefixes most requests
    shared. A prefix not seen for ``capacity`` distinct prefixes is forgotten with its count.
    """

    capacity: int = attrs.field(default=1024, validator=positive_integer)
    _entries: OrderedDict[int, HotPrefix] = attrs.field(init=False, factory=OrderedDict)

    def observe(self, request: RouteRequest) -> None:
        """Count ``request``'s prefix (nothing when it has none, see `prefix_body`)."""
        last_user = _last_user(request)
        if last_user <= 0:
            return
        text = _prefix_text(request, last_user)
        key = hash_parts(request.model, request.lora, request.cache_salt, text)
        entry = self._entries.get(key)
        if entry is None:
            body = prefix_body(request)
            assert body is not None
            self._entries[key] = HotPrefix(body, request)
            if len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        else:
            entry.count += 1
            entry.request = request
            self._entries.move_to_end(key)

    def hottest(self, n: int, min_count: int = 2) -> list[HotPrefix]:
        """Up to ``n`` prefixes shared by at least ``min_count`` requests, most shared first (then most recent)."""
        ranked = sorted(reversed(self._entries.values()), key=lambda e: e.count, reverse=True)
        return [e for e in ranked if e.count >= min_count][:n]


def warm_plan(router: Router, backend_id: str, hot: HotPrefixes, n: int, *, scan: int = 1024) -> list[HotPrefix]:
    """The hottest prefixes (at most ``n``, of the ``scan`` hottest) that the router now sends to ``backend_id``.

    Each prefix's latest request is routed in a dry run (`Router.decide`: nothing counted,
    nothing sent), so the plan follows whatever the strategy does. Call it once the backend
    is a member at its full weight, before draining it for the warm-up.
    """
    plan = []
    for entry in hot.hottest(scan):
        decision, _state = router.decide(entry.request)
        if decision.backend.id == backend_id:
            plan.append(entry)
            if len(plan) >= n:
                break
    return plan
