"""A conformance suite every strategy should pass, to subclass in a plugin's tests (pytest)::

    from kvroute.testing import StrategyConformance

    class TestMineConformance(StrategyConformance):
        strategy = "mine"                 # the entry-point name
        options = {"prefix_length": 2048}
        deterministic = True              # same request, same quiet fleet -> same backend

It checks the contract of `kvroute.Strategy` through the real `Router`: picks are always
candidates (never an unroutable, excluded or foreign backend), every `pick` result type is
accepted, a strategy works before any fleet event, membership changes between picks break
nothing, ``pick`` does not write the states it reads, leases balance, and bad options are
`ConfigError`\\ s. Placement properties are the state machine's job
(`kvroute.testing.ScalingStateMachine`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from kvroute.backend import Backend, BackendState
from kvroute.errors import ConfigError
from kvroute.fleet import Fleet
from kvroute.plugins import PluginManager
from kvroute.request import RouteRequest
from kvroute.router import Router
from kvroute.strategy import Decision, Strategy, build_strategy
from kvroute.testing.measure import backend_id_of

__all__ = ["StrategyConformance", "varied_requests"]


def varied_requests(count: int = 60, *, seed: int = 7, model: str = "model") -> list[RouteRequest]:
    """Requests of every shape a strategy meets: empty, short, 40 KB, affinity, LoRA, salt, token ids."""
    rng = random.Random(seed)
    out: list[RouteRequest] = []
    for i in range(count):
        kind = i % 6
        text = "".join(rng.choices("abc xyz\u00e9\u4e2d", k=rng.choice([0, 5, 300, 5000, 40000])))
        if kind == 0:
            out.append(RouteRequest.from_text(text, model=model))
        elif kind == 1:
            out.append(RouteRequest.from_text(text, model=model, affinity_key=f"session-{i % 5}"))
        elif kind == 2:
            out.append(RouteRequest.from_text(text, model=model, lora=f"adapter-{i % 3}"))
        elif kind == 3:
            out.append(RouteRequest.from_text(text, model=model, cache_salt=f"tenant-{i % 4}"))
        elif kind == 4:
            ids = [rng.randrange(50000) for _ in range(rng.choice([1, 64, 2048]))]
            out.append(RouteRequest.from_text("<|ids|>" + " ".join(map(str, ids)), model=model, token_ids=ids))
        else:
            body = {
                "model": model,
                "messages": [{"role": "system", "content": "You help."}, {"role": "user", "content": text}],
            }
            out.append(RouteRequest.from_openai(body))
    return out


class StrategyConformance:
    """Base class for a strategy's conformance tests; set ``strategy`` (and ``options``)."""

    #: The strategy's entry-point name (or a label when ``factory`` is set).
    strategy: ClassVar[str] = ""
    options: ClassVar[Mapping[str, Any]] = {}
    #: Build with this factory instead of the installed plugin named ``strategy``.
    factory: ClassVar[Callable[..., Strategy] | None] = None
    #: Whether the same request on the same quiet fleet always gets the same backend.
    deterministic: ClassVar[bool] = False

    # -- helpers -----------------------------------------------------------------------

    def new_strategy(self) -> Strategy:
        """A fresh instance of the strategy under test."""
        factory = type(self).factory
        if factory is not None:
            return build_strategy(self.strategy, factory, self.options)
        return PluginManager().create_strategy(self.strategy, self.options)

    def new_router(self, backends: Sequence[Backend]) -> Router:
        """A router over a new fleet of ``backends`` with a fresh strategy."""
        return Router(Fleet(backends), self.new_strategy(), strategy_name=self.strategy)

    @staticmethod
    def fleet_of(count: int, *, seed: int = 0) -> list[Backend]:
        """``count`` backends with mixed weights."""
        rng = random.Random(seed)
        return [Backend(f"backend-{i}", weight=rng.choice([0.5, 1.0, 1.0, 2.0])) for i in range(count)]

    # -- tests -------------------------------------------------------------------------

    def test_is_installed(self) -> None:
        """The strategy is registered under its name by an installed plugin (skipped with a factory)."""
        import pytest

        if type(self).factory is not None:
            pytest.skip("built from a factory, not an installed plugin")
        assert self.strategy in PluginManager().strategies, f"{self.strategy!r} is not an installed strategy"

    def test_picks_are_candidates(self) -> None:
        """Every request of every shape, on fleets of 1 to 7 backends, goes to one of the candidates."""
        for size in (1, 2, 3, 7):
            router = self.new_router(self.fleet_of(size, seed=size))
            ids = {b.id for b in router.fleet.backends()}
            for request in varied_requests():
                decision, state = router.decide(request)
                assert decision.backend.id in ids and state.backend == decision.backend

    def test_pick_result_is_accepted(self) -> None:
        """``pick`` returns a Decision, a Backend or a BackendState, and a Decision has a reason."""
        router = self.new_router(self.fleet_of(4))
        candidates = router.fleet.candidates("model")
        for request in varied_requests(12):
            pick = router.strategy.pick(request, candidates)
            assert backend_id_of(pick) in {c.id for c in candidates}
            if isinstance(pick, Decision):
                assert isinstance(pick.reason, str) and pick.reason

    def test_unroutable_and_excluded_never_picked(self) -> None:
        """Draining, ejected and excluded backends never receive a request."""
        router = self.new_router(self.fleet_of(6))
        router.fleet.drain("backend-0")
        router.fleet.set_healthy("backend-1", False)
        for request in varied_requests():
            decision, _ = router.decide(request, exclude={"backend-2"})
            assert decision.backend.id not in {"backend-0", "backend-1", "backend-2"}

    def test_only_backends_serving_the_model(self) -> None:
        """With backends serving different models, a request goes to one that serves its model."""
        backends = [Backend("a", models={"m1"}), Backend("b", models={"m2"}), Backend("c"), Backend("d", models={"m1"})]
        router = self.new_router(backends)
        for model, allowed in (("m1", {"a", "c", "d"}), ("m2", {"b", "c"})):
            for request in varied_requests(18, model=model):
                assert router.decide(request)[0].backend.id in allowed

    def test_works_before_any_fleet_event(self) -> None:
        """A strategy never told about the fleet still picks one of the candidates it is given."""
        strategy = self.new_strategy()
        candidates = [BackendState(b) for b in self.fleet_of(5)]
        for request in varied_requests(12):
            assert backend_id_of(strategy.pick(request, candidates)) in {c.id for c in candidates}

    def test_membership_changes_between_picks(self) -> None:
        """Adding, removing, re-weighting, draining and restoring backends between picks breaks nothing."""
        router = self.new_router(self.fleet_of(3))
        fleet, requests, rng = router.fleet, varied_requests(30), random.Random(3)
        for step in range(40):
            ids = [b.id for b in fleet.backends()]
            action = step % 5
            if action == 0:
                fleet.add(Backend(f"extra-{step}", weight=rng.choice([1.0, 2.0])))
            elif action == 1 and len(ids) > 2:
                fleet.remove(rng.choice(ids))
            elif action == 2:
                fleet.set_weight(rng.choice(ids), rng.choice([0.5, 1.0, 3.0]))
            elif action == 3 and len(fleet.candidates()) > 1:
                fleet.drain(rng.choice(ids))
            else:
                for backend_id in ids:
                    fleet.drain(backend_id, False)
            for request in requests[step % 10 :: 10]:
                decision, _ = router.decide(request)
                assert decision.backend.id in {s.id for s in fleet.candidates()}

    def test_pick_does_not_write_states(self) -> None:
        """``pick`` leaves in-flight counts, health and draining as they were."""
        router = self.new_router(self.fleet_of(5))
        states = list(router.fleet)
        for i, state in enumerate(states):
            state.in_flight = i * 3
        before = [(s.in_flight, s.healthy, s.draining, s.backend) for s in states]
        for request in varied_requests(30):
            router.strategy.pick(request, router.fleet.candidates("model"))
        assert [(s.in_flight, s.healthy, s.draining, s.backend) for s in states] == before

    def test_leases_balance(self) -> None:
        """Routing and releasing 120 requests through the router leaves nothing in flight."""
        router = self.new_router(self.fleet_of(4))
        requests = varied_requests(120)
        leases = [router.acquire(r) for r in requests[:60]]
        for request in requests[60:]:
            with router.route(request) as lease:
                assert lease.backend.id in {b.id for b in router.fleet.backends()}
        for lease in leases:
            router.release(lease)
        assert all(s.in_flight == 0 for s in router.fleet)

    def test_unknown_option_is_config_error(self) -> None:
        """An option the strategy does not have is a ConfigError naming it."""
        import pytest

        factory = type(self).factory
        options = {**self.options, "no_such_option_xyz": 1}
        with pytest.raises(ConfigError, match="no_such_option_xyz"):
            if factory is not None:
                build_strategy(self.strategy, factory, options)
            else:
                PluginManager().create_strategy(self.strategy, options)

    def test_deterministic_when_claimed(self) -> None:
        """If ``deterministic`` is claimed, two instances over the same quiet fleet agree on every request."""
        import pytest

        if not self.deterministic:
            pytest.skip("the strategy does not claim determinism")
        backends = self.fleet_of(7)
        a, b = self.new_router(backends), self.new_router(list(reversed(backends)))
        for request in varied_requests():
            assert a.decide(request)[0].backend.id == b.decide(request)[0].backend.id
