"""Shadow strategies: what other strategies would have done with the live traffic, in dry run.

A `ShadowSet` is told of every request the live strategy placed (`ShadowSet.routed`) with the
candidates the live strategy chose from. Each shadow strategy then picks among exactly those
candidates, and every strategy's pick is scored with a `kvroute.cache_view.CacheView`.

What each shadow keeps, and so what the comparison means
--------------------------------------------------------
Each shadow replays the traffic **as if it had been the live strategy from the start**, as far
as that can be done without sending anything:

* its own strategy object (built from its own options), told of its own picks
  (``on_request_start`` / ``on_request_finish`` with its own `Decision`), never of the live ones;
* its own in-flight counts: a private `BackendState` per backend whose ``in_flight`` counts the
  requests it placed there that are still running (a request ends for every shadow when the live
  request ends, so durations are the live ones);
* its own cache view, recording its own picks: its predicted reuse is what it would have found
  in caches it had filled itself.

What it shares with the live strategy: the requests, their timing, the candidates (membership,
health, draining, served models: fleet events reach every shadow as they reach the live
strategy), and the engines' reported load (``BackendState.load``), which the live placements
shaped. KV cache events from adapters go to the live strategy only.

The live strategy is scored the same way, with the fleet cache view (`ShadowSet.view`) fed by
where requests were actually sent. "Agreement" counts requests where a shadow picked the
backend the live strategy picked.

Nothing here changes the live fleet: no lease, no in-flight count, no hook.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kvroute.backend import Backend, BackendState
from kvroute.cache_view import CacheView, PromptBlocks, Reuse
from kvroute.errors import ConfigError
from kvroute.fleet import Fleet, FleetEvent
from kvroute.logs import get_logger
from kvroute.plugins import PluginManager
from kvroute.request import RouteRequest
from kvroute.strategy import Decision, Outcome, Strategy

__all__ = ["Shadow", "ShadowRound", "ShadowSet", "Verdict"]

log = get_logger(__name__)

# The private state fields a shadow copies from the live state before each pick (all but in_flight).
_MIRRORED = tuple(f.name for f in attrs.fields(BackendState) if f.name != "in_flight")


@attrs.frozen
class Verdict:
    """One strategy's answer for one request: its backend, whether the live strategy chose the same, its reuse.

    ``backend`` is ``None`` when a shadow failed (``error`` says how).
    """

    strategy: str
    live: bool
    backend: str | None
    agrees: bool
    reuse: Reuse
    duration_s: float = 0.0
    error: str | None = None


class Shadow:
    """One shadow strategy and its own world (private backend states and cache view)."""

    def __init__(self, name: str, strategy: Strategy, view: CacheView) -> None:
        self.name = name
        self.strategy = strategy
        self.view = view
        self._states: dict[str, BackendState] = {}

    def _own(self, live: BackendState) -> BackendState:
        own = self._states.get(live.id)
        if own is None:
            own = self._states[live.id] = BackendState(live.backend)
        for name in _MIRRORED:
            setattr(own, name, getattr(live, name))
        return own

    def fleet_changed(self, event: FleetEvent, members: Sequence[BackendState]) -> None:
        if event.kind == "removed" and event.backend is not None:
            # A request still running there keeps the old object through its ShadowRound.
            self._states.pop(event.backend.id, None)
            self.view.forget(event.backend.id)
        on_change = getattr(self.strategy, "on_fleet_change", None)
        if on_change is not None:
            on_change(event, [self._own(m) for m in members])

    def decide(
        self, request: RouteRequest, candidates: Sequence[BackendState], blocks: PromptBlocks, live: str
    ) -> tuple[Verdict, tuple[Decision, BackendState] | None]:
        """Pick, count the pick in flight, score and record it; a failing strategy gives an error verdict."""
        own = [self._own(c) for c in candidates]
        t0 = time.perf_counter()
        try:
            decision, state = _normalize(self.name, self.strategy.pick(request, own), own)
            elapsed = time.perf_counter() - t0
            state.in_flight += 1
            on_start = getattr(self.strategy, "on_request_start", None)
            if on_start is not None:
                on_start(request, decision)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.warning("shadow_failed", strategy=self.name, request_id=request.request_id, error=error)
            return Verdict(self.name, False, None, False, Reuse(0, 0, blocks.units), error=error), None
        reuse = self.view.reuse(blocks, state.id, (c.id for c in candidates))
        self.view.record(state, blocks)
        verdict = Verdict(self.name, False, state.id, state.id == live, reuse, elapsed)
        return verdict, (decision, state)

    def finish(self, request: RouteRequest, decision: Decision, state: BackendState, outcome: Outcome) -> None:
        state.in_flight -= 1
        on_finish = getattr(self.strategy, "on_request_finish", None)
        if on_finish is None:
            return
        try:
            on_finish(request, decision, outcome)
        except Exception as exc:
            log.warning("shadow_failed", strategy=self.name, callback="on_request_finish", error=str(exc))


def _normalize(name: str, pick: object, candidates: Sequence[BackendState]) -> tuple[Decision, BackendState]:
    if isinstance(pick, Decision):
        decision = attrs.evolve(pick, strategy=name)
    elif isinstance(pick, BackendState | Backend):
        backend = pick.backend if isinstance(pick, BackendState) else pick
        decision = Decision(backend, strategy=name)
    else:
        raise TypeError(f"pick() returned {type(pick).__name__}; expected a Decision, a Backend or a BackendState.")
    for state in candidates:
        if state.id == decision.backend.id:
            return decision, state
    raise ValueError(f"pick() chose {decision.backend.id!r}, which is not a candidate.")


@attrs.define
class ShadowRound:
    """One request as every strategy decided it; `ShadowSet.finished` ends it (once)."""

    request: RouteRequest
    verdicts: list[Verdict]
    _running: list[tuple[Shadow, Decision, BackendState]] = attrs.field(factory=list, alias="running")
    done: bool = False

    @property
    def live(self) -> Verdict:
        return self.verdicts[0]


class ShadowSet:
    """The live strategy's fleet cache view and the shadows, listening to one fleet.

    Build it with `create` (strategies by plugin name) or from objects; call `routed` after each
    live placement and `finished` when the request ends; `close` to stop listening.
    """

    def __init__(
        self,
        fleet: Fleet,
        live_name: str,
        shadows: Mapping[str, Strategy],
        view_factory: Callable[[], CacheView] = CacheView,
    ) -> None:
        if live_name in shadows:
            raise ConfigError(f"shadow {live_name!r} is the live strategy; a shadow must be another strategy.")
        self.fleet = fleet
        self.live_name = live_name
        self.view = view_factory()
        self.shadows = [Shadow(name, strategy, view_factory()) for name, strategy in shadows.items()]
        with fleet.lock:
            members = list(fleet)
            for shadow in self.shadows:
                shadow.fleet_changed(FleetEvent("attached", None, fleet.version), members)
            self._unsubscribe = fleet.subscribe(self._fleet_changed)

    @classmethod
    def create(
        cls,
        fleet: Fleet,
        live_name: str,
        names: Sequence[str],
        options: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        plugins: PluginManager | None = None,
        view_factory: Callable[[], CacheView] = CacheView,
    ) -> ShadowSet:
        """Build each shadow from its plugin and its options (``options[name]``)."""
        plugins = plugins or PluginManager()
        options = options or {}
        strategies = {name: plugins.create_strategy(name, options.get(name)) for name in names}
        return cls(fleet, live_name, strategies, view_factory)

    @property
    def names(self) -> list[str]:
        """The live strategy's name, then the shadows' in order."""
        return [self.live_name, *(s.name for s in self.shadows)]

    def close(self) -> None:
        """Stop listening to the fleet."""
        self._unsubscribe()

    def _fleet_changed(self, event: FleetEvent) -> None:
        if event.kind == "removed" and event.backend is not None:
            self.view.forget(event.backend.id)
        members = list(self.fleet)
        for shadow in self.shadows:
            shadow.fleet_changed(event, members)

    def routed(self, request: RouteRequest, live: Decision, candidates: Sequence[BackendState]) -> ShadowRound:
        """The live strategy sent ``request`` to ``live.backend`` out of ``candidates``: score it, ask every shadow."""
        with self.fleet.lock:
            view = self.view
            blocks = view.blocks(request)
            chosen = live.backend.id
            verdicts = [
                Verdict(self.live_name, True, chosen, True, view.reuse(blocks, chosen, (c.id for c in candidates)))
            ]
            for state in candidates:
                if state.id == chosen:
                    view.record(state, blocks)
                    break
            round_ = ShadowRound(request, verdicts)
            for shadow in self.shadows:
                verdict, running = shadow.decide(request, candidates, blocks, chosen)
                verdicts.append(verdict)
                if running is not None:
                    round_._running.append((shadow, *running))
            return round_

    def finished(self, round_: ShadowRound, outcome: Outcome) -> None:
        """The live request ended: it ends for every shadow too (idempotent)."""
        if round_.done:
            return
        round_.done = True
        with self.fleet.lock:
            for shadow, decision, state in round_._running:
                shadow.finish(round_.request, decision, state, outcome)
