"""kvroute-litellm: LiteLLM's real Router picks deployments with kvroute strategies, on loopback."""

from __future__ import annotations

import re
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import kvroute_litellm
import litellm
import pytest
from hypothesis import given
from kvroute_litellm import DECISION_KEY, LEASE_KEY, KvrouteRouting, ModelGroup, backend_from_deployment, route_request

import kvroute
from kvroute import Backend, ConfigError, Fleet, NoBackendAvailable, Router, RouteRequest
from tests.contrib.litellm.conftest import LOOPBACK_CONNECTS, OUTBOUND, is_loopback
from tests.examples.openai_fake import FakeBackend, eventually, fake_backends
from tests.hypothesis_strategies import conversations

# LiteLLM's own pydantic models warn about `ReadOnly` TypedDict items when first validated:
# a third-party notice about LiteLLM's code, not about kvroute's, so it is not an error here.
pytestmark = pytest.mark.filterwarnings("ignore:Items? .* the `ReadOnly` qualifier:UserWarning")

MODEL = "m"
#: Shared text longer than consistent-hash's smallest prefix_length (1024 characters).
DOCUMENT = "".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog. " for i in range(24))


def deployments(backends: Sequence[FakeBackend], **extra: Any) -> list[dict[str, Any]]:
    """A LiteLLM model list: one deployment per fake backend, ids d0, d1..."""
    return [
        {
            "model_name": MODEL,
            "litellm_params": {"model": f"openai/{MODEL}", "api_base": f"{b.url}/v1", "api_key": "unused", **extra},
            "model_info": {"id": f"d{i}"},
        }
        for i, b in enumerate(backends)
    ]


def chat(prefix: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": prefix}, {"role": "user", "content": question}]


async def settle(routing: KvrouteRouting) -> None:
    """Wait (bounded) until LiteLLM's background callbacks ended every lease."""
    await eventually(lambda: routing.open_leases() == 0)


@pytest.fixture
async def fleet3() -> AsyncIterator[list[FakeBackend]]:
    async with fake_backends(3) as backends:
        yield backends


@pytest.fixture
def installed() -> Callable[..., KvrouteRouting]:
    """Install kvroute on a LiteLLM Router; uninstall (callbacks removed) after the test."""
    made: list[KvrouteRouting] = []

    def make(
        model_list: list[dict[str, Any]], strategy: str, options: dict[str, Any] | None = None, **router_kwargs: Any
    ) -> KvrouteRouting:
        router = litellm.Router(model_list=model_list, **router_kwargs)
        routing = kvroute_litellm.install(router, strategy, options)
        made.append(routing)
        return routing

    yield make  # type: ignore[misc]
    for routing in made:
        routing.uninstall()


class TestRouteRequest:
    @given(conversations)
    def test_same_text_as_kvroute_serve(self, messages: list[dict[str, Any]]) -> None:
        """A chat call's routing text is exactly what RouteRequest.from_openai renders for the same body."""
        built = route_request(MODEL, messages, None, {"metadata": {}})
        assert built.text == RouteRequest.from_openai({"model": MODEL, "messages": messages}).text
        assert built.model == MODEL and built.endpoint == "chat"

    def test_affinity_salt_and_headers(self) -> None:
        """The affinity key comes from metadata or proxy headers; cache_salt from extra_body."""
        kwargs = {
            "metadata": {"headers": {"X-Kvroute-Lora": "ad1"}, "kvroute_affinity_key": "s-1"},
            "extra_body": {"cache_salt": "t1"},
        }
        built = route_request(MODEL, [{"role": "user", "content": "x"}], None, kwargs)
        assert (built.affinity_key, built.lora, built.cache_salt) == ("s-1", "ad1", "t1")

    def test_embedding_input_is_a_prompt(self) -> None:
        """Without messages, the input is routed as a completions prompt."""
        built = route_request(MODEL, None, ["a", "b"], {})
        assert (built.endpoint, built.text) == ("completions", "a\nb")

    def test_unparseable_body_is_routed_on_its_string_form(self) -> None:
        """A message shape kvroute rejects does not fail the call: its string form is routed instead."""
        built = route_request(MODEL, [{"content": "no role"}], None, {"cache_salt": "s"})
        assert "no role" in built.text and built.cache_salt == "s"

    def test_messages_too_deep_to_print_are_routed_on_empty_text(self) -> None:
        """Messages nested too deeply for str() still give a request (empty text) rather than a RecursionError."""
        deep: list[object] = []
        for _ in range(100_000):
            deep = [deep]
        built = route_request(MODEL, [{"role": "user", "content": deep}], None, {})
        assert built.text == "" and built.model == MODEL


class TestDeployments:
    def test_backend_from_deployment(self) -> None:
        """id, api_base and LiteLLM's weight map onto the kvroute backend."""
        backend = backend_from_deployment(
            {
                "model_name": "m",
                "litellm_params": {"model": "openai/m", "api_base": "http://h:1/v1", "weight": 3},
                "model_info": {"id": 7},
            }
        )
        assert (backend.id, backend.url, backend.weight, backend.labels["litellm_model"]) == (
            "7",
            "http://h:1/v1",
            3.0,
            "openai/m",
        )

    @pytest.mark.parametrize(
        "deployment, message",
        [
            ({"model_name": "m", "litellm_params": {}}, "must have a 'model_info.id' string (got None"),
            (
                {"model_name": "m", "litellm_params": {"weight": 0}, "model_info": {"id": "a"}},
                "'litellm_params.weight' must be a number > 0",
            ),
        ],
    )
    def test_bad_deployment(self, deployment: dict[str, Any], message: str) -> None:
        """A deployment without an id or with a bad weight is a ConfigError saying what was expected."""
        with pytest.raises(ConfigError, match=re.escape(message)):
            backend_from_deployment(deployment)

    def test_sync_follows_the_group(self) -> None:
        """sync adds, removes and re-weights members, and bumps the fleet version only on a change."""
        group = ModelGroup.create("m", kvroute.PluginManager(), "least-outstanding", None)
        d = [{"model_name": "m", "litellm_params": {"weight": 1}, "model_info": {"id": i}} for i in ("a", "b")]
        group.sync(d)
        version = group.fleet.version
        group.sync(d)
        assert group.fleet.version == version
        d[1]["litellm_params"]["weight"] = 2
        group.sync([*d, {"model_name": "m", "litellm_params": {}, "model_info": {"id": "c"}}][1:])
        assert [(b.id, b.weight) for b in group.fleet.backends()] == [("b", 2.0), ("c", 1.0)]


class TestInstall:
    def test_unknown_strategy_fails_at_install(self) -> None:
        """A wrong strategy name is a ConfigError when installing, listing the installed ones."""
        router = litellm.Router(model_list=[])
        with pytest.raises(ConfigError, match="unknown strategy 'nope'"):
            kvroute_litellm.install(router, "nope")

    def test_bad_option_and_timeout(self) -> None:
        """A bad option or lease timeout is refused with what was expected."""
        router = litellm.Router(model_list=[])
        with pytest.raises(ConfigError, match="'prefix_length' must be between 1024 and 65536"):
            kvroute_litellm.install(router, "consistent-hash", {"prefix_length": 3})
        with pytest.raises(ConfigError, match="'lease_timeout' must be a number of seconds > 0"):
            KvrouteRouting(router, "least-outstanding", lease_timeout=0)


class TestRouting:
    @pytest.mark.anyio
    async def test_same_prefix_same_deployment(
        self, fleet3: list[FakeBackend], installed: Callable[..., KvrouteRouting]
    ) -> None:
        """With consistent-hash, calls sharing a 1,024-character prefix all reach one server; other prefixes spread."""
        routing = installed(deployments(fleet3), "consistent-hash", {"prefix_length": 1024})
        router = routing.litellm_router
        for q in range(8):
            await router.acompletion(model=MODEL, messages=chat(DOCUMENT, f"question {q}"))
        shared = [b.name for b in fleet3 if any(p.startswith("question") for p in b.prompts())]
        assert len(shared) == 1 and len(next(b for b in fleet3 if b.name == shared[0]).received) == 8
        for p in range(30):
            await router.acompletion(model=MODEL, messages=chat(f"{p} " + DOCUMENT, "other"))
        assert all(any(p == "other" for p in b.prompts()) for b in fleet3)
        await settle(routing)

    @pytest.mark.anyio
    async def test_decisions_match_a_standalone_router(
        self, fleet3: list[FakeBackend], installed: Callable[..., KvrouteRouting]
    ) -> None:
        """Each call lands where a kvroute Router over the same backend ids sends the same OpenAI body."""
        routing = installed(deployments(fleet3), "consistent-hash", {"prefix_length": 1024})
        standalone = Router.create(
            Fleet([Backend(f"d{i}") for i in range(3)]), "consistent-hash", {"prefix_length": 1024}
        )
        for p in range(24):
            messages = chat(f"{p}-" + DOCUMENT, "q")
            response = await routing.litellm_router.acompletion(model=MODEL, messages=messages)
            expected = standalone.decide(RouteRequest.from_openai({"model": MODEL, "messages": messages}))[0].backend.id
            assert response.choices[0].message.content == f"from b{expected[1:]}"
        await settle(routing)

    @pytest.mark.anyio
    async def test_in_flight_counts_follow_the_calls(
        self, fleet3: list[FakeBackend], installed: Callable[..., KvrouteRouting]
    ) -> None:
        """While servers hold calls, kvroute counts exactly the held calls per deployment; all end at zero."""
        routing = installed(deployments(fleet3), "least-outstanding", {"seed": 1})
        for b in fleet3:
            b.hold()
        async with anyio.create_task_group() as tg:
            for q in range(7):
                tg.start_soon(lambda q=q: routing.litellm_router.acompletion(model=MODEL, messages=chat("p", f"{q}")))
            await eventually(lambda: sum(b.held for b in fleet3) == 7)
            assert routing.in_flight() == {f"d{i}": b.held for i, b in enumerate(fleet3)}
            assert (
                max(routing.in_flight().values()) - min(routing.in_flight().values()) <= 1
            )  # least-outstanding spread
            for b in fleet3:
                b.release()
        await settle(routing)
        assert set(routing.in_flight().values()) == {0}

    @pytest.mark.anyio
    async def test_stream_counts_until_consumed(
        self, fleet3: list[FakeBackend], installed: Callable[..., KvrouteRouting]
    ) -> None:
        """A streamed call stays in flight until the stream has been read to the end."""
        routing = installed(deployments(fleet3), "least-outstanding", {"seed": 2})
        stream = await routing.litellm_router.acompletion(model=MODEL, messages=chat("p", "s"), stream=True)
        assert sum(routing.in_flight().values()) == 1
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
        assert text.startswith("from b")
        await settle(routing)
        assert sum(routing.in_flight().values()) == 0

    @pytest.mark.anyio
    async def test_decision_is_stamped_in_metadata(
        self, fleet3: list[FakeBackend], installed: Callable[..., KvrouteRouting]
    ) -> None:
        """The call's metadata carries the lease id and the one-line decision."""
        routing = installed(deployments(fleet3), "consistent-hash", {"prefix_length": 1024})
        metadata: dict[str, Any] = {}
        await routing.litellm_router.acompletion(model=MODEL, messages=chat(DOCUMENT, "x"), metadata=metadata)
        assert metadata[LEASE_KEY].startswith(routing.instance)
        assert metadata[DECISION_KEY].startswith("consistent-hash -> d") and "(hash" in metadata[DECISION_KEY]
        await settle(routing)

    @pytest.mark.anyio
    async def test_retry_avoids_the_failed_deployment(
        self, fleet3: list[FakeBackend], installed: Callable[..., KvrouteRouting]
    ) -> None:
        """When a deployment fails, LiteLLM's retry goes to another one and every lease ends."""
        routing = installed(
            deployments(fleet3), "consistent-hash", {"prefix_length": 1024}, num_retries=2, retry_after=0
        )
        standalone = Router.create(
            Fleet([Backend(f"d{i}") for i in range(3)]), "consistent-hash", {"prefix_length": 1024}
        )
        messages = chat(DOCUMENT, "retry me")
        home = int(
            standalone.decide(RouteRequest.from_openai({"model": MODEL, "messages": messages}))[0].backend.id[1:]
        )
        fleet3[home].status = 500
        response = await routing.litellm_router.acompletion(model=MODEL, messages=messages)
        assert len(fleet3[home].received) == 1
        assert response.choices[0].message.content != f"from b{home}"
        await settle(routing)
        assert set(routing.in_flight().values()) == {0}

    @pytest.mark.anyio
    async def test_cooldown_is_excluded(
        self, fleet3: list[FakeBackend], installed: Callable[..., KvrouteRouting]
    ) -> None:
        """A deployment LiteLLM put in cooldown gets no calls; its keys go elsewhere, async and sync alike."""
        routing = installed(deployments(fleet3), "consistent-hash", {"prefix_length": 1024})
        router = routing.litellm_router
        router.health().cooldowns.add_deployment_to_cooldown("d0", RuntimeError("test"), 500, 60)
        for p in range(12):
            await router.acompletion(model=MODEL, messages=chat(f"{p}" + DOCUMENT, "q"))
        await anyio.to_thread.run_sync(lambda: router.completion(model=MODEL, messages=chat(DOCUMENT, "sync")))
        assert fleet3[0].received == [] and sum(len(b.received) for b in fleet3) == 13
        await settle(routing)

    @pytest.mark.anyio
    async def test_dry_run_select_holds_no_lease(
        self, fleet3: list[FakeBackend], installed: Callable[..., KvrouteRouting]
    ) -> None:
        """LiteLLM's Router.select() asks the strategy without counting a request in flight."""
        routing = installed(deployments(fleet3), "consistent-hash", {"prefix_length": 1024})
        picked = await routing.litellm_router.select(MODEL, {}, kind="pick", messages=chat(DOCUMENT, "x"))
        assert picked["model_info"]["id"] in {"d0", "d1", "d2"}
        assert routing.open_leases() == 0 and set(routing.in_flight().values()) == {0}

    @pytest.mark.anyio
    async def test_all_cooling_down_is_litellms_error(
        self, fleet3: list[FakeBackend], installed: Callable[..., KvrouteRouting]
    ) -> None:
        """With every deployment in cooldown LiteLLM's own "all in cooldown" error reaches the caller, no lease
        taken."""
        routing = installed(deployments(fleet3), "least-outstanding")
        for i in range(3):
            routing.litellm_router.health().cooldowns.add_deployment_to_cooldown(f"d{i}", RuntimeError("x"), 500, 60)
        with pytest.raises(
            litellm.types.router.RouterRateLimitError, match="All deployments for selected model are in cooldown"
        ):
            await routing.litellm_router.acompletion(model=MODEL, messages=chat("p", "q"), num_retries=0)
        assert routing.open_leases() == 0 and all(b.received == [] for b in fleet3)

    @pytest.mark.anyio
    async def test_abandoned_lease_expires(self, fleet3: list[FakeBackend]) -> None:
        """A lease no callback ends is released on a later pick once older than lease_timeout."""
        router = litellm.Router(model_list=deployments(fleet3))
        routing = KvrouteRouting(router, "least-outstanding", lease_timeout=0.05).install()
        try:
            deployment = routing.get_available_deployment(MODEL, chat("p", "a"), request_kwargs={"metadata": {}})
            assert routing.open_leases() == 1 and deployment["model_info"]["id"] in routing.in_flight()
            await anyio.sleep(0.1)
            routing.get_available_deployment(MODEL, chat("p", "b"), request_kwargs={"metadata": {}})
            assert routing.open_leases() == 1 and sum(routing.in_flight().values()) == 1
        finally:
            routing.uninstall()
        assert sum(routing.in_flight().values()) == 0

    def test_every_deployment_failed_retries_among_all(self) -> None:
        """When every healthy deployment already failed this call, the pick ignores the failures."""
        router = litellm.Router(model_list=deployments([FakeBackend("x"), FakeBackend("y")]))
        routing = KvrouteRouting(router, "least-outstanding", lease_timeout=None)
        kwargs = {"metadata": {kvroute_litellm.FAILED_KEY: ["d0", "d1"]}}
        assert routing.get_available_deployment(MODEL, chat("p", "q"), request_kwargs=kwargs)["model_info"]["id"] in {
            "d0",
            "d1",
        }
        routing.uninstall()

    def test_no_deployment_at_all(self) -> None:
        """A model group without deployments raises NoBackendAvailable naming it."""
        routing = KvrouteRouting(litellm.Router(model_list=[]), "least-outstanding")
        with pytest.raises(NoBackendAvailable, match="model group 'nothing'"):
            routing.get_available_deployment("nothing", chat("p", "q"))


class TestOffline:
    def test_no_outbound_connection_so_far(self) -> None:
        """Importing LiteLLM and every test before this one attempted no non-loopback connection."""
        assert OUTBOUND == []

    @pytest.mark.anyio
    async def test_the_recorder_sees_connections(self) -> None:
        """The audit hook records connections (so an outbound one could not go unnoticed)."""
        before = len(LOOPBACK_CONNECTS)
        async with fake_backends(1) as (backend,):
            stream = await anyio.connect_tcp("127.0.0.1", backend.port)
            await stream.aclose()
        assert len(LOOPBACK_CONNECTS) > before
        assert not is_loopback("10.0.0.1") and not is_loopback("example.org") and is_loopback("::1")

    def test_loopback_only_by_construction(self) -> None:
        """getaddrinfo of a loopback name is not counted as outbound (the recorder is precise)."""
        before = len(OUTBOUND)
        socket.getaddrinfo("127.0.0.1", 80)
        assert len(OUTBOUND) == before
