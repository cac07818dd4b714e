"""A Hypothesis state machine that scales a fleet under any strategy and checks what it claims.

Use it from a test module (needs ``hypothesis``; ``pip install "kvroute[testing]"``)::

    from kvroute.testing import Claims, ScalingStateMachine

    TestScaling = ScalingStateMachine.for_strategy("my-strategy", {"prefix_length": 2048}).TestCase

Rules add, remove, drain, eject and restore backends, change weights, bounce a backend
(remove and re-add it), and start and finish requests. Two routers follow every membership
change: the *primary* carries the requests in flight, the *probe* never has load, so the
placement of ``keys`` sample requests can be compared before and after each change.
Invariants, each checked only when the strategy claims it (`Claims`):

1. ``deterministic``: a fresh strategy over a fresh fleet with the same members (inserted in
   another order, same weights and health) assigns every sample key to the same backend as
   the probe, which went through the whole history of changes.
2. ``minimal_disruption``, scale-out: adding (or restoring, or up-weighting) backend ``b``
   moves keys only to ``b``; the moved fraction is within tolerance of ``b``'s weight share
   among routable backends (``1/(N+1)`` for equal weights).
3. ``minimal_disruption``, scale-in: removing (or draining, ejecting, down-weighting) ``b``
   moves only keys ``b`` had; every survivor receives at most its fair share of them
   (its weight share among survivors) plus the tolerance: none takes the pile.
4. ``returns``: whenever the routable membership (ids, weights) is one seen before, the
   assignment is exactly the one seen then; removing and re-adding ``b`` gives it back
   exactly its keys.
5. ``balance``: each routable backend's share of the sample keys is within tolerance of its
   weight share.
6. ``load_factor`` / ``concurrency_threshold``: whenever a request is started, if some
   candidate had room (load + 1 within ``max(min_capacity, ceil(load_factor * weight *
   (total + 1) / total weight))`` and load below the threshold), the chosen backend had room;
   if none had, the chosen one is a least loaded candidate (per unit of weight).

Tolerances are `kvroute.testing.Tolerance`: 6 binomial standard deviations by default (see
`kvroute.testing.measure` for the reasoning).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvroute.backend import Backend, BackendState
from kvroute.fleet import Fleet
from kvroute.plugins import PluginManager
from kvroute.request import RouteRequest
from kvroute.router import Lease, Router
from kvroute.strategy import Strategy, build_strategy
from kvroute.testing.measure import Movement, Tolerance, assign, sample_requests

__all__ = ["Claims", "ScalingStateMachine"]

_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789-"
_WEIGHTS = (0.5, 1.0, 1.0, 1.0, 2.0, 3.0)


@attrs.frozen
class Claims:
    """Which invariants of `ScalingStateMachine` a strategy promises (see the module docs)."""

    deterministic: bool = True
    minimal_disruption: bool = True
    returns: bool = True
    balance: bool = True
    load_factor: float | None = None
    concurrency_threshold: int | None = None
    #: A floor under the ``load_factor`` cap (bounded-load's ``min_capacity``).
    min_capacity: int = 0

    @classmethod
    def none(cls) -> Claims:
        """No placement claim: only that picks are candidates and nothing breaks (random, least loaded)."""
        return cls(deterministic=False, minimal_disruption=False, returns=False, balance=False)

    @property
    def bounded(self) -> bool:
        return self.load_factor is not None or self.concurrency_threshold is not None


_REQUESTS: dict[tuple[int, str], list[RouteRequest]] = {}
_PLUGINS: list[PluginManager] = []


def _requests(count: int, model: str) -> list[RouteRequest]:
    found = _REQUESTS.get((count, model))
    if found is None:
        found = _REQUESTS[(count, model)] = sample_requests(count, seed=20240229, model=model)
    return found


def _plugins() -> PluginManager:
    if not _PLUGINS:
        _PLUGINS.append(PluginManager())
    return _PLUGINS[0]


class ScalingStateMachine(RuleBasedStateMachine):
    """Scale a fleet under one strategy and check the invariants it claims.

    Configure a subclass with `for_strategy` (or set the class attributes yourself).
    """

    #: Entry-point name of the strategy (used with `PluginManager`), or a label when ``factory`` is set.
    strategy_name: ClassVar[str] = ""
    #: Options passed to the strategy's factory.
    strategy_options: ClassVar[Mapping[str, Any]] = {}
    #: A factory to call instead of looking ``strategy_name`` up among installed plugins.
    factory: ClassVar[Callable[..., Strategy] | None] = None
    claims: ClassVar[Claims] = Claims()
    tolerance: ClassVar[Tolerance] = Tolerance()
    #: Sample requests whose placement is compared across changes.
    keys: ClassVar[int] = 1000
    #: Requests routed by the ``route`` rule are drawn from the first ``hot_keys`` samples.
    hot_keys: ClassVar[int] = 6
    max_backends: ClassVar[int] = 9
    model: ClassVar[str] = "model"

    @classmethod
    def for_strategy(
        cls,
        strategy: str | Callable[..., Strategy],
        options: Mapping[str, Any] | None = None,
        *,
        claims: Claims | None = None,
        tolerance: Tolerance | None = None,
        keys: int | None = None,
        max_backends: int | None = None,
        max_examples: int = 20,
        steps: int = 30,
    ) -> type[ScalingStateMachine]:
        """A configured subclass; use its ``TestCase`` attribute as a test class.

        ``strategy`` is an installed strategy's name or a factory; ``claims`` defaults to
        every placement claim with no load bound (what a consistent-hash strategy promises).
        ``max_examples`` and ``steps`` bound the run (each example is up to ``steps`` rules).
        """
        name = strategy if isinstance(strategy, str) else getattr(strategy, "__name__", "strategy")
        attributes: dict[str, Any] = {
            "strategy_name": name,
            "strategy_options": dict(options or {}),
            "factory": None if isinstance(strategy, str) else staticmethod(strategy),
            "claims": claims if claims is not None else Claims(),
            "tolerance": tolerance if tolerance is not None else Tolerance(),
        }
        if keys is not None:
            attributes["keys"] = keys
        if max_backends is not None:
            attributes["max_backends"] = max_backends
        title = "".join(part.capitalize() for part in name.replace("_", "-").split("-") if part) or "Strategy"
        machine: type[ScalingStateMachine] = type(f"{title}ScalingMachine", (cls,), attributes)
        machine.TestCase.settings = settings(
            machine.TestCase.settings, max_examples=max_examples, stateful_step_count=steps, deadline=None
        )
        return machine

    def __init__(self) -> None:
        super().__init__()
        self.requests = _requests(self.keys, self.model)
        self.primary_fleet = Fleet()
        self.probe_fleet = Fleet()
        self.primary = Router(self.primary_fleet, self._new_strategy(), strategy_name=self.strategy_name)
        self.probe = Router(self.probe_fleet, self._new_strategy(), strategy_name=self.strategy_name)
        self.leases: list[Lease] = []
        self.assignment: tuple[str, ...] = ()
        self.seen: dict[frozenset[tuple[str, float]], tuple[str, ...]] = {}

    # -- helpers -----------------------------------------------------------------------

    def _new_strategy(self) -> Strategy:
        factory = type(self).factory  # read from the class: a plain function stays unbound
        if factory is not None:
            return build_strategy(self.strategy_name, factory, self.strategy_options)
        return _plugins().create_strategy(self.strategy_name, self.strategy_options)

    def _states(self) -> list[BackendState]:
        return list(self.probe_fleet)

    def _routable(self) -> list[BackendState]:
        return self.probe_fleet.candidates(self.model)

    def _ids(self) -> list[str]:
        return sorted(s.id for s in self.probe_fleet)

    def _draw_new_backend(self, data: st.DataObject) -> Backend:
        taken = set(self._ids())
        backend_id = data.draw(
            st.text(alphabet=_ID_ALPHABET, min_size=1, max_size=8).filter(lambda b: b not in taken), label="id"
        )
        return Backend(backend_id, weight=data.draw(st.sampled_from(_WEIGHTS), label="weight"))

    def _both(self, change: Callable[[Fleet], object]) -> None:
        change(self.primary_fleet)
        change(self.probe_fleet)

    def _add_to_both(self, backend: Backend) -> None:
        self._both(lambda fleet: fleet.add(backend))

    def _signature(self) -> frozenset[tuple[str, float]]:
        return frozenset((s.id, s.weight) for s in self._routable())

    def _shares(self) -> dict[str, float]:
        routable = self._routable()
        total = sum(s.weight for s in routable)
        return {s.id: s.weight / total for s in routable}

    def _measure(self) -> tuple[str, ...]:
        """Assign the sample keys on the probe and check balance, determinism and returns."""
        candidates = self._routable()
        after = assign(self.probe.strategy, self.requests, candidates)
        allowed = {s.id for s in candidates}
        strays = Counter(b for b in after if b not in allowed)
        assert not strays, f"{self.strategy_name}: picked backends that are not candidates: {dict(strays)}"
        claims, tol, k = self.claims, self.tolerance, len(after)
        if claims.balance:
            counts = Counter(after)
            for backend_id, p in self._shares().items():
                share = counts[backend_id] / k
                assert tol.allows(share, p, k), (
                    f"balance: {backend_id} got {share:.4f} of {k} keys, expected {p:.4f} "
                    f"+/- {tol.bound(p, k):.4f} (weight share; {tol.z} binomial deviations)"
                )
        if claims.deterministic:
            replica = self._replica_assignment()
            differ = sum(a != b for a, b in zip(after, replica, strict=True))
            assert differ == 0, (
                f"determinism: a fresh {self.strategy_name} over the same members placed {differ} of {k} keys "
                f"differently from the one that saw the history of changes"
            )
        if claims.returns:
            signature = self._signature()
            previous = self.seen.setdefault(signature, after)
            differ = sum(a != b for a, b in zip(after, previous, strict=True))
            assert differ == 0, (
                f"return: the routable membership {sorted(signature)} was seen before, "
                f"but {differ} of {k} keys are now placed differently"
            )
        self.assignment = after
        return after

    def _replica_assignment(self) -> tuple[str, ...]:
        states = self._states()
        fleet = Fleet([s.backend for s in reversed(states)])
        for state in states:
            fleet.drain(state.id, state.draining)
            fleet.set_healthy(state.id, state.healthy)
        router = Router(fleet, self._new_strategy(), strategy_name=self.strategy_name)
        try:
            return assign(router.strategy, self.requests, fleet.candidates(self.model))
        finally:
            router.close()

    def _check_gain(self, backend_id: str, before: tuple[str, ...], after: tuple[str, ...], what: str) -> None:
        """Keys may only move to ``backend_id``, about its weight share of them."""
        if not self.claims.minimal_disruption:
            return
        movement = Movement(before, after)
        wrong = {b: n for b, n in movement.destinations().items() if b != backend_id}
        assert not wrong, f"{what} {backend_id!r}: keys moved to other backends too: {wrong}"
        moved_from = movement.origins()
        if what in ("add", "restore"):
            p, k = self._shares()[backend_id], len(after)
            assert self.tolerance.allows(movement.fraction, p, k), (
                f"{what} {backend_id!r}: {movement.fraction:.4f} of {k} keys moved, expected {p:.4f} "
                f"+/- {self.tolerance.bound(p, k):.4f} (its weight share; from {dict(moved_from)})"
            )

    def _check_loss(self, backend_id: str, before: tuple[str, ...], after: tuple[str, ...], what: str) -> None:
        """Keys may only move away from ``backend_id``, spread over the others by weight."""
        if not self.claims.minimal_disruption:
            return
        movement = Movement(before, after)
        wrong = {b: n for b, n in movement.origins().items() if b != backend_id}
        assert not wrong, f"{what} {backend_id!r}: keys of other backends moved too: {wrong}"
        if what == "down-weight":
            return
        orphans = len(movement.moved)
        if orphans:
            for survivor, p in self._shares().items():
                got = movement.destinations().get(survivor, 0)
                limit = self.tolerance.max_count(p, orphans)
                assert got <= limit + 1e-9, (
                    f"{what} {backend_id!r}: survivor {survivor!r} took {got} of {orphans} orphaned keys; "
                    f"its fair share is {orphans * p:.1f}, allowed at most {limit:.1f}"
                )

    # -- rules: membership -------------------------------------------------------------

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        count = data.draw(st.integers(1, min(5, self.max_backends)), label="backends")
        for _ in range(count):
            self._add_to_both(self._draw_new_backend(data))
        self._measure()

    @precondition(lambda self: len(self.probe_fleet) < self.max_backends)
    @rule(data=st.data())
    def add_backend(self, data: st.DataObject) -> None:
        backend = self._draw_new_backend(data)
        before = self.assignment
        self._add_to_both(backend)
        self._check_gain(backend.id, before, self._measure(), "add")

    @precondition(lambda self: len(self.probe_fleet) >= 2)
    @rule(data=st.data())
    def remove_backend(self, data: st.DataObject) -> None:
        routable = {s.id for s in self._routable()}
        choices = [b for b in self._ids() if routable - {b}]
        backend_id = data.draw(st.sampled_from(choices), label="remove")
        was_routable = backend_id in routable
        before = self.assignment
        self._both(lambda fleet: fleet.remove(backend_id))
        after = self._measure()
        if was_routable:
            self._check_loss(backend_id, before, after, "remove")
        elif self.claims.minimal_disruption:
            moved = Movement(before, after).moved
            assert not moved, f"removing unroutable {backend_id!r} moved {len(moved)} keys"

    @precondition(lambda self: len(self.probe_fleet.candidates(self.model)) >= 2)
    @rule(data=st.data())
    def bounce_backend(self, data: st.DataObject) -> None:
        routable = self._routable()
        state = data.draw(st.sampled_from(sorted(routable, key=lambda s: s.id)), label="bounce")
        backend = state.backend
        before = self.assignment
        self._both(lambda fleet: fleet.remove(backend.id))
        self._measure()
        self._both(lambda fleet: fleet.add(backend))
        after = self._measure()
        if self.claims.returns:
            differ = sum(a != b for a, b in zip(before, after, strict=True))
            assert differ == 0, f"bounce {backend.id!r}: {differ} keys did not return to where they were"

    @precondition(lambda self: len(self.probe_fleet) >= 2)
    @rule(data=st.data())
    def toggle_routable(self, data: st.DataObject) -> None:
        how = data.draw(st.sampled_from(["drain", "eject"]), label="how")
        routable = {s.id for s in self._routable()}
        choices = [b for b in self._ids() if b not in routable or routable - {b}]
        backend_id = data.draw(st.sampled_from(choices), label="backend")
        state = self.probe_fleet.get(backend_id)
        before = self.assignment
        if how == "drain":
            value = not state.draining
            self._both(lambda fleet: fleet.drain(backend_id, value))
        else:
            value = not state.healthy
            self._both(lambda fleet: fleet.set_healthy(backend_id, value))
        after = self._measure()
        now_routable = self.probe_fleet.get(backend_id).routable
        if now_routable and backend_id not in routable:
            self._check_gain(backend_id, before, after, "restore")
        elif backend_id in routable and not now_routable:
            self._check_loss(backend_id, before, after, how)
        elif self.claims.minimal_disruption:
            assert before == after, f"{how} of {backend_id!r} changed no routability but moved keys"

    @rule(data=st.data())
    def change_weight(self, data: st.DataObject) -> None:
        backend_id = data.draw(st.sampled_from(self._ids()), label="backend")
        old = self.probe_fleet.get(backend_id).weight
        new = data.draw(st.sampled_from([w for w in _WEIGHTS if w != old]), label="weight")
        routable = self.probe_fleet.get(backend_id).routable
        before = self.assignment
        self._both(lambda fleet: fleet.set_weight(backend_id, new))
        after = self._measure()
        if not routable:
            if self.claims.minimal_disruption:
                assert before == after, f"re-weighting unroutable {backend_id!r} moved keys"
        elif new > old:
            self._check_gain(backend_id, before, after, "up-weight")
        else:
            self._check_loss(backend_id, before, after, "down-weight")

    # -- rules: requests ---------------------------------------------------------------

    @rule(data=st.data())
    def route(self, data: st.DataObject) -> None:
        request = self.requests[data.draw(st.integers(0, min(self.hot_keys, self.keys) - 1), label="key")]
        candidates = self.primary_fleet.candidates(self.model)
        loads = {s.id: s.in_flight for s in candidates}
        weights = {s.id: s.weight for s in candidates}
        lease = self.primary.acquire(request)
        self.leases.append(lease)
        if self.claims.bounded:
            self._check_bounded(lease.backend.id, loads, weights)

    @precondition(lambda self: bool(self.leases))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        lease = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1), label="lease"))
        self.primary.release(lease)

    def _check_bounded(self, chosen: str, loads: Mapping[str, int], weights: Mapping[str, float]) -> None:
        lf, threshold = self.claims.load_factor, self.claims.concurrency_threshold
        total, total_weight = sum(loads.values()), sum(weights.values())

        def room(backend_id: str) -> bool:
            load = loads[backend_id]
            if threshold is not None and load >= threshold:
                return False
            if lf is not None:
                cap = max(self.claims.min_capacity, math.ceil(lf * weights[backend_id] * (total + 1) / total_weight + 1e-9))
                if load + 1 > cap:
                    return False
            return True

        with_room = sorted(b for b in loads if room(b))
        if with_room:
            assert room(chosen), (
                f"bounded load: placed on {chosen!r} (load {loads[chosen]}, weight {weights[chosen]}) which was "
                f"full, while {with_room} had room; loads {dict(loads)}, load_factor {lf}, threshold {threshold}"
            )
        else:
            best = min(loads[b] / weights[b] for b in loads)
            assert loads[chosen] / weights[chosen] <= best + 1e-9, (
                f"bounded load: every candidate was full, but {chosen!r} is not a least loaded one; loads {dict(loads)}"
            )

    def teardown(self) -> None:
        for lease in self.leases:
            self.primary.release(lease)
        self.primary.close()
        self.probe.close()
