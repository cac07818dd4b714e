"""The fleet: which backends exist, which may take requests, and a version that counts changes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Literal

import attrs

from kvroute.backend import Backend, BackendState, EngineLoad
from kvroute.errors import ConfigError, KvrouteError, UnknownBackend
from kvroute.logs import get_logger

__all__ = ["Fleet", "FleetEvent", "FleetEventKind"]

log = get_logger(__name__)

FleetEventKind = Literal[
    "attached", "added", "removed", "draining", "undrained", "healthy", "unhealthy", "weight", "models", "labels"
]


@attrs.frozen
class FleetEvent:
    """One membership change: what happened, to which backend, and the fleet version after it.

    ``attached`` (no backend) is sent once to a strategy when a router starts using it, so
    it learns the members the fleet already had. ``models`` says the models a backend reports
    serving changed (`Fleet.set_served_models`): which backends may take a model, not placement.
    """

    kind: FleetEventKind
    backend: Backend | None
    version: int


class Fleet:
    """Membership with a version number; thread-safe.

    Every change that can alter routing (add, remove, drain, health, weight, served models)
    bumps ``version`` and is passed to subscribers (the router forwards it to the strategy and
    to the ``kvroute_fleet_changed`` hook). Load updates and in-flight counts do not.

    In-flight counts change only through :meth:`request_started` and
    :meth:`request_finished` (the router calls them). A backend removed while requests
    still run on it keeps its state object until they finish; adding the same id again
    before then revives that object, so those requests keep counting on it.
    """

    def __init__(self, backends: Collection[Backend] = ()) -> None:
        self._lock = threading.RLock()
        self._states: dict[str, BackendState] = {}
        # Removed backends with requests still in flight, by id (dropped when the count reaches 0).
        self._departed: dict[str, BackendState] = {}
        self._subscribers: list[Callable[[FleetEvent], None]] = []
        # Callbacks waiting for a backend's last request to finish (`when_idle`), by id.
        self._idle: dict[str, list[Callable[[], None]]] = {}
        self.version = 0
        for backend in backends:
            self.add(backend)

    # -- reading -----------------------------------------------------------------------

    @property
    def lock(self) -> threading.RLock:
        """The lock that guards membership and in-flight counts (re-entrant)."""
        return self._lock

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, backend_id: object) -> bool:
        return backend_id in self._states

    def __iter__(self) -> Iterator[BackendState]:
        with self._lock:
            return iter(list(self._states.values()))

    def get(self, backend_id: str) -> BackendState:
        """The state of one backend; raises `UnknownBackend`."""
        try:
            return self._states[backend_id]
        except KeyError:
            known = ", ".join(sorted(self._states)) or "none"
            raise UnknownBackend(f"no backend with id {backend_id!r} (known: {known})") from None

    def backends(self) -> list[Backend]:
        """Every member's identity, in insertion order."""
        with self._lock:
            return [s.backend for s in self._states.values()]

    def candidates(self, model: str | None = None, exclude: Collection[str] = ()) -> list[BackendState]:
        """Backends that may take a new request for ``model``: healthy, not draining, serving it, not excluded.

        ``exclude`` is for the backends that already failed this request (retries); a backend that
        does not serve ``model`` is left out by `BackendState.serves`, not by the caller.
        """
        with self._lock:
            if not exclude:  # the first attempt of every request
                return [s for s in self._states.values() if s.healthy and not s.draining and s.serves(model)]
            return [
                s
                for s in self._states.values()
                if s.healthy and not s.draining and s.id not in exclude and s.serves(model)
            ]

    def models(self) -> set[str]:
        """The union of the models members serve (reported once known, else declared; see `BackendState.models`)."""
        with self._lock:
            return {m for s in self._states.values() for m in s.models}

    # -- changing ----------------------------------------------------------------------

    def subscribe(self, callback: Callable[[FleetEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` after every change; returns a function that unsubscribes."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def _emit(self, kind: FleetEventKind, backend: Backend) -> FleetEvent:
        self.version += 1
        event = FleetEvent(kind=kind, backend=backend, version=self.version)
        log.info("fleet_changed", change=kind, backend=backend.id, version=self.version)
        for callback in list(self._subscribers):
            callback(event)
        return event

    def add(self, backend: Backend) -> FleetEvent:
        """Add a backend; its id must be new.

        When a backend of that id was removed while requests were in flight on it, and some
        still are, the new member starts with those requests counted (it reuses the state
        object their leases hold, reset to a fresh member's health, drain and load).
        """
        with self._lock:
            if backend.id in self._states:
                raise ConfigError(f"backend id {backend.id!r} is already in the fleet; ids must be unique.")
            fresh = BackendState(backend)
            state = self._departed.pop(backend.id, None)
            if state is None:
                state = fresh
            else:
                for field in attrs.fields(BackendState):
                    if field.name != "in_flight":
                        setattr(state, field.name, getattr(fresh, field.name))
            self._states[backend.id] = state
            return self._emit("added", backend)

    def remove(self, backend_id: str) -> FleetEvent:
        """Remove a backend at once (requests in flight on it finish on their own)."""
        with self._lock:
            state = self.get(backend_id)
            del self._states[backend_id]
            if state.in_flight > 0:
                self._departed[backend_id] = state
            return self._emit("removed", state.backend)

    def drain(self, backend_id: str, draining: bool = True) -> FleetEvent | None:
        """Stop (or resume) sending new requests to a backend; in-flight ones finish."""
        with self._lock:
            state = self.get(backend_id)
            if state.draining == draining:
                return None
            state.draining = draining
            return self._emit("draining" if draining else "undrained", state.backend)

    def set_healthy(self, backend_id: str, healthy: bool) -> FleetEvent | None:
        """Mark a backend healthy or unhealthy (ejected); no event when nothing changes."""
        with self._lock:
            state = self.get(backend_id)
            if state.healthy == healthy:
                return None
            state.healthy = healthy
            return self._emit("healthy" if healthy else "unhealthy", state.backend)

    def set_weight(self, backend_id: str, weight: float) -> FleetEvent | None:
        """Change a backend's capacity weight."""
        with self._lock:
            state = self.get(backend_id)
            if state.backend.weight == float(weight):
                return None
            try:
                state.backend = attrs.evolve(state.backend, weight=weight)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            return self._emit("weight", state.backend)

    def set_models(self, backend_id: str, models: Iterable[str]) -> FleetEvent | None:
        """Change the models a backend declares (a ``models`` event; its reported ones, when known, still win)."""
        with self._lock:
            state = self.get(backend_id)
            declared = frozenset(models)
            if state.backend.models == declared:
                return None
            state.backend = attrs.evolve(state.backend, models=declared)
            return self._emit("models", state.backend)

    def set_labels(self, backend_id: str, labels: Mapping[str, str]) -> FleetEvent | None:
        """Change a backend's labels (a ``labels`` event; routing does not depend on them)."""
        with self._lock:
            state = self.get(backend_id)
            if dict(state.backend.labels) == dict(labels):
                return None
            state.backend = attrs.evolve(state.backend, labels=labels)
            return self._emit("labels", state.backend)

    def set_served_models(self, backend_id: str, models: Iterable[str] | None) -> FleetEvent | None:
        """Record the models a backend's engine reports serving (``None``: unknown again, the declared ones count).

        They replace the declared ``Backend.models`` for routing; an empty list, like empty declared
        models, means any model. A change is a ``models`` event; no event when nothing changes.
        """
        served = None if models is None else frozenset(models)
        with self._lock:
            state = self.get(backend_id)
            if state.served_models == served:
                return None
            state.served_models = served
            return self._emit("models", state.backend)

    def request_started(self, state: BackendState) -> None:
        """Count one more request in flight on ``state``, a member (the router calls this)."""
        with self._lock:
            if self._states.get(state.id) is not state:
                raise UnknownBackend(
                    f"backend {state.id!r} is not a member of this fleet; cannot start a request on it."
                )
            state.in_flight += 1

    def request_finished(self, state: BackendState) -> None:
        """Count one request fewer on ``state``, a member or a removed backend (the router calls this).

        A removed backend's state is forgotten once its last request finishes.
        """
        with self._lock:
            if state.in_flight <= 0:
                raise KvrouteError(
                    f"backend {state.id!r} has no request in flight (got in_flight={state.in_flight}); "
                    "each request must finish exactly once."
                )
            state.in_flight -= 1
            if state.in_flight == 0 and self._departed.get(state.id) is state:
                del self._departed[state.id]
            if state.in_flight == 0 and self._idle:
                for callback in self._idle.pop(state.id, ()):
                    callback()

    def when_idle(self, backend_id: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` once, when the last request in flight on ``backend_id`` finishes; returns a cancel.

        It runs inside `request_finished`, under the lock, on the thread that finished the request (so that a
        waiter on an event loop need not poll `in_flight`).
        """
        with self._lock:
            self._idle.setdefault(backend_id, []).append(callback)

        def cancel() -> None:
            with self._lock:
                waiting = self._idle.get(backend_id)
                if waiting is not None and callback in waiting:
                    waiting.remove(callback)
                    if not waiting:
                        del self._idle[backend_id]

        return cancel

    def in_flight(self, backend_id: str) -> int:
        """Requests in flight on ``backend_id``, including ones still running after it was removed."""
        with self._lock:
            state = self._states.get(backend_id)
            if state is None:
                state = self._departed.get(backend_id)
            return 0 if state is None else state.in_flight

    def update_load(self, backend_id: str, load: EngineLoad) -> None:
        """Store the latest engine-reported load (no version bump, no event)."""
        with self._lock:
            self.get(backend_id).load = load
