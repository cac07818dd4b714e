"""Warm join: a backend that joins a serving fleet is pre-filled and/or ramped in (docs/warm-join.md).

Hash placement hands a joining backend about 1/(N+1) of the prefixes at once, every one cold
there. `WarmJoin` applies the core's mechanisms (`kvroute.warmup`) in the proxy:

* it feeds `HotPrefixes` from the request path through the ``kvroute_request_routed`` hook
  (an internal plugin object, registered before the router is built, because the router
  looks up once whether anyone implements the hook);
* when `BackendSet` reports a join (`BackendSet.watch`), it asks the router in a dry run which
  of the hottest prefixes the backend will own (`warm_plan`) and holds the backend
  (`BackendSet.hold`: no new requests), all synchronously, before any request can reach it;
* a background task then sends each planned prefix (``max_tokens`` 1) straight to the backend,
  a few at a time and within a deadline, releases the hold, and ramps the weight
  (`SlowStart`); without pre-fill the ramp starts at the join itself.

What counts as a join: a backend *added* (admin API, discovery, a discovered backend whose URL
changed) after the proxy started serving, while another member is routable. The fleet given at
startup, discovery's first answers and the admin journal replayed at start are not joins, nor is
an ejected backend coming back healthy (it was never removed). A backend that leaves ends its
warm-up; so does the proxy stopping. Failures are logged, never raised: a warm-up that fails
leaves the backend serving at full weight, as without warm join.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus

from kvroute import hookimpl
from kvroute.plugins import PluginManager
from kvroute.request import RouteRequest
from kvroute.router import Router
from kvroute.strategy import Decision
from kvroute.warmup import HotPrefix, HotPrefixes, SlowStart, WeightRamp, warm_plan
from kvroute_server.config import WarmJoinConfig
from kvroute_server.fleet.backends import BackendSet

__all__ = ["NoWarmJoin", "WarmJoin"]

log = structlog.get_logger(__name__)

#: Where the pre-fill requests go (the chat prefixes `kvroute.warmup.prefix_body` builds).
PREFILL_PATH = "/v1/chat/completions"


class _RoutedObserver:
    """The internal plugin that counts each routed request's prefix in `HotPrefixes` (microseconds)."""

    def __init__(self, hot: HotPrefixes) -> None:
        self.hot = hot

    @hookimpl
    def kvroute_request_routed(self, request: RouteRequest, decision: Decision) -> None:
        self.hot.observe(request)


class WarmJoin:
    """Warms backends that join while the proxy serves; build with `create`, run with `run`."""

    def __init__(self, config: WarmJoinConfig, backends: BackendSet, hot: HotPrefixes | None) -> None:
        self.config = config
        self.backends = backends
        self.hot = hot
        self.slow_start = (
            SlowStart(config.slow_start, config.slow_start_initial, config.slow_start_steps)
            if config.slow_start > 0
            else None
        )
        self._router: Router | None = None
        self._task_group: TaskGroup | None = None
        #: The warm-up in progress per backend id, to end it when the backend leaves.
        self._scopes: dict[str, anyio.CancelScope] = {}

    @classmethod
    def create(cls, config: WarmJoinConfig, backends: BackendSet, plugins: PluginManager) -> WarmJoin | NoWarmJoin:
        """The warm join for ``config`` (`NoWarmJoin` when off); call before building the router (see module doc)."""
        if not config.enabled:
            return NoWarmJoin()
        hot = None
        if config.prefill > 0:
            hot = HotPrefixes()
            plugins.register(_RoutedObserver(hot), name=f"kvroute_server.fleet.warm_join.{id(hot):x}")
        return cls(config, backends, hot)

    async def run(self, router: Router, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Watch for joins until cancelled; start it once the initial fleet is in place (joins before are not)."""
        self._router = router
        async with anyio.create_task_group() as tg:
            self._task_group = tg
            unwatch = self.backends.watch(self._changed)
            try:
                task_status.started()
                await anyio.sleep_forever()
            finally:
                unwatch()
                self._task_group = None

    @property
    def warming(self) -> list[str]:
        """The backends whose warm-up (pre-fill or ramp) is in progress."""
        return sorted(self._scopes)

    # -- a join: synchronous, inside `BackendSet.add` --------------------------------------

    def _changed(self, backend_id: str, joined: bool) -> None:
        scope = self._scopes.pop(backend_id, None)
        if scope is not None:  # it left (or was replaced): its warm-up ends
            scope.cancel()
        if joined:
            self._joined(backend_id)

    def _joined(self, backend_id: str) -> None:
        assert self._task_group is not None and self._router is not None
        fleet = self.backends.fleet
        if not any(state.routable for state in fleet if state.id != backend_id):
            log.info("warm_join_skipped", backend=backend_id, reason="no other routable backend")
            return
        plan: list[HotPrefix] = []
        if self.hot is not None:
            try:
                plan = warm_plan(self._router, backend_id, self.hot, self.config.prefill)
            except Exception as exc:  # a plan that fails only loses the pre-fill
                log.warning("warm_join_plan_failed", backend=backend_id, error=f"{type(exc).__name__}: {exc}")
        ramp = None
        if plan:
            self.backends.hold(backend_id)
        elif self.slow_start is None:
            log.info("warm_join_skipped", backend=backend_id, reason="no hot prefix to pre-fill")
            return
        else:  # no pre-fill: the ramp starts now, before a request can see the full weight
            ramp = self.slow_start.begin(fleet, backend_id, time.monotonic())
        log.info("warm_join_started", backend=backend_id, prefixes=len(plan), slow_start_s=self.config.slow_start)
        scope = self._scopes[backend_id] = anyio.CancelScope()
        self._task_group.start_soon(self._warm, backend_id, plan, ramp, scope, name=f"warm join {backend_id}")

    # -- the warm-up: a background task ----------------------------------------------------

    async def _warm(
        self, backend_id: str, plan: list[HotPrefix], ramp: WeightRamp | None, scope: anyio.CancelScope
    ) -> None:
        try:
            with scope:
                if plan:
                    await self._prefill(backend_id, plan)
                    if self.slow_start is not None:  # lowered before the release: never a request at full weight
                        ramp = self.slow_start.begin(self.backends.fleet, backend_id, time.monotonic())
                    self.backends.end_hold(backend_id)
                if ramp is not None:
                    await self._ramp(backend_id, ramp)
        except Exception as exc:  # a bug here must not take the proxy down (the hold ends with it)
            log.error("warm_join_failed", backend=backend_id, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            self.backends.end_hold(backend_id)
        finally:
            if self._scopes.get(backend_id) is scope:
                del self._scopes[backend_id]

    async def _prefill(self, backend_id: str, plan: list[HotPrefix]) -> None:
        """Send each planned prefix to the backend, `prefill_concurrency` at a time, within `prefill_timeout`."""
        config = self.config
        http = self.backends.http_for(backend_id, config.prefill_timeout)
        limiter = anyio.CapacityLimiter(config.prefill_concurrency)
        outcome = {"sent": 0, "failed": 0}
        errors: list[str] = []

        async def send(body: Mapping[str, Any]) -> None:
            async with limiter:
                try:
                    reply = await http.post(PREFILL_PATH, body)
                except OSError as exc:
                    outcome["failed"] += 1
                    errors.append(str(exc))
                    return
            if 200 <= reply.status < 300:
                outcome["sent"] += 1
            else:
                outcome["failed"] += 1
                errors.append(f"status {reply.status}")

        started = time.monotonic()
        with anyio.move_on_after(config.prefill_timeout):
            async with anyio.create_task_group() as tg:
                for entry in plan:
                    tg.start_soon(send, entry.body)
        log.info(
            "warm_join_prefilled",
            backend=backend_id,
            planned=len(plan),
            sent=outcome["sent"],
            failed=outcome["failed"],
            unfinished=len(plan) - outcome["sent"] - outcome["failed"],
            took_s=round(time.monotonic() - started, 3),
            error=errors[0] if errors else None,
        )

    async def _ramp(self, backend_id: str, ramp: WeightRamp) -> None:
        """Raise the weight step by step; stop early when someone else set the weight (the operator wins)."""
        fleet = self.backends.fleet
        while (due := ramp.advance(time.monotonic())) is not None:
            expected = fleet.get(backend_id).backend.weight
            await anyio.sleep(max(0.0, due - time.monotonic()))
            if backend_id not in fleet:
                return
            weight = fleet.get(backend_id).backend.weight
            if weight != expected:
                log.info("slow_start_overridden", backend=backend_id, weight=weight)
                return


class NoWarmJoin:
    """Warm join off: a backend that joins serves at once at full weight."""

    async def run(self, router: Router, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Report started at once: there are no joins to watch."""
        task_status.started()

    @property
    def warming(self) -> list[str]:
        """No backend is ever warming."""
        return []
