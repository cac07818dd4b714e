"""The plugin manager: entry points, attribution of failures, environment switches."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import kvroute
from kvroute import Backend, Fleet, PluginLoadError, PluginManager, Router, RouteRequest
from kvroute.plugins import BLOCK_ENV, DISABLE_AUTOLOAD_ENV, PLUGINS_ENV


def fake_distribution(root: Path, dist: str, version: str, ep_name: str, module: str, source: str) -> None:
    """Write an installed-looking distribution (a .dist-info with an entry point) under root."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[kvroute]\n{ep_name} = {module}\n")


GOOD = """
import kvroute

class Only(kvroute.BaseStrategy):
    def pick(self, request, candidates):
        return candidates[0]

@kvroute.hookimpl
def kvroute_register_strategies(register):
    register("only-first", Only)
"""


class TestEntryPoints:
    def test_broken_plugin_is_named(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A plugin that fails to import raises PluginLoadError naming plugin, distribution and version."""
        fake_distribution(tmp_path, "kvroute-broken", "9.1", "broken", "kvroute_broken_mod", "raise ImportError('no numpy')")
        monkeypatch.syspath_prepend(str(tmp_path))
        with pytest.raises(PluginLoadError) as info:
            PluginManager()
        message = str(info.value)
        assert "plugin 'broken'" in message and "kvroute-broken 9.1" in message and "no numpy" in message

    def test_block_env_skips_a_plugin(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """KVROUTE_BLOCK_PLUGINS keeps a named entry point from loading at all."""
        fake_distribution(tmp_path, "kvroute-broken", "9.1", "broken", "kvroute_broken_mod2", "raise ImportError('x')")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv(BLOCK_ENV, "broken")
        assert "broken" not in {p.name for p in PluginManager().plugins()}

    def test_disable_autoload(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """With autoload disabled only the entry points named in KVROUTE_PLUGINS load."""
        fake_distribution(tmp_path, "kvroute-only", "1.0", "only", "kvroute_only_mod", GOOD)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
        assert "only-first" not in PluginManager().strategies
        monkeypatch.setenv(PLUGINS_ENV, "only")
        registration = PluginManager().strategies["only-first"]
        assert (registration.plugin.distribution, registration.plugin.version) == ("kvroute-only", "1.0")

    def test_entry_point_strategy_routes(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A strategy found through an entry point routes requests through the Router."""
        fake_distribution(tmp_path, "kvroute-only", "1.0", "only", "kvroute_only_mod2", GOOD.replace("only-first", "only-2"))
        monkeypatch.syspath_prepend(str(tmp_path))
        router = Router.create(Fleet([Backend("x"), Backend("y")]), "only-2")
        with router.route(RouteRequest.from_text("t")) as lease:
            assert lease.backend.id == "x"


class TestRegistrationErrors:
    def test_duplicate_names(self) -> None:
        """Two plugins registering the same strategy name is an error naming both."""

        class A:
            @kvroute.hookimpl
            def kvroute_register_strategies(self, register: Callable[..., None]) -> None:
                register("same", kvroute.BaseStrategy)

        class B(A):
            pass

        pm = PluginManager(autoload=False)
        pm.register(A(), name="plug-a")
        pm.register(B(), name="plug-b")
        with pytest.raises(PluginLoadError, match=r"registered twice: by plugin 'plug-\w' and by plugin 'plug-\w'"):
            _ = pm.strategies

    def test_failing_hook_is_attributed(self) -> None:
        """An exception inside a registration hook names the plugin and the hook."""

        class Bad:
            @kvroute.hookimpl
            def kvroute_register_backend_kinds(self, register: Callable[..., None]) -> None:
                raise RuntimeError("boom")

        pm = PluginManager(autoload=False)
        pm.register(Bad(), name="bad")
        with pytest.raises(PluginLoadError, match="plugin 'bad' failed in hook kvroute_register_backend_kinds: RuntimeError: boom"):
            _ = pm.backend_kinds

    def test_core_registers_openai_kind_and_no_strategy(self) -> None:
        """The core itself registers the generic openai backend kind and never a strategy."""
        pm = PluginManager(autoload=False)
        assert set(pm.backend_kinds) == {"openai"} and dict(pm.strategies) == {}


class TestThirdPartyDistribution:
    """The tox env pip-installs tests/third_party/kvroute-p2c like any outside plugin."""

    def test_listed_by_cli(self) -> None:
        """`kvroute plugins` lists the third-party strategy with its distribution and version."""
        out = subprocess.run(
            [sys.executable, "-m", "kvroute", "plugins", "--json"], check=True, capture_output=True, text=True
        ).stdout
        rows = {(r["type"], r["name"]): r for r in json.loads(out)}
        assert rows[("strategy", "p2c")]["distribution"] == "kvroute-p2c"
        assert rows[("strategy", "p2c")]["version"] == "0.1.0"
        assert ("strategy", "random") in rows and ("strategy", "least-outstanding") in rows

    def test_routes(self) -> None:
        """The third-party strategy routes requests and spreads them over the fleet."""
        router = Router.create(Fleet([Backend(f"b{i}") for i in range(4)]), "p2c", {"seed": 1})
        held = [router.acquire(RouteRequest.from_text("x")) for _ in range(8)]
        counts = [s.in_flight for s in router.fleet]
        assert sum(counts) == 8 and max(counts) - min(counts) <= 2
        assert {lease.decision.reason for lease in held} == {"p2c"}
        assert all(lease.decision.detail["versus"] != lease.backend.id for lease in held)
