"""The proxy hosts adapters' background work: KV event feeds per backend and the tokenizer parity check."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import attrs
import pytest

import kvroute
from kvroute import PluginManager
from kvroute.adapters import HttpReply
from kvroute_server import BackendConfig, HealthConfig, ProxyApp, ServerConfig
from kvroute_server.fleet.adapter_http import BackendHttp
from tests.server.harness import Servers, http, in_loop

pytestmark = pytest.mark.e2e


@attrs.define
class RecordingSink:
    """A KvEventSink that only records which backends were marked exact."""

    block_size: int = 16
    exact: dict[str, bool] = attrs.field(factory=dict)

    def set_exact(self, backend: str, exact: bool = True) -> None:
        self.exact[backend] = exact

    def blocks_stored(self, backend: str, token_ids: Sequence[int], **kwargs: Any) -> list[int]:
        return []

    def blocks_removed(self, backend: str, engine_hashes: Any = ()) -> int:
        return 0

    def all_cleared(self, backend: str) -> None:
        return None


@attrs.define
class SinkStrategy(kvroute.BaseStrategy):
    """Routes to the first candidate and offers a KV event sink as ``index``."""

    index: RecordingSink = attrs.field(factory=RecordingSink)

    def pick(self, request: kvroute.RouteRequest, candidates: Sequence[kvroute.BackendState]) -> kvroute.BackendState:
        return candidates[0]


RUNNING: dict[str, str] = {}


@attrs.define
class EventAdapter(kvroute.OpenAIAdapter):
    """An openai-kind adapter whose run_events marks the backend exact until cancelled."""

    async def run_events(self, http: Any, sink: Any, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        reply = await http.post("/tokenize", {"prompt": "a b c"})
        RUNNING[self.backend.id] = "running" if reply.status == 200 else f"status {reply.status}"
        sink.set_exact(self.backend.id, True)
        try:
            await anyio.sleep_forever()
        finally:
            RUNNING[self.backend.id] = "cancelled"
            sink.set_exact(self.backend.id, False)


class _Plugin:
    @kvroute.hookimpl
    def kvroute_register_strategies(self, register: Callable[..., None]) -> None:
        register("sink-test", SinkStrategy)

    @kvroute.hookimpl
    def kvroute_register_backend_kinds(self, register: Callable[..., None]) -> None:
        register("events-test", lambda backend, **options: EventAdapter(backend, **options))


def _wait(condition: Callable[[], bool]) -> bool:
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not condition():
        time.sleep(0.02)
    return condition()


class TestKvEventFeeds:
    def test_feeds_start_per_backend_and_stop_on_removal(self, servers: Servers) -> None:
        """run_events runs for each backend (at start and when added) with a POST-capable client, and is cancelled on
        removal."""
        RUNNING.clear()
        a, b = servers.emulators(2)
        plugins = PluginManager(autoload=False)
        plugins.register(_Plugin(), name="test-plugin")
        config = ServerConfig(
            backends=(BackendConfig(id="a", url=a.url, kind="events-test"),),
            strategy="sink-test",
            health=HealthConfig(interval=0.2),
            access_log=False,
        )
        from kvroute_server import ServerThread

        app = ProxyApp(config, plugins=plugins)
        with ServerThread(app) as proxy:
            assert _wait(lambda: RUNNING.get("a") == "running")
            sink = app.router.strategy.index  # type: ignore[attr-defined]
            assert sink.exact == {"a": True}
            assert proxy.loop is not None
            in_loop(proxy, app.backends.add, BackendConfig(id="b", url=b.url, kind="events-test"))
            assert _wait(lambda: RUNNING.get("b") == "running")
            in_loop(proxy, app.backends.remove, "a")
            assert _wait(lambda: RUNNING.get("a") == "cancelled")
            assert sink.exact["a"] is False and sink.exact["b"] is True
            assert (
                http("POST", proxy.url + "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1})[1][
                    "x-kvroute-backend"
                ]
                == "b"
            )
        assert RUNNING["b"] == "cancelled"

    def test_no_sink_no_feed(self, servers: Servers) -> None:
        """A strategy without a KV event sink never starts the adapters' feeds."""
        RUNNING.clear()
        a = servers.emulator()
        plugins = PluginManager(autoload=False)
        plugins.register(_Plugin(), name="test-plugin")
        plugins.load_entrypoints(only={"least-outstanding"})
        config = ServerConfig(
            backends=(BackendConfig(id="a", url=a.url, kind="events-test"),),
            strategy="least-outstanding",
            options={"seed": 0},
            health=HealthConfig(interval=0.1),
            access_log=False,
        )
        from kvroute_server import ServerThread

        app = ProxyApp(config, plugins=plugins)
        with ServerThread(app) as proxy:
            assert _wait(lambda: app.backends.health.rounds >= 2)
            assert http("GET", proxy.url + "/health")[0] == 200
        assert RUNNING == {}


class TestParityCheck:
    def test_startup_check_runs_after_first_round(self, servers: Servers, monkeypatch: pytest.MonkeyPatch) -> None:
        """A strategy with a prompt tokenizer gets kvroute_server.parity.startup_check over every routable backend."""
        import kvroute_server.parity

        calls: list[list[tuple[str, str]]] = []

        async def fake_check(strategy: object, targets: Any, **kwargs: Any) -> list[object]:
            targets = list(targets)
            assert all(isinstance(t[2], BackendHttp) for t in targets)
            calls.append([(t[0], t[1]) for t in targets])
            return []

        monkeypatch.setattr(kvroute_server.parity, "startup_check", fake_check)
        a = servers.emulator()
        plugins = PluginManager(autoload=False)
        plugins.register(_Plugin(), name="test-plugin")

        @attrs.define
        class Tokenized(SinkStrategy):
            prompt_tokenizer: object = "a tokenizer"

        class _Tok:
            @kvroute.hookimpl
            def kvroute_register_strategies(self, register: Callable[..., None]) -> None:
                register("tokenized-test", Tokenized)

        plugins.register(_Tok(), name="tok-plugin")
        app = ProxyApp(
            ServerConfig(
                backends=(BackendConfig(id="a", url=a.url),),
                strategy="tokenized-test",
                health=HealthConfig(interval=0.1),
                access_log=False,
            ),
            plugins=plugins,
        )
        from kvroute_server import ServerThread

        with ServerThread(app):
            assert _wait(lambda: len(calls) == 1)
        assert calls == [[("a", a.url)]]


class TestBackendHttp:
    @pytest.mark.anyio
    async def test_get_and_post(self, servers: Servers) -> None:
        """The adapters' client GETs and POSTs JSON relative to the backend URL, and wraps transport errors as
        OSError."""
        from kvroute_server.fleet.adapter_http import create_session

        emulator = servers.emulator()
        session = create_session(2.0)
        try:
            client = BackendHttp(session, emulator.url, 5.0)
            assert (await client.get("/health")).status == 200
            reply = await client.post("tokenize", {"prompt": "a b"})
            assert isinstance(reply, HttpReply) and reply.json()["count"] == 2
            echo = await client.post("/emulator/faults", {})  # answers with the JSON it parsed
            assert echo.status == 200
            dead = BackendHttp(session, "http://127.0.0.1:9", 1.0)
            with pytest.raises(OSError, match=r"GET http://127\.0\.0\.1:9/health failed"):
                await dead.get("/health")
        finally:
            await session.close()
