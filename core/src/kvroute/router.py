"""The `Router`: ties a `Fleet` to a `Strategy` and counts requests in flight.

Use it from async code::

    async with router.route(request) as lease:
        await send(lease.backend.url, body)

or from threads::

    with router.route(request) as lease:
        send(lease.backend.url, body)

The request counts as in flight on ``lease.backend`` from entering the block until it
exits, whether it exits normally, by an exception or by cancellation. To retry on another
backend, route again with ``exclude={failed backend ids}``.

Failures of plugin code on this path (see docs/plugin-hooks.md) never leak a count and never
replace the block's own exception: a lifecycle hook that raises is logged
(``plugin_hook_failed``) and the request goes on; a strategy whose ``on_request_start`` raises
has the request refused with a `StrategyError` naming it (nothing stays counted); a strategy
whose ``on_request_finish`` raises is logged (``strategy_callback_failed``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
import attrs

from kvroute.backend import Backend, BackendState
from kvroute.errors import KvrouteError, NoBackendAvailable, StrategyError
from kvroute.fleet import Fleet, FleetEvent
from kvroute.holds import HoldLog
from kvroute.logs import get_logger
from kvroute.plugins import PluginManager
from kvroute.predictor import Predictor
from kvroute.request import RouteRequest
from kvroute.sessions import Sessions
from kvroute.slo_choice import SloChoice
from kvroute.strategy import Decision, Hold, Outcome, Pick, Status, Strategy

__all__ = ["Lease", "Router", "status_for"]

log = get_logger(__name__)


@attrs.define
class Lease:
    """A request placed on a backend. Released exactly once, by the router.

    ``state`` is the backend's live state; it stays the same object if the backend is
    removed and added again while this request runs.
    """

    request: RouteRequest
    decision: Decision
    state: BackendState
    started_at: float
    outcome: Outcome | None = None
    #: Set by `fail`: the request failed on this backend although its block did not raise.
    failure: str | None = None

    @property
    def backend(self) -> Backend:
        return self.decision.backend

    def fail(self, error: str) -> None:
        """Record that the request failed on this backend without raising out of the block."""
        self.failure = error


class _LeaseContext:
    """Acquires on enter, releases on exit; usable with ``with`` and ``async with``."""

    __slots__ = ("_exclude", "_lease", "_request", "_router")

    def __init__(self, router: Router, request: RouteRequest, exclude: Collection[str]) -> None:
        self._router = router
        self._request = request
        self._exclude = exclude
        self._lease: Lease | None = None

    def __enter__(self) -> Lease:
        self._lease = self._router.acquire(self._request, exclude=self._exclude)
        return self._lease

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._lease is not None
        self._router.release(self._lease, *status_for(exc))

    # For async code (the proxy uses plain ``with``): these repeat the two above rather than call them.
    async def __aenter__(self) -> Lease:
        self._lease = self._router.acquire(self._request, exclude=self._exclude)
        return self._lease

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._lease is not None
        self._router.release(self._lease, *status_for(exc))


def _stamped(pick: Decision, strategy: str, duration_s: float) -> Decision:
    """``attrs.evolve(pick, strategy=strategy, duration_s=duration_s)`` at half its cost (once per request).

    Copies every field of `Decision` by name; tests/core/test_router_fast_paths.py fails when
    `Decision` gains a field this does not copy.
    """
    return Decision(
        backend=pick.backend,
        reason=pick.reason,
        strategy=strategy,
        key=pick.key,
        spilled=pick.spilled,
        detail=pick.detail,
        duration_s=duration_s,
        spill_reason=pick.spill_reason,
        data_parallel_rank=pick.data_parallel_rank,
        prediction=pick.prediction,
    )


def status_for(exc: BaseException | None) -> tuple[Status, str | None]:
    """How a request ended, given the exception its block raised (``None``: it did not)."""
    if exc is None:
        return Status.OK, None
    try:
        cancelled = anyio.get_cancelled_exc_class()
    except Exception:  # not inside an async backend: plain threads
        cancelled = ()  # type: ignore[assignment]
    if (cancelled and isinstance(exc, cancelled)) or isinstance(exc, KeyboardInterrupt | GeneratorExit):
        return Status.CANCELLED, type(exc).__name__
    return Status.ERROR, f"{type(exc).__name__}: {exc}"


class Router:
    """Routes requests over a fleet with one strategy; thread-safe.

    Build it with a strategy object, or by name through the plugins with :meth:`create`.
    """

    def __init__(
        self,
        fleet: Fleet,
        strategy: Strategy,
        *,
        strategy_name: str | None = None,
        plugins: PluginManager | None = None,
        sessions: Sessions | None = None,
        slo: SloChoice | None = None,
        holds: HoldLog | None = None,
    ) -> None:
        self.fleet = fleet
        #: Where started requests' holds go for the other router replicas (`kvroute.holds`); ``None``: not kept.
        self.holds = holds
        #: Latency prediction and SLO-aware choice (`kvroute.slo_choice`); ``None``: decisions carry no prediction.
        self.slo = slo
        self.strategy = strategy
        #: Session and conversation bindings (`kvroute.sessions`); ``None``: every request is picked afresh.
        self.sessions = sessions
        self.strategy_name = strategy_name or getattr(strategy, "name", None) or type(strategy).__name__
        self.plugins = plugins
        self._call_routed = bool(plugins and plugins.has_implementations("kvroute_request_routed"))
        self._call_finished = bool(plugins and plugins.has_implementations("kvroute_request_finished"))
        self._on_start = getattr(strategy, "on_request_start", None)
        self._on_finish = getattr(strategy, "on_request_finish", None)
        self._unsubscribe = fleet.subscribe(self._fleet_changed)
        on_change = getattr(strategy, "on_fleet_change", None)
        if on_change is not None:
            # Tell the strategy about the members the fleet already has.
            on_change(FleetEvent("attached", None, fleet.version), list(fleet))

    @classmethod
    def create(
        cls,
        fleet: Fleet,
        strategy: str,
        options: Mapping[str, Any] | None = None,
        *,
        plugins: PluginManager | None = None,
        sessions: Sessions | None = None,
        slo: SloChoice | None = None,
        holds: HoldLog | None = None,
    ) -> Router:
        """Build a router whose strategy is the plugin registered as ``strategy``."""
        plugins = plugins or PluginManager()
        return cls(
            fleet,
            plugins.create_strategy(strategy, options),
            strategy_name=strategy,
            plugins=plugins,
            sessions=sessions,
            slo=slo,
            holds=holds,
        )

    @property
    def predictor(self) -> Predictor | None:
        """The latency predictor the host reports observations to (`Predictor.observe`), if any."""
        return None if self.slo is None else self.slo.predictor

    def close(self) -> None:
        """Stop listening to the fleet."""
        self._unsubscribe()

    # -- fleet events ------------------------------------------------------------------

    def _fleet_changed(self, event: FleetEvent) -> None:
        on_change = getattr(self.strategy, "on_fleet_change", None)
        if on_change is not None:
            on_change(event, list(self.fleet))
        if self.slo is not None and event.kind == "removed" and event.backend is not None:
            self.slo.backend_left(event.backend.id)
        if self.plugins is not None:
            self.plugins.notify("kvroute_fleet_changed", fleet=self.fleet, event=event)

    # -- deciding ----------------------------------------------------------------------

    def _no_backend(self, request: RouteRequest, exclude: Collection[str]) -> NoBackendAvailable:
        members = list(self.fleet)
        if not members:
            return NoBackendAvailable("no backend available: the fleet is empty.")
        serving = [s for s in members if s.serves(request.model)]
        if not serving:
            return NoBackendAvailable(f"no backend available: none of {len(members)} serves model {request.model!r}.")
        unhealthy = sum(not s.healthy for s in serving)
        draining = sum(s.draining for s in serving)
        excluded = sum(s.id in exclude for s in serving)
        return NoBackendAvailable(
            f"no backend available for model {request.model!r}: of {len(serving)} serving it, "
            f"{unhealthy} unhealthy, {draining} draining, {excluded} already failed this request."
        )

    def _normalize(
        self, pick: Pick, candidates: Sequence[BackendState], elapsed: float, stamp: bool = True
    ) -> tuple[Decision, BackendState]:
        if type(pick) is Decision:
            # Unstamped when the SLO choice copies it anyway (it stamps the copy, `SloChoice.choose`).
            decision = _stamped(pick, self.strategy_name, elapsed) if stamp else pick
        elif isinstance(pick, Decision):  # a subclass may add fields: evolve copies them
            decision = attrs.evolve(pick, strategy=self.strategy_name, duration_s=elapsed)
        elif isinstance(pick, BackendState):
            decision = Decision(pick.backend, strategy=self.strategy_name, duration_s=elapsed)
        elif isinstance(pick, Backend):
            decision = Decision(pick, strategy=self.strategy_name, duration_s=elapsed)
        else:
            raise KvrouteError(
                f"strategy {self.strategy_name!r} returned {type(pick).__name__} from pick(); "
                "expected a Decision, a Backend or a BackendState."
            )
        backend = decision.backend
        for state in candidates:  # strategies return a candidate's own Backend: compare identities first
            if state.backend is backend:
                return decision, state
        for state in candidates:
            if state.id == backend.id:
                return decision, state
        raise KvrouteError(
            f"strategy {self.strategy_name!r} picked backend {decision.backend.id!r}, which is not a candidate."
        )

    def decide(self, request: RouteRequest, *, exclude: Collection[str] = ()) -> tuple[Decision, BackendState]:
        """Ask the strategy, without counting the request in flight (dry run)."""
        with self.fleet.lock:
            return self._decide(request, exclude)

    def _decide(self, request: RouteRequest, exclude: Collection[str]) -> tuple[Decision, BackendState]:
        """`decide` for a caller that holds the fleet's lock."""
        candidates = self.fleet.candidates(request.model, exclude)
        if not candidates:
            raise self._no_backend(request, exclude)
        t0 = time.perf_counter()
        if self.sessions is None:
            pick = self.strategy.pick(request, candidates)
        else:
            pick = self.sessions.pick(self.strategy, request, candidates)
        if self.slo is None:
            return self._normalize(pick, candidates, time.perf_counter() - t0)
        decision, state = self._normalize(pick, candidates, 0.0, stamp=False)
        # The choice stamps the decision it makes (one copy instead of two).
        return self.slo.choose(request, decision, state, candidates, self.strategy, name=self.strategy_name, since=t0)

    # -- leasing -----------------------------------------------------------------------

    def acquire(self, request: RouteRequest, *, exclude: Collection[str] = ()) -> Lease:
        """Pick a backend and count the request in flight there; pair with :meth:`release`.

        Raises `NoBackendAvailable` when no backend can take it, `KvrouteError` naming the
        strategy when its ``pick`` returns no candidate, and `StrategyError` (a `KvrouteError`)
        when its ``on_request_start`` raises (the cause is chained); in every case nothing
        stays counted.
        """
        with self.fleet.lock:
            decision, state = self._decide(request, exclude)
            if self.slo is not None:
                self.slo.started(request, decision, state)
            self.fleet.request_started(state)
            lease = Lease(request, decision, state, time.monotonic())
            if self._on_start is not None:
                try:
                    self._on_start(request, decision)
                except BaseException as exc:
                    # The request never started: undo the count; on_request_finish is not called.
                    self.fleet.request_finished(state)
                    if self.slo is not None:
                        self.slo.finished(request)
                    if not isinstance(exc, Exception):
                        raise
                    raise StrategyError(
                        f"strategy {self.strategy_name!r} failed in on_request_start for backend "
                        f"{decision.backend.id!r}: {type(exc).__name__}: {exc}; the request was not routed."
                    ) from exc
            if self.sessions is not None:
                self.sessions.request_started(request, decision)
            if self.holds is not None:
                self._log_holds(request, decision)
        if self._call_routed:
            assert self.plugins is not None
            try:
                self.plugins.notify("kvroute_request_routed", request=request, decision=decision)
            except BaseException as exc:  # KeyboardInterrupt, SystemExit: notify logs the rest
                self.release(lease, *status_for(exc))
                raise
        return lease

    # -- router-replica sync -----------------------------------------------------------

    def _log_holds(self, request: RouteRequest, decision: Decision) -> None:
        """Queue the holds ``request`` made in the session table and the strategy (one per key)."""
        assert self.holds is not None
        made: list[Hold] = []
        if self.sessions is not None:
            made.extend(self.sessions.holds_made(request, decision))
        holds_made = getattr(self.strategy, "holds_made", None)
        if holds_made is not None:
            seen = {hold.key for hold in made}
            made.extend(hold for hold in holds_made(request, decision) if hold.key not in seen)
        if made:
            self.holds.add(made)

    def adopt_holds(self, holds: Sequence[Hold]) -> Counter[str]:
        """Take another replica's holds (`kvroute.strategy.Holds`); counts by result word.

        A hold naming a backend this fleet does not have is ``unknown_backend``; session and
        conversation holds go to the session table (``new``, ``newer``, ``same``, ``older``), and
        every hold to the strategy, if it adopts holds (its own counts, prefixed ``strategy_``).
        """
        results: Counter[str] = Counter()
        with self.fleet.lock:
            known = {state.id for state in self.fleet}
            usable = []
            for hold in holds:
                if hold.backend_id in known:
                    usable.append(hold)
                else:
                    results["unknown_backend"] += 1
            if self.sessions is not None:
                results.update(self.sessions.adopt_holds(usable))
            adopt = getattr(self.strategy, "adopt_holds", None)
            if adopt is not None:
                results.update({f"strategy_{word}": n for word, n in adopt(usable).items()})
        return results

    def release(self, lease: Lease, status: Status | str = Status.OK, error: str | None = None) -> Outcome:
        """Stop counting a lease; idempotent. ``status`` says how it ended, ``error`` why it failed.

        A lease marked with `Lease.fail` and released as ``ok`` ends as ``error`` with that text.

        The count drops exactly once, before any callback runs; a strategy's
        ``on_request_finish`` or a ``kvroute_request_finished`` hook that raises is logged,
        so release does not raise for them.
        """
        with self.fleet.lock:
            if lease.outcome is not None:
                return lease.outcome
            kind = status if type(status) is Status else Status(status)
            if kind is Status.OK and lease.failure is not None:
                kind, error = Status.ERROR, lease.failure
            outcome = Outcome(kind, time.monotonic() - lease.started_at, error)
            lease.outcome = outcome
            self.fleet.request_finished(lease.state)
            if self.slo is not None:
                self.slo.finished(lease.request)
            if self._on_finish is not None:
                try:
                    self._on_finish(lease.request, lease.decision, outcome)
                except Exception as exc:
                    log.exception(
                        "strategy_callback_failed",
                        strategy=self.strategy_name,
                        callback="on_request_finish",
                        backend=lease.backend.id,
                        error=f"{type(exc).__name__}: {exc}",
                    )
        if self._call_finished:
            assert self.plugins is not None
            self.plugins.notify(
                "kvroute_request_finished", request=lease.request, decision=lease.decision, outcome=outcome
            )
        return outcome

    def route(self, request: RouteRequest, *, exclude: Collection[str] = ()) -> _LeaseContext:
        """A context manager (``with`` or ``async with``) holding a `Lease` for the block."""
        return _LeaseContext(self, request, exclude)
