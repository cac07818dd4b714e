"""A Hypothesis state machine that scales a fleet under any strategy and checks what it claims.

Use it from a test module (needs ``hypothesis``; ``pip install "kvroute[testing]"``)::

    from kvroute.testing import Claims, ScalingStateMachine

    TestScaling = ScalingStateMachine.for_strategy("my-strategy", {"prefix_length": 2048}).TestCase

Rules add, remove, drain, eject and restore backends, change weights, bounce a backend
(remove and re-add it), start requests one at a time or in bursts of one hot key, and finish
them. Two routers follow every membership change: the *primary* carries the requests in
flight, the *probe* never has load, so the placement of ``keys`` sample requests can be
compared before and after each change.

Checked for every strategy, whatever it claims:

* every pick is a candidate (the probe's dry runs here; the router refuses any other pick);
* in-flight conservation: after every step each backend's ``in_flight`` (primary) equals the
  leases held on it, and every probe backend has 0 (``pick`` and the callbacks write nothing).

Checked only when the strategy claims it (`Claims`):

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
   candidate had room (``load + 1 <= max(min_capacity, ceil(load_factor * weight * (total + 1)
   / total weight))``, computed exactly by `kvroute.testing.measure.load_factor_cap`, and
   ``load < concurrency_threshold``), the chosen backend had room; if none had, the chosen one
   is a least loaded candidate (per unit of weight).
7. ``least_loaded``: whenever a request is started, the chosen backend has the fewest
   requests in flight per unit of weight among the candidates.
8. ``resident`` (capacity-aware placement): the machine keeps a reference model of what each
   backend's cache holds (`kvroute.testing.footprint.CacheModel`, fed by every start's
   ``Decision.key`` and ``detail["footprint"]``, LRU-aged at the backend's KV capacity); a
   start whose key some candidates hold goes to one of them, unless all of those are full
   under the claimed load limits.
9. ``cache_factor`` / ``cache_fill``: a start whose key no candidate holds goes to a candidate
   with cache room (`kvroute.testing.footprint.cache_room`) whenever some candidate has both
   cache room and room for a request; failing that, to one with room under ``cache_factor``
   alone whenever some candidate has that and room for a request.

With ``kv_blocks`` set, every backend reports a KV cache of one of those sizes (blocks of
``block_size`` tokens) as fresh `EngineLoad` telemetry before each start; without it no
backend reports one, and capacities are weights. Claims 1-5 are checked on the probe, which
never starts a request: they describe placement with nothing held, which is all a strategy
that remembers what it placed can promise about every key; 8 and 9 describe the rest.

A load check that never had a full candidate to catch could not have failed, so `ScalingStateMachine.run` (which the
``TestCase`` calls) fails when a claimed limit never bound during the whole run: at least one
start must have seen a candidate full under ``load_factor`` (under the threshold), and for
``least_loaded`` candidates with unequal loads. Bursts of up to ``burst`` requests of one key
(by default ``2 * min_capacity + 8``) are what fill a backend up to a floor like
``min_capacity=16``.

These are checks over generated histories, evidence rather than proof: a run is
``max_examples`` histories of up to ``steps`` rules (20 and 30 by default; the runs in this
repository's CI use 8 to 20 examples each, listed in docs/strategies.md). Tolerances are
`kvroute.testing.Tolerance`: 6 binomial standard deviations by default (see
`kvroute.testing.measure` for the reasoning).
"""

from __future__ import annotations

import unittest
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvroute.backend import Backend, BackendState, EngineLoad
from kvroute.fleet import Fleet
from kvroute.plugins import PluginManager
from kvroute.request import RouteRequest
from kvroute.router import Lease, Router
from kvroute.strategy import Strategy, build_strategy
from kvroute.testing.claims import ClaimChecks, Claims, Coverage
from kvroute.testing.footprint import CacheModel, cache_room
from kvroute.testing.measure import Movement, Tolerance, assign, sample_requests

__all__ = ["Claims", "Coverage", "ScalingStateMachine"]

_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789-"
_WEIGHTS = (0.5, 1.0, 1.0, 1.0, 2.0, 3.0)


def _new_test_case(machine: type[ScalingStateMachine]) -> type[unittest.TestCase]:
    class ScalingTestCase(unittest.TestCase):
        settings = settings(deadline=None, suppress_health_check=list(HealthCheck))
        #: The machine this case runs (its `ScalingStateMachine.coverage` says what the last run exercised).
        state_machine = machine

        def runTest(self) -> None:
            machine.run(self.settings)

    ScalingTestCase.__name__ = f"{machine.__name__}.TestCase"
    ScalingTestCase.__qualname__ = f"{machine.__qualname__}.TestCase"
    return ScalingTestCase


class _TestCaseOf:
    """``Machine.TestCase``: a unittest case (one per machine class) that calls `ScalingStateMachine.run`."""

    def __get__(self, obj: ScalingStateMachine | None, owner: type[ScalingStateMachine]) -> Any:
        machine = owner if obj is None else type(obj)
        found = machine.__dict__.get("_test_case")
        if found is None:
            found = _new_test_case(machine)
            machine._test_case = found
        return found


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


class _ScalingModel(RuleBasedStateMachine):
    """What `ScalingStateMachine`'s rules drive and measure, with no rule or invariant of its own.

    Holds one example's state: the two fleets and their routers (the *primary* carries the
    leases in flight, the *probe* never starts a request), the sample ``requests``, the
    ``leases`` held, the probe's last ``assignment`` and every assignment ``seen`` per routable
    membership, each backend's KV ``capacity``, the ``cache`` model and the claim checks. Its
    helpers apply a change to both fleets in step, draw new backends, measure the probe's
    assignment (checking balance, determinism and returns), start requests on the primary
    (checking the load and placement claims), and release everything in ``teardown``.
    The configuration it reads is declared, with defaults and docs, on `ScalingStateMachine`.
    """

    strategy_name: ClassVar[str]
    strategy_options: ClassVar[Mapping[str, Any]]
    factory: ClassVar[Callable[..., Strategy] | None]
    claims: ClassVar[Claims]
    tolerance: ClassVar[Tolerance]
    keys: ClassVar[int]
    hot_keys: ClassVar[int]
    model: ClassVar[str]
    kv_blocks: ClassVar[tuple[int, ...]]
    block_size: ClassVar[int]
    coverage: ClassVar[Coverage]

    def __init__(self) -> None:
        super().__init__()
        if "coverage" not in type(self).__dict__:  # run outside `run`: count on this class, not a parent's
            type(self).coverage = Coverage()
        type(self).coverage.examples += 1
        self.requests = _requests(self.keys, self.model)
        self.primary_fleet = Fleet()
        self.probe_fleet = Fleet()
        self.primary = Router(self.primary_fleet, self._new_strategy(), strategy_name=self.strategy_name)
        self.probe = Router(self.probe_fleet, self._new_strategy(), strategy_name=self.strategy_name)
        self.leases: list[Lease] = []
        self.assignment: tuple[str, ...] = ()
        self.seen: dict[frozenset[tuple[str, float]], tuple[str, ...]] = {}
        #: Each backend's KV cache size in blocks (by id, kept across a bounce), when ``kv_blocks`` is set.
        self.capacity: dict[str, int] = {}
        #: What each primary backend's cache holds, as the claims' rules say (`CacheModel`).
        self.cache = CacheModel()
        #: The checks of what the strategy claims (`kvroute.testing.claims`).
        self._checks = ClaimChecks(self.claims, self.tolerance, self.strategy_name)

    # -- both fleets and the probe's assignment ----------------------------------------

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
        if self.kv_blocks:
            self.capacity[backend_id] = data.draw(st.sampled_from(self.kv_blocks), label="kv_blocks")
        return Backend(backend_id, weight=data.draw(st.sampled_from(_WEIGHTS), label="weight"))

    def _both(self, change: Callable[[Fleet], object]) -> None:
        change(self.primary_fleet)
        change(self.probe_fleet)
        self.cache.keep_only(s.id for s in self.primary_fleet)
        self._report_capacity()

    def _report_capacity(self) -> None:
        """Fresh KV cache telemetry on every backend of both fleets (none without ``kv_blocks``)."""
        if not self.kv_blocks:
            return
        for fleet in (self.primary_fleet, self.probe_fleet):
            for state in fleet:
                state.load = EngineLoad(kv_blocks=self.capacity[state.id], block_size=self.block_size)

    def _kv_tokens(self, backend_id: str) -> int | None:
        blocks = self.capacity.get(backend_id)
        return None if blocks is None else blocks * self.block_size

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
        self._checks.balance(after, self._shares)
        self._checks.deterministic(after, self._replica_assignment)
        self._checks.returns(after, self._signature, self.seen)
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

    # -- requests on the primary -------------------------------------------------------

    def _hot_request(self, data: st.DataObject) -> RouteRequest:
        return self.requests[data.draw(st.integers(0, min(self.hot_keys, self.keys) - 1), label="key")]

    def _start(self, request: RouteRequest) -> None:
        self._report_capacity()
        candidates = self.primary_fleet.candidates(self.model)
        loads = {s.id: s.in_flight for s in candidates}
        weights = {s.id: s.weight for s in candidates}
        lease = self.primary.acquire(request)
        self.leases.append(lease)
        type(self).coverage.starts += 1
        self._checks.start(lease.backend.id, loads, weights, type(self).coverage)
        if self.claims.resident or self.claims.cache_bounded:
            self._check_placement(lease, loads, weights)

    def _check_placement(self, lease: Lease, loads: Mapping[str, int], weights: Mapping[str, float]) -> None:
        """Check one start against the cache model (claims 8 and 9), then record it there."""
        decision = lease.decision
        key, footprint = decision.key, decision.detail.get("footprint")
        assert key is not None and isinstance(footprint, int), (
            f"{self.strategy_name} claims resident/cache bounds, so each Decision must carry its key and "
            f"detail['footprint'] (tokens); got key={key!r}, footprint={footprint!r}"
        )
        in_tokens = all(self._kv_tokens(b) is not None for b in loads)
        capacities = {b: float(self._kv_tokens(b) or 0) if in_tokens else weights[b] for b in loads}
        claims = self.claims
        held = {b: self.cache.held(b) for b in loads}
        rooms = (
            cache_room(
                held,
                capacities,
                footprint,
                cache_factor=claims.cache_factor,
                cache_fill=claims.cache_fill,
                in_tokens=in_tokens,
            ),
            cache_room(held, capacities, footprint, cache_factor=claims.cache_factor, cache_fill=None, in_tokens=False),
        )
        holders = self.cache.holders(key, loads)
        load_room = self._checks.load_room(loads, weights)
        self._checks.placement(lease.backend.id, key, holders, rooms, load_room, set(loads), type(self).coverage)
        self.cache.record(lease.backend.id, key, footprint, self._kv_tokens(lease.backend.id))

    def teardown(self) -> None:
        for lease in self.leases:
            self.primary.release(lease)
        self.primary.close()
        self.probe.close()


class ScalingStateMachine(_ScalingModel):
    """Scale a fleet under one strategy and check the invariants it claims.

    Configure a subclass with `for_strategy` (or set the class attributes yourself). This class
    holds the configuration, the rules and the invariant; the state they drive (fleets, routers,
    leases, assignments, cache model) and its helpers are in its private base `_ScalingModel`.
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
    #: Requests started by the ``route`` and ``burst`` rules are drawn from the first ``hot_keys`` samples.
    hot_keys: ClassVar[int] = 6
    #: The most requests one ``burst`` starts; 0 means ``2 * claims.min_capacity + 8``.
    burst: ClassVar[int] = 0
    max_backends: ClassVar[int] = 9
    model: ClassVar[str] = "model"
    #: KV cache sizes (in blocks) a new backend reports, drawn per backend; empty: none reports one.
    kv_blocks: ClassVar[tuple[int, ...]] = ()
    #: Tokens per KV block in the reported telemetry.
    block_size: ClassVar[int] = 16
    #: What the current (or last) `run` exercised.
    coverage: ClassVar[Coverage] = Coverage()
    #: A unittest case running `run` with its ``settings`` (one per configured subclass).
    TestCase = _TestCaseOf()
    _test_case: ClassVar[type[unittest.TestCase] | None] = None

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
        burst: int | None = None,
        kv_blocks: Sequence[int] | None = None,
        max_examples: int = 20,
        steps: int = 30,
    ) -> type[ScalingStateMachine]:
        """A configured subclass; use its ``TestCase`` attribute as a test class (or call its `run`).

        ``strategy`` is an installed strategy's name or a factory; ``claims`` defaults to
        every placement claim with no load bound (what a consistent-hash strategy promises).
        ``max_examples`` and ``steps`` bound the run (each example is up to ``steps`` rules);
        ``burst`` is the most requests one burst starts (default ``2 * min_capacity + 8``);
        ``kv_blocks`` the KV cache sizes backends report (see the class attribute).
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
        if burst is not None:
            attributes["burst"] = burst
        if kv_blocks is not None:
            attributes["kv_blocks"] = tuple(kv_blocks)
        title = "".join(part.capitalize() for part in name.replace("_", "-").split("-") if part) or "Strategy"
        machine: type[ScalingStateMachine] = type(f"{title}ScalingMachine", (cls,), attributes)
        machine.TestCase.settings = settings(
            machine.TestCase.settings, max_examples=max_examples, stateful_step_count=steps, deadline=None
        )
        return machine

    @classmethod
    def run(cls, budget: settings | None = None) -> Coverage:
        """Run the machine with ``budget`` (default: ``TestCase.settings``) and return what it exercised.

        Raises what a failing check raised, or ``AssertionError`` when a claimed load check
        never met a case it could fail (see `Coverage.require`).
        """
        cls.coverage = Coverage()
        run_state_machine_as_test(cls, settings=budget if budget is not None else cls.TestCase.settings)
        cls.coverage.require(cls.claims, cls.__name__)
        return cls.coverage

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
        self._checks.gain(backend.id, before, self._measure(), "add", self._shares)

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
            self._checks.loss(backend_id, before, after, "remove", self._shares)
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
            self._checks.gain(backend_id, before, after, "restore", self._shares)
        elif backend_id in routable and not now_routable:
            self._checks.loss(backend_id, before, after, how, self._shares)
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
            self._checks.gain(backend_id, before, after, "up-weight", self._shares)
        else:
            self._checks.loss(backend_id, before, after, "down-weight", self._shares)

    # -- rules: requests ---------------------------------------------------------------

    @rule(data=st.data())
    def route(self, data: st.DataObject) -> None:
        self._start(self._hot_request(data))

    @rule(data=st.data())
    def burst_of_one_key(self, data: st.DataObject) -> None:
        """Several requests of one key back to back: what fills a backend up to its cap."""
        request = self._hot_request(data)
        most = self.burst or 2 * self.claims.min_capacity + 8
        for _ in range(data.draw(st.integers(2, max(2, most)), label="burst")):
            self._start(request)

    @precondition(lambda self: bool(self.leases))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        lease = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1), label="lease"))
        self.primary.release(lease)

    @invariant()
    def in_flight_conserved(self) -> None:
        """Each backend's in-flight count is the number of leases held on it; the probe has none."""
        held: Counter[int] = Counter(id(lease.state) for lease in self.leases)
        states = {id(s): s for s in self.primary_fleet}
        states.update((id(lease.state), lease.state) for lease in self.leases)  # removed backends too
        wrong = {s.id: (s.in_flight, held[key]) for key, s in states.items() if s.in_flight != held[key]}
        assert not wrong, f"in-flight conservation: (in_flight, leases held) per backend differ: {wrong}"
        probe = {s.id: s.in_flight for s in self.probe_fleet if s.in_flight}
        assert not probe, f"in-flight conservation: the probe never starts a request, but has in_flight {probe}"
