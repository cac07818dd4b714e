"""The proxy's backend set: served models on the backend's state, truthful no-backend answers, adapters closed."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import anyio
import attrs
import pytest
from structlog.testing import capture_logs

import kvroute
from kvroute import Fleet, PluginManager
from kvroute_server import BackendConfig, HealthConfig, ProxyApp, ServerConfig, ServerThread
from kvroute_server.fleet.backends import BackendSet
from kvroute_server.ops.metrics import ProxyMetrics
from tests.server.harness import Servers, chat_body, http, in_loop

pytestmark = pytest.mark.e2e

#: What the test adapters did, in order: ``(backend id, what)``.
EVENTS: list[tuple[str, str]] = []


@attrs.define
class ClosingAdapter(kvroute.OpenAIAdapter):
    """An openai-kind adapter that follows KV events until cancelled and records its ``aclose``."""

    async def run_events(self, http: Any, sink: Any, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        EVENTS.append((self.backend.id, "feed"))
        try:
            await anyio.sleep_forever()
        finally:
            EVENTS.append((self.backend.id, "feed stopped"))

    async def aclose(self) -> None:
        EVENTS.append((self.backend.id, "closed"))


@attrs.define
class HangingAdapter(kvroute.OpenAIAdapter):
    """An adapter whose ``aclose`` never returns."""

    async def aclose(self) -> None:
        EVENTS.append((self.backend.id, "closing"))
        await anyio.sleep_forever()


@attrs.define
class BareAdapter:
    """Only what `kvroute.adapters.BackendAdapter` declares: no ``probe``, no ``list_models``."""

    backend: kvroute.Backend
    health_path: str = "/health"
    models_path: str = "/v1/models"


@attrs.define
class SinkStrategy(kvroute.BaseStrategy):
    """Routes to the first candidate and offers a KV event sink, so that adapters' feeds run."""

    index: Any = attrs.field(factory=lambda: _Sink())

    def pick(self, request: kvroute.RouteRequest, candidates: Any) -> kvroute.BackendState:
        return candidates[0]


class _Sink:
    block_size = 16

    def set_exact(self, backend: str, exact: bool = True) -> None:
        return None

    def blocks_stored(self, backend: str, token_ids: Any, **kwargs: Any) -> list[int]:
        return []

    def blocks_removed(self, backend: str, engine_hashes: Any = ()) -> int:
        return 0

    def all_cleared(self, backend: str) -> None:
        return None


class _Plugin:
    @kvroute.hookimpl
    def kvroute_register_strategies(self, register: Callable[..., None]) -> None:
        register("sink-test", SinkStrategy)

    @kvroute.hookimpl
    def kvroute_register_backend_kinds(self, register: Callable[..., None]) -> None:
        register("closing-test", lambda backend, **options: ClosingAdapter(backend, **options))
        register("hanging-test", lambda backend, **options: HangingAdapter(backend, **options))
        register("bare-test", lambda backend, **options: BareAdapter(backend, **options))


def _plugins() -> PluginManager:
    plugins = PluginManager(autoload=False)
    plugins.register(_Plugin(), name="test-plugin")
    return plugins


def _wait(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not condition():
        time.sleep(0.02)
    return condition()


def _app(*backends: BackendConfig, **config: Any) -> ProxyApp:
    config.setdefault("strategy", "sink-test")
    config.setdefault("health", HealthConfig(interval=0.1, timeout=1.0, unhealthy_threshold=1, healthy_threshold=1))
    return ProxyApp(ServerConfig(backends=backends, access_log=False, **config), plugins=_plugins())


class TestServedModels:
    def test_discovered_models_live_on_the_backend_state(self, servers: Servers) -> None:
        """Models an engine reports are stored on its BackendState, and requests follow them."""
        a, b = servers.emulator(model="alpha"), servers.emulator(model="beta")
        proxy = servers.proxy([a, b])
        fleet = proxy.app.fleet
        assert _wait(lambda: fleet.get("e1").served_models is not None)
        assert fleet.get("e0").served_models == {"alpha"} and fleet.get("e1").served_models == {"beta"}
        assert (
            http("POST", proxy.url + "/v1/chat/completions", chat_body("hi", model="beta"))[1]["x-kvroute-backend"]
            == "e1"
        )

    def test_declared_models_are_not_replaced_by_discovery(self, servers: Servers) -> None:
        """A backend that declares its models is not asked for them: the declared ones route, the engine's do not."""
        engine = servers.emulator(model="m")
        app = _app(BackendConfig(id="a", url=engine.url, models=("alpha",)))
        with ServerThread(app) as proxy:
            assert _wait(lambda: app.backends.health.rounds >= 2)
            assert app.fleet.get("a").served_models is None
            status, _, body = http("POST", proxy.url + "/v1/chat/completions", chat_body("hi", model="m"))
        assert status == 404 and json.loads(body)["error"]["message"] == "The model 'm' does not exist (served: alpha)."

    def test_no_backend_message_counts_only_backends_serving_the_model(self, servers: Servers) -> None:
        """With the only backend serving a model ejected, the 503 says 1 serves it and none already failed."""
        a, b = servers.emulator(model="alpha"), servers.emulator(model="beta")
        proxy = servers.proxy(
            [a, b], health=HealthConfig(interval=0.05, timeout=1.0, unhealthy_threshold=1, healthy_threshold=1)
        )
        fleet = proxy.app.fleet
        assert _wait(lambda: fleet.get("e0").served_models is not None and fleet.get("e1").served_models is not None)
        assert http("POST", a.url + "/emulator/faults", {"health_status": 503})[0] == 200
        assert _wait(lambda: not fleet.get("e0").healthy)
        status, _, body = http("POST", proxy.url + "/v1/chat/completions", chat_body("hi", model="alpha"))
        assert status == 503
        assert json.loads(body)["error"]["message"] == (
            "no backend available for model 'alpha': of 1 serving it, 1 unhealthy, 0 draining, "
            "0 already failed this request."
        )
        status, _, body = http("POST", proxy.url + "/v1/chat/completions", chat_body("hi", model="gamma"))
        assert status == 404 and "(served: alpha, beta)" in json.loads(body)["error"]["message"]


class TestAdapterLifetime:
    def test_removal_stops_the_feed_then_closes_and_shutdown_closes_the_rest(self, servers: Servers) -> None:
        """Removing a backend ends its KV event feed and then awaits its adapter's aclose; stopping the proxy closes the
        others."""
        EVENTS.clear()
        a, b = servers.emulators(2)
        app = _app(
            BackendConfig(id="a", url=a.url, kind="closing-test"), BackendConfig(id="b", url=b.url, kind="closing-test")
        )
        with ServerThread(app) as proxy:
            assert _wait(lambda: {("a", "feed"), ("b", "feed")} <= set(EVENTS))
            in_loop(proxy, app.backends.remove, "a")
            assert _wait(lambda: ("a", "closed") in EVENTS)
            assert [e for e in EVENTS if e[0] == "a"] == [("a", "feed"), ("a", "feed stopped"), ("a", "closed")]
            assert ("b", "closed") not in EVENTS
        assert [e for e in EVENTS if e[0] == "b"] == [("b", "feed"), ("b", "feed stopped"), ("b", "closed")]

    def test_an_adapter_added_at_runtime_is_closed_at_shutdown(self, servers: Servers) -> None:
        """An adapter added through the backend set while the proxy runs is closed when it stops."""
        EVENTS.clear()
        a = servers.emulator()
        app = _app()
        with ServerThread(app) as proxy:
            in_loop(proxy, app.backends.add, BackendConfig(id="late", url=a.url, kind="closing-test"))
            assert _wait(lambda: ("late", "feed") in EVENTS)
        assert EVENTS[-1] == ("late", "closed")

    def test_a_hanging_aclose_does_not_hold_the_shutdown(
        self, servers: Servers, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An aclose that never returns is given up after CLOSE_TIMEOUT, with a warning naming the backend."""
        import kvroute_server.fleet.backends

        monkeypatch.setattr(kvroute_server.fleet.backends, "CLOSE_TIMEOUT", 0.2)
        EVENTS.clear()
        a = servers.emulator()
        app = _app(BackendConfig(id="stuck", url=a.url, kind="hanging-test"))
        with capture_logs() as logs:
            started = time.monotonic()
            with ServerThread(app):
                pass
            took = time.monotonic() - started
        assert EVENTS == [("stuck", "closing")] and took < 10
        assert any(e["event"] == "adapter_close_timed_out" and e["backend"] == "stuck" for e in logs)


class TestDeclaredCapabilities:
    def test_an_adapter_without_probe_is_probed_at_its_health_path(self, servers: Servers) -> None:
        """An adapter that is only a BackendAdapter is probed with GET health_path: a 404 there ejects it."""
        a, b = servers.emulators(2)
        app = _app(
            BackendConfig(id="ok", url=a.url, kind="bare-test"),
            BackendConfig(id="wrong-path", url=b.url, kind="bare-test", adapter_options={"health_path": "/nowhere"}),
        )
        with ServerThread(app):
            assert _wait(lambda: not app.fleet.get("wrong-path").healthy)
            assert app.fleet.get("ok").healthy and app.fleet.get("ok").served_models is None


@pytest.mark.anyio
class TestRemoveWhenIdle:
    """`BackendSet.drain(..., remove_when_idle=True)`: woken by the change it waits for, never by a timer."""

    @staticmethod
    def _set() -> BackendSet:
        fleet = Fleet()
        backends = BackendSet(
            fleet, PluginManager(), HealthConfig(interval=0), ProxyMetrics(fleet, "random"), connect_timeout=1.0
        )
        backends.add(BackendConfig(id="a", url="http://127.0.0.1:9"))
        return backends

    async def test_removed_as_the_last_request_finishes(self) -> None:
        """A draining backend with a request in flight stays, and is removed as soon as that request finishes."""
        backends = self._set()
        async with backends.running(None):
            state = backends.fleet.get("a")
            backends.fleet.request_started(state)
            backends.drain("a", remove_when_idle=True)
            await anyio.wait_all_tasks_blocked()
            assert "a" in backends and state.draining
            backends.fleet.request_finished(state)
            await anyio.wait_all_tasks_blocked()  # a waiter polling on a timer would still be asleep here
            assert "a" not in backends

    async def test_undrained_while_busy_is_kept(self) -> None:
        """Undraining a backend waiting to be removed ends the wait at once: it stays once its requests finish."""
        backends = self._set()
        async with backends.running(None):
            state = backends.fleet.get("a")
            backends.fleet.request_started(state)
            backends.drain("a", remove_when_idle=True)
            await anyio.wait_all_tasks_blocked()
            backends.drain("a", draining=False)
            await anyio.wait_all_tasks_blocked()
            backends.fleet.request_finished(state)
            await anyio.wait_all_tasks_blocked()
            assert "a" in backends and not state.draining
