"""kvroute_ray without a cluster: reading requests, the router's tiers, in-flight counts and replica changes.

The router is Ray's own ``RequestRouter`` subclass, built as Ray builds it (deployment id, handle
source) inside a running event loop; replicas are stand-ins with the attributes the router reads
(``replica_id``, ``multiplexed_model_ids``), and fleet changes go through ``sync_replicas`` (the
part of ``update_replicas`` that is ours; Ray's part probes real actors).
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterable
from typing import Any

import pydantic
import pytest
from kvroute_ray import KvrouteRequestRouter, body_of, request_router_config, route_request
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from kvroute import ConfigError, Fleet, Router
from kvroute.testing.measure import Movement, Tolerance

DEPLOYMENT = DeploymentID(name="Engine", app_name="app")

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Replica:
    """What the router reads of a ``RunningReplica``."""

    def __init__(self, unique_id: str, models: Iterable[str] = ()) -> None:
        self.replica_id = ReplicaID(unique_id, DEPLOYMENT)
        self.multiplexed_model_ids = set(models)
        self.max_ongoing_requests = 8


def pending(args: list[Any], *, request_id: str = "r1", model_id: str = "", **kwargs: Any) -> PendingRequest:
    metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id, multiplexed_model_id=model_id)
    return PendingRequest(args=args, kwargs=kwargs, metadata=metadata)


def make_router(strategy: str = "bounded-load", **kwargs: Any) -> KvrouteRequestRouter:
    router = KvrouteRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(strategy=strategy, **kwargs)
    return router


def prompt(n: int) -> dict[str, Any]:
    return {"model": "m", "prompt": f"document {n} " + "shared words " * 40}


class TestBodyOf:
    def test_dict_body(self) -> None:
        """A plain dict with messages is the body itself."""
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert body_of(body) is body

    def test_namespace_body(self) -> None:
        """Direct streaming's SimpleNamespace(**body) gives back the body's fields."""
        assert body_of(types.SimpleNamespace(model="m", prompt="hello")) == {"model": "m", "prompt": "hello"}

    def test_pydantic_body(self) -> None:
        """A pydantic request object (Ray Serve LLM's type) is read through model_dump, without None fields."""

        class Chat(pydantic.BaseModel):
            model: str
            messages: list[dict[str, str]]
            user: str | None = None

        body = body_of(Chat(model="m", messages=[{"role": "user", "content": "hi"}]))
        assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def test_raw_json_bytes(self) -> None:
        """A raw JSON body in bytes is parsed."""
        assert body_of(json.dumps(prompt(1)).encode()) == prompt(1)

    @pytest.mark.parametrize("value", [b"\xff\xfe not json", "plain text", b"{broken", 42, None, {"model": "m"}, []])
    def test_no_prompt(self, value: object) -> None:
        """Anything without a readable prompt gives None, never an exception."""
        assert body_of(value) is None


class TestRouteRequest:
    def test_same_text_as_the_proxy(self) -> None:
        """A chat body renders the same routing text as kvroute serve's RouteRequest.from_openai."""
        from kvroute import RouteRequest

        body = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}
        assert route_request([body], {}).text == RouteRequest.from_openai(body).text  # type: ignore[union-attr]

    def test_kwargs_and_defaults(self) -> None:
        """A body passed by keyword is found, and a body without a model routes under 'default'."""
        request = route_request([], {"request": {"prompt": "hello"}}, request_id="abc")
        assert request is not None and request.model == "default" and request.request_id == "abc"

    def test_multiplexed_model_keys_like_lora(self) -> None:
        """Ray's multiplexed model id becomes the request's LoRA adapter; the session id its affinity key."""
        request = route_request([prompt(1)], {}, multiplexed_model_id="adapter-a", session_id="s1")
        assert request is not None and request.lora == "adapter-a" and request.affinity_key == "s1"

    def test_invalid_body_is_none(self) -> None:
        """A body kvroute rejects (a prompt of the wrong type) gives None."""
        assert route_request([{"model": "m", "prompt": {"not": "a prompt"}}], {}) is None


class TestConfig:
    def test_unknown_strategy(self) -> None:
        """A strategy that is not installed fails when the config is built, with kvroute's message."""
        with pytest.raises(ConfigError, match=r"unknown strategy 'nope' \(installed: .*bounded-load"):
            request_router_config("nope")

    def test_bad_option(self) -> None:
        """A bad option fails when the config is built, naming the option and the value."""
        with pytest.raises(ConfigError, match=r"'load_factor' must be between 1.0 and 100.0 \(got 0.5\)"):
            request_router_config("bounded-load", {"load_factor": 0.5})

    def test_unknown_setting(self) -> None:
        """A misspelt router setting in request_router_kwargs fails in initialize_state."""
        router = KvrouteRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        with pytest.raises(ConfigError, match=r"no setting 'stratgy'"):
            router.initialize_state(stratgy="random")

    def test_config_names_the_class(self) -> None:
        """The config carries the router class and the validated settings for Ray to pass on."""
        config = request_router_config("consistent-hash", {"prefix_length": 2048}, fallbacks=1, initial_backoff_s=0.05)
        assert config.request_router_class.endswith("KvrouteRequestRouter")
        assert config.request_router_kwargs == {
            "strategy": "consistent-hash",
            "options": {"prefix_length": 2048},
            "fallbacks": 1,
        }
        assert config.initial_backoff_s == 0.05


class TestChooseReplicas:
    async def test_first_tier_is_the_strategy_choice(self) -> None:
        """Tier one is the strategy's pick over the same fleet, then its next choices, then the rest."""
        router = make_router("consistent-hash", fallbacks=1)
        replicas = [Replica(f"r{i}") for i in range(4)]
        router.sync_replicas(replicas)
        reference = Router.create(Fleet(router.fleet.backends()), "consistent-hash")
        for n in range(20):
            tiers = await router.choose_replicas(replicas, pending([prompt(n)], request_id=f"q{n}"))
            expected, _ = reference.decide(route_request([prompt(n)], {}))  # type: ignore[arg-type]
            assert [len(t) for t in tiers] == [1, 1, 2]
            assert tiers[0][0].replica_id.unique_id == expected.backend.id
            assert {r.replica_id for t in tiers for r in t} == {r.replica_id for r in replicas}
        assert router.stats.decided == 20 and router.stats.unparsed == 0

    async def test_asks_ray_to_back_off(self) -> None:
        """Every answer covers all replicas, so the request asks Ray to back off before it asks again."""
        router = make_router()
        replicas = [Replica("r0"), Replica("r1")]
        router.sync_replicas(replicas)
        for args in ([prompt(1)], [b"\x00"]):
            request = pending(args)
            await router.choose_replicas(replicas, request)
            assert request.routing_context.should_backoff

    async def test_no_request_is_not_counted(self) -> None:
        """Ray asking with no pending request gets the least-loaded order and counts nothing as unparsed."""
        router = make_router()
        replicas = [Replica("r0"), Replica("r1")]
        router.sync_replicas(replicas)
        assert len(await router.choose_replicas(replicas, None)) == 2
        assert router.stats.unparsed == 0

    async def test_unparsed_goes_to_least_loaded(self) -> None:
        """A request with no readable prompt is counted and goes to the replica with the fewest in flight."""
        router = make_router()
        replicas = [Replica(f"r{i}") for i in range(3)]
        router.sync_replicas(replicas)
        for n, busy in enumerate(["r0", "r0", "r1"]):
            await router.choose_replicas(replicas, pending([prompt(n)], request_id=f"b{n}"))
            router.on_request_routed(pending([prompt(n)], request_id=f"b{n}"), ReplicaID(busy, DEPLOYMENT), None)
        tiers = await router.choose_replicas(replicas, pending([b"\x00garbage"], request_id="g"))
        assert tiers[0][0].replica_id.unique_id == "r2"
        assert router.stats.unparsed == 1

    async def test_multiplexed_model_replicas_first(self) -> None:
        """Replicas that have the request's multiplexed model loaded are ranked before the others."""
        router = make_router("consistent-hash", fallbacks=0)
        replicas = [Replica("r0"), Replica("r1", ["lora-a"]), Replica("r2"), Replica("r3", ["lora-a"])]
        router.sync_replicas(replicas)
        for n in range(10):
            tiers = await router.choose_replicas(replicas, pending([prompt(n)], request_id=f"m{n}", model_id="lora-a"))
            assert tiers[0][0].replica_id.unique_id in {"r1", "r3"}
            assert tiers[1][0].replica_id.unique_id in {"r0", "r2"}


class TestFulfil:
    async def test_choice_goes_to_its_own_request(self) -> None:
        """A replica chosen for one request goes to that request, not to an older waiting one."""
        router = make_router()
        older, mine = pending([prompt(1)], request_id="older"), pending([prompt(2)], request_id="mine")
        for request in (older, mine):
            router._pending_requests_to_fulfill.append(request)
            router._add_pending_request_to_indices(request)
        replica = Replica("r0")
        router._fulfill_next_pending_request(replica, mine.metadata)  # type: ignore[arg-type]
        assert mine.future.result() is replica and not older.future.done()

    async def test_requestless_round_serves_a_stale_request(self) -> None:
        """A request-less round (Ray <= 2.55) serves the oldest request no task asks about any more, only that."""
        router = make_router()
        replicas = [Replica("r0")]
        router.sync_replicas(replicas)
        done, older, newer = (pending([prompt(n)], request_id=f"w{n}") for n in range(3))
        done.future.cancel()
        for request in (done, older, newer):
            router._pending_requests_to_fulfill.append(request)
            router._add_pending_request_to_indices(request)
            await router.choose_replicas(replicas, request)
        router._fulfill_next_pending_request(replicas[0], None)  # type: ignore[arg-type]
        assert not older.future.done() and not newer.future.done()  # both still being routed
        router.stale_after_s = 0.0
        router._fulfill_next_pending_request(replicas[0], None)  # type: ignore[arg-type]
        assert older.future.result() is replicas[0] and not newer.future.done()


class TestInFlight:
    async def test_routed_and_completed(self) -> None:
        """A request counts in flight on the replica Ray sent it to from on_request_routed to on_request_completed."""
        router = make_router("bounded-load")
        replicas = [Replica(f"r{i}") for i in range(2)]
        router.sync_replicas(replicas)
        tiers = await router.choose_replicas(replicas, pending([prompt(1)], request_id="x"))
        other = next(r for r in replicas if r is not tiers[0][0])
        router.on_request_routed(pending([prompt(1)], request_id="x"), other.replica_id, None)
        assert router.fleet.in_flight(other.replica_id.unique_id) == 1
        assert router.stats.fallbacks == 1 and router.stats.in_flight == 1
        router.on_request_completed(other.replica_id, "x")
        router.on_request_completed(other.replica_id, "x")  # a second call changes nothing
        assert router.fleet.in_flight(other.replica_id.unique_id) == 0
        assert router.stats.completed == 1 and router.stats.in_flight == 0

    async def test_rejected_request_is_not_counted(self) -> None:
        """on_request_completed without on_request_routed (a replica rejected it) leaves the counts alone."""
        router = make_router()
        replicas = [Replica("r0")]
        router.sync_replicas(replicas)
        await router.choose_replicas(replicas, pending([prompt(1)], request_id="y"))
        router.on_request_completed(replicas[0].replica_id, "y")
        assert router.fleet.in_flight("r0") == 0 and router.stats.completed == 0

    async def test_dead_replica_leaves_the_fleet(self) -> None:
        """on_replica_actor_died removes the backend and ends its leases; later picks avoid it."""
        router = make_router("consistent-hash")
        replicas = [Replica(f"r{i}") for i in range(3)]
        router.sync_replicas(replicas)
        tiers = await router.choose_replicas(replicas, pending([prompt(5)], request_id="z"))
        victim = tiers[0][0]
        router.on_request_routed(pending([prompt(5)], request_id="z"), victim.replica_id, None)
        router.on_replica_actor_died(victim.replica_id)
        assert victim.replica_id.unique_id not in router.fleet
        assert router.stats.in_flight == 0 and router.stats.replicas_died == 1
        survivors = [r for r in replicas if r is not victim]
        tiers = await router.choose_replicas(survivors, pending([prompt(5)], request_id="z2"))
        assert victim not in [r for t in tiers for r in t]


class TestScaleOut:
    @pytest.mark.parametrize("strategy", ["consistent-hash", "bounded-load"])
    async def test_four_to_five_moves_keys_only_to_the_new_replica(self, strategy: str) -> None:
        """Adding a fifth replica moves keys only onto it, about a fifth of them (kvroute.testing's bound)."""
        router = make_router(strategy, fallbacks=0)
        replicas = [Replica(f"replica-{i}") for i in range(4)]
        router.sync_replicas(replicas)
        keys = [pending([prompt(n)], request_id=f"k{n}") for n in range(2000)]

        async def assign(current: list[Replica]) -> tuple[str, ...]:
            return tuple([(await router.choose_replicas(current, p))[0][0].replica_id.unique_id for p in keys])

        before = await assign(replicas)
        replicas.append(Replica("replica-4"))
        router.sync_replicas(replicas)
        after = await assign(replicas)
        movement = Movement(before, after)
        assert set(movement.destinations()) == {"replica-4"}
        assert Tolerance().allows(movement.fraction, 0.2, len(keys)), movement.fraction
