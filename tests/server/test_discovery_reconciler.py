"""The proxy's discovery reconciler, driven by a fake provider registered in-process (no DNS, no files)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

import kvroute
from kvroute.discovery import DiscoveredBackend, DiscoverySink, Snapshot
from kvroute.errors import ConfigError
from kvroute.loops import Backoff
from kvroute.plugins import PluginManager
from kvroute_server.config import BackendConfig, DiscoveryConfig, DiscoveryPolicy, HealthConfig, ServerConfig
from kvroute_server.proxy.app import ProxyApp

#: Every wait in these tests is bounded by this many seconds.
WAIT = 5.0


class FakeProvider:
    """A provider the test drives: publishes ``first`` on start, then whatever the test sends through ``sink``."""

    def __init__(
        self, source: str, first: list[DiscoveredBackend] | None, *, crash: bool = False, hang: bool = False
    ) -> None:
        self.source = source
        self.first = first
        self.crash = crash
        self.hang = hang
        self.runs = 0
        self.sink: DiscoverySink | None = None

    async def run(self, sink: DiscoverySink, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        self.sink = sink
        self.runs += 1
        if self.hang:  # a buggy provider that never reports started
            await anyio.sleep_forever()
        if self.first is None:
            sink.failed(self.source, "lookup timed out")
        else:
            sink.publish(Snapshot(self.source, self.first))
        task_status.started()
        if self.crash:
            raise RuntimeError("provider bug")
        await anyio.sleep_forever()

    def publish(self, *backends: DiscoveredBackend) -> None:
        assert self.sink is not None
        self.sink.publish(Snapshot(self.source, backends))

    def fail(self, reason: str) -> None:
        assert self.sink is not None
        self.sink.failed(self.source, reason)


class FakePlugin:
    """Registers discovery kind ``fake``: ``target`` names a provider the test made beforehand."""

    def __init__(self) -> None:
        self.providers: dict[str, FakeProvider] = {}

    @kvroute.hookimpl
    def kvroute_register_discovery(self, register: Callable[..., None]) -> None:
        def factory(*, target: str, **options: Any) -> FakeProvider:
            if options:
                raise ValueError(f"unknown option(s) {sorted(options)}")
            return self.providers[target]

        register("fake", factory)


def found(backend_id: str, **fields: Any) -> DiscoveredBackend:
    """A discovered backend at an address nothing listens on (health checks are off in these tests)."""
    fields.setdefault("url", f"http://127.0.0.1:9/{backend_id}")
    return DiscoveredBackend(id=backend_id, **fields)


def make_app(plugin: FakePlugin, *sources: str, api_key: str | None = None, **config: Any) -> ProxyApp:
    plugins = PluginManager()
    plugins.register(plugin, name="fake-discovery")
    config.setdefault("health", HealthConfig(interval=0))
    config.setdefault("strategy", "least-outstanding")
    config.setdefault("access_log", False)
    discovery = tuple(DiscoveryConfig("fake", {"target": s}, api_key=api_key) for s in sources)
    return ProxyApp(ServerConfig(discovery=discovery, **config), plugins=plugins)


@pytest.fixture
def plugin() -> FakePlugin:
    return FakePlugin()


@pytest.fixture
async def running(plugin: FakePlugin) -> AsyncIterator[Callable[..., Any]]:
    """``await start(*sources, **config)`` runs a proxy app (no HTTP) until the test ends."""
    async with anyio.create_task_group() as tg:
        done = anyio.Event()

        async def start(*sources: str, **config: Any) -> ProxyApp:
            app = make_app(plugin, *sources, **config)
            started = anyio.Event()

            async def run() -> None:
                async with app.running():
                    started.set()
                    await done.wait()

            tg.start_soon(run)
            with anyio.fail_after(WAIT):
                await started.wait()
            return app

        yield start
        done.set()


def ids(app: ProxyApp) -> list[str]:
    return sorted(s.id for s in app.fleet)


def metric(app: ProxyApp, name: str, **labels: str) -> float | None:
    value = app.metrics.registry.get_sample_value(name, labels)
    return None if value is None else float(value)


async def until(check: Callable[[], bool], what: str) -> None:
    """Poll ``check`` until it holds (at most `WAIT` seconds; the reconciler offers the test no event to wait on)."""
    with anyio.fail_after(WAIT):
        while True:
            if check():
                return
            await anyio.sleep(0.01)


@pytest.mark.anyio
class TestReconciler:
    """`kvroute_server.fleet.discovery.Discovery`: snapshots in, fleet changes out."""

    async def test_adds_the_union_of_sources_beside_static_backends(
        self, plugin: FakePlugin, running: Callable[..., Any]
    ) -> None:
        """Discovered backends join static ones; the first source wins an id conflict; a static id is never taken."""
        plugin.providers["a"] = FakeProvider("fake:a", [found("x", weight=2), found("shared")])
        plugin.providers["b"] = FakeProvider("fake:b", [found("shared", weight=5), found("y"), found("static")])
        static = BackendConfig(id="static", url="http://127.0.0.1:9/static")
        app = await running("a", "b", backends=(static,))
        assert ids(app) == ["shared", "static", "x", "y"]
        assert app.fleet.get("shared").backend.weight == 1.0  # source a's
        assert app.fleet.get("static").backend.url == "http://127.0.0.1:9/static"
        assert app.discovery is not None
        assert app.discovery.owned("fake:a") == ["shared", "x"] and app.discovery.owned("fake:b") == ["y"]
        assert metric(app, "kvroute_discovery_changes_total", source="fake:a", change="added") == 2

    async def test_gone_backend_drains_and_leaves_when_idle(
        self, plugin: FakePlugin, running: Callable[..., Any]
    ) -> None:
        """An id gone from the answer stops taking requests, keeps its in-flight one, and is removed once idle."""
        provider = plugin.providers["a"] = FakeProvider("fake:a", [found("x"), found("y"), found("z")])
        app = await running("a")
        state = app.fleet.get("y")
        app.fleet.request_started(state)
        provider.publish(found("x"), found("z"))
        assert "y" in app.fleet and state.draining and state.in_flight == 1
        await anyio.sleep(0.2)
        assert "y" in app.fleet  # still busy
        app.fleet.request_finished(state)
        await until(lambda: "y" not in app.fleet, "y removed")
        assert ids(app) == ["x", "z"]
        assert metric(app, "kvroute_discovery_changes_total", source="fake:a", change="removed") == 1

    async def test_changes_apply_in_place_or_replace_keeping_counts(
        self, plugin: FakePlugin, running: Callable[..., Any]
    ) -> None:
        """New weights, models and labels keep the member's state; a new URL replaces it, in-flight count carried."""
        provider = plugin.providers["a"] = FakeProvider("fake:a", [found("x"), found("y")])
        app = await running("a")
        x, y = app.fleet.get("x"), app.fleet.get("y")
        app.fleet.request_started(y)
        provider.publish(
            found("x", weight=3, models={"m"}, labels={"zone": "b"}), found("y", url="http://127.0.0.1:9/moved")
        )
        assert app.fleet.get("x") is x and x.backend.weight == 3 and x.backend.models == frozenset({"m"})
        assert dict(x.backend.labels) == {"zone": "b"}
        config = app.backends.config("x")
        assert config is not None and (config.weight, config.models, dict(config.labels)) == (3, ("m",), {"zone": "b"})
        assert app.fleet.get("y").backend.url == "http://127.0.0.1:9/moved"  # removed and added again
        assert app.fleet.get("y").in_flight == 1
        app.fleet.request_finished(app.fleet.get("y"))
        for change in ("weight", "models", "labels", "replaced"):
            assert metric(app, "kvroute_discovery_changes_total", source="fake:a", change=change) == 1

    async def test_draining_flag_drains_without_removing(self, plugin: FakePlugin, running: Callable[..., Any]) -> None:
        """``draining=True`` drains a member and keeps it; the flag going back undrains it."""
        provider = plugin.providers["a"] = FakeProvider("fake:a", [found("x"), found("y", draining=True)])
        app = await running("a")
        assert app.fleet.get("y").draining
        provider.publish(found("x", draining=True), found("y"))
        await anyio.sleep(0.2)
        assert ids(app) == ["x", "y"] and app.fleet.get("x").draining and not app.fleet.get("y").draining

    async def test_admin_drain_stands_while_the_answer_does_not_change(
        self, plugin: FakePlugin, running: Callable[..., Any]
    ) -> None:
        """Only differences between answers are applied: repeating an answer does not undo an operator's drain."""
        provider = plugin.providers["a"] = FakeProvider("fake:a", [found("x"), found("y")])
        app = await running("a")
        app.backends.drain("x")
        provider.publish(found("x"), found("y"))
        assert app.fleet.get("x").draining

    async def test_a_returning_id_is_undrained_not_removed(
        self, plugin: FakePlugin, running: Callable[..., Any]
    ) -> None:
        """An id that comes back while it drains towards removal stays, taking requests again."""
        provider = plugin.providers["a"] = FakeProvider("fake:a", [found("x"), found("y"), found("z")])
        app = await running("a")
        state = app.fleet.get("y")
        app.fleet.request_started(state)
        provider.publish(found("x"), found("z"))
        assert state.draining
        provider.publish(found("x"), found("y"), found("z"))
        app.fleet.request_finished(state)
        await anyio.sleep(0.2)
        assert app.fleet.get("y") is state and not state.draining

    async def test_failure_keeps_the_fleet_and_marks_the_source_stale(
        self, plugin: FakePlugin, running: Callable[..., Any]
    ) -> None:
        """A failed lookup changes only the source's staleness (metrics, /health); a good answer clears it."""
        provider = plugin.providers["a"] = FakeProvider("fake:a", [found("x"), found("y")])
        app = await running("a")
        assert app.discovery is not None
        assert metric(app, "kvroute_discovery_stale", source="fake:a") == 0
        assert metric(app, "kvroute_discovery_last_success_timestamp_seconds", source="fake:a")
        provider.fail("SERVFAIL")
        assert ids(app) == ["x", "y"] and metric(app, "kvroute_discovery_stale", source="fake:a") == 1
        (entry,) = app.discovery.describe()
        assert entry["stale"] is True and entry["last_error"] == "SERVFAIL" and entry["backends"] == 2
        provider.publish(found("x"), found("y"))
        assert metric(app, "kvroute_discovery_stale", source="fake:a") == 0
        assert app.discovery.describe()[0]["stale"] is False

    async def test_empty_answer_keeps_the_fleet(self, plugin: FakePlugin, running: Callable[..., Any]) -> None:
        """An answer naming no backend is treated as a failure: the last good set stays, the source is stale."""
        provider = plugin.providers["a"] = FakeProvider("fake:a", [found("x"), found("y")])
        app = await running("a")
        provider.publish()
        await anyio.sleep(0.2)
        assert ids(app) == ["x", "y"] and not any(s.draining for s in app.fleet)
        assert metric(app, "kvroute_discovery_stale", source="fake:a") == 1

    async def test_first_lookup_failing_starts_with_no_discovered_backend(
        self, plugin: FakePlugin, running: Callable[..., Any]
    ) -> None:
        """A source that fails its first lookup still lets the proxy start, stale, and fills in on its first answer."""
        provider = plugin.providers["a"] = FakeProvider("fake:a", None)
        app = await running("a")
        assert ids(app) == [] and metric(app, "kvroute_discovery_stale", source="fake:a") == 1
        provider.publish(found("x"))
        assert ids(app) == ["x"]

    async def test_silent_source_turns_stale_after_stale_after(
        self, plugin: FakePlugin, running: Callable[..., Any]
    ) -> None:
        """A source with no good answer for ``stale_after`` seconds is reported stale, its backends kept."""
        plugin.providers["a"] = FakeProvider("fake:a", [found("x")])
        app = await running("a", discovery_policy=DiscoveryPolicy(stale_after=0.2))
        assert app.discovery is not None and app.discovery.describe()[0]["stale"] is False
        await until(lambda: metric(app, "kvroute_discovery_stale", source="fake:a") == 1, "stale")
        assert app.discovery.describe()[0]["stale"] is True and ids(app) == ["x"]

    async def test_mass_removal_is_gradual(self, plugin: FakePlugin, running: Callable[..., Any]) -> None:
        """Removing more than max_removal_share at once removes one backend per removal_interval, in id order."""
        provider = plugin.providers["a"] = FakeProvider("fake:a", [found(i) for i in "abcd"])
        policy = DiscoveryPolicy(max_removal_share=0.5, removal_interval=0.4, on_mass_removal="gradual")
        app = await running("a", discovery_policy=policy)
        began = time.monotonic()
        provider.publish(found("d"))
        await anyio.sleep(0.1)
        assert ids(app) == ["b", "c", "d"]  # the first went at once
        await until(lambda: ids(app) == ["c", "d"], "the second removal")
        assert time.monotonic() - began >= 0.4
        await until(lambda: ids(app) == ["d"], "the last removal")
        assert time.monotonic() - began >= 0.8

    async def test_a_full_swap_is_a_mass_removal(self, plugin: FakePlugin, running: Callable[..., Any]) -> None:
        """An answer replacing every id adds the new ones at once and lets the old ones go one at a time."""
        provider = plugin.providers["a"] = FakeProvider("fake:a", [found(i) for i in "abcd"])
        policy = DiscoveryPolicy(max_removal_share=0.5, removal_interval=0.5, on_mass_removal="gradual")
        app = await running("a", discovery_policy=policy)
        provider.publish(*(found(i) for i in "wxyz"))
        await anyio.sleep(0.1)
        assert ids(app) == ["b", "c", "d", "w", "x", "y", "z"]

    async def test_mass_removal_is_held(self, plugin: FakePlugin, running: Callable[..., Any]) -> None:
        """With on_mass_removal = "hold", such an update removes nothing; a smaller removal later goes through."""
        provider = plugin.providers["a"] = FakeProvider("fake:a", [found(i) for i in "abcd"])
        app = await running("a", discovery_policy=DiscoveryPolicy(on_mass_removal="hold"))
        provider.publish(found("d"))
        await anyio.sleep(0.3)
        assert ids(app) == ["a", "b", "c", "d"] and not any(s.draining for s in app.fleet)
        assert metric(app, "kvroute_discovery_changes_total", source="fake:a", change="held") == 1
        provider.publish(found("b"), found("c"), found("d"))
        await until(lambda: ids(app) == ["b", "c", "d"], "a one-in-four removal")

    async def test_the_reconciler_wakes_on_changes_not_on_a_timer(
        self, plugin: FakePlugin, running: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With nothing due, the reconciler sleeps until an answer or a failure arrives, then looks at once."""
        provider = plugin.providers["a"] = FakeProvider("fake:a", [found("x")])
        app = await running("a", discovery_policy=DiscoveryPolicy(stale_after=3600))
        assert app.discovery is not None
        looks = 0
        tick = app.discovery._tick

        def counting() -> float:
            nonlocal looks
            looks += 1
            return tick()

        monkeypatch.setattr(app.discovery, "_tick", counting)
        provider.fail("lookup timed out")  # wakes it once more, with the counting look in place
        await anyio.wait_all_tasks_blocked()
        assert looks == 1
        await anyio.sleep(0.3)  # long enough for a reconciler polling on a timer to look again
        assert looks == 1
        provider.publish(found("x"), found("y"))
        await anyio.wait_all_tasks_blocked()
        assert looks == 2 and metric(app, "kvroute_discovery_stale", source="fake:a") == 0

    async def test_crashing_provider_is_reported_and_restarted(
        self, plugin: FakePlugin, running: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A provider that raises (a bug) marks its source stale, keeps its backends and is run again."""
        monkeypatch.setattr("kvroute_server.fleet.discovery._RESTART", Backoff(initial=0.3, jitter=0))
        provider = plugin.providers["a"] = FakeProvider("fake:a", [found("x")], crash=True)
        app = await running("a")
        assert app.discovery is not None
        status = app.discovery.status["fake:a"]
        await until(lambda: "RuntimeError: provider bug" in str(status.last_error), "the crash reported")
        assert status.failing and ids(app) == ["x"]
        await until(lambda: provider.runs >= 2, "a restart")

    async def test_source_api_key_reaches_its_backends(self, plugin: FakePlugin, running: Callable[..., Any]) -> None:
        """A source's api_key is the key of every backend it finds (the provider never sees it)."""
        plugin.providers["a"] = FakeProvider("fake:a", [found("x")])
        app = await running("a", api_key="sk-fleet")
        assert app.backends.config("x").api_key == "sk-fleet"  # type: ignore[union-attr]

    async def test_a_silent_provider_does_not_block_the_start(
        self, plugin: FakePlugin, running: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A provider that never reports started is reported failed after the first-answer timeout; others serve."""
        monkeypatch.setattr("kvroute_server.fleet.discovery.FIRST_ANSWER_TIMEOUT", 0.2)
        plugin.providers["a"] = FakeProvider("fake:a", None, hang=True)
        plugin.providers["b"] = FakeProvider("fake:b", [found("y")])
        app = await running("a", "b")
        assert ids(app) == ["y"] and app.discovery is not None
        assert app.discovery.status["fake:a"].last_error == "no first answer within 0.2 s of the start"
        assert metric(app, "kvroute_discovery_stale", source="fake:a") == 1


class TestDiscoverySetup:
    """Building the providers from the configuration."""

    def test_unknown_kind_names_installed_kinds(self, plugin: FakePlugin) -> None:
        """An unknown kind is a ConfigError listing the kinds that are installed."""
        plugins = PluginManager()
        plugins.register(plugin, name="fake-discovery")
        config = ServerConfig(discovery=(DiscoveryConfig("consul", {"target": "x"}),), strategy="least-outstanding")
        with pytest.raises(ConfigError, match=r"discovery kind 'consul' is not installed \(installed kinds: .*fake"):
            ProxyApp(config, plugins=plugins)

    def test_rejected_options_are_a_config_error(self, plugin: FakePlugin) -> None:
        """A factory's ValueError becomes a ConfigError naming the kind and the options."""
        plugin.providers["a"] = FakeProvider("fake:a", [])
        config = DiscoveryConfig("fake", {"target": "a", "color": "red"})
        with pytest.raises(ConfigError, match=r"discovery 'fake' rejected its options .*color"):
            _app_with(plugin, config)

    def test_same_source_twice_is_a_config_error(self, plugin: FakePlugin) -> None:
        """Two sources with the same name would fight over the same backends: refused."""
        plugin.providers["a"] = FakeProvider("fake:a", [])
        with pytest.raises(ConfigError, match=r"source 'fake:a' is configured twice"):
            make_app(plugin, "a", "a")


def _app_with(plugin: FakePlugin, *configs: DiscoveryConfig) -> ProxyApp:
    plugins = PluginManager()
    plugins.register(plugin, name="fake-discovery")
    return ProxyApp(ServerConfig(discovery=configs, strategy="least-outstanding"), plugins=plugins)
