"""The plugin manager: entry points, attribution of failures, environment switches."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import kvroute
from kvroute import Backend, Fleet, PluginLoadError, PluginManager, Router, RouteRequest
from kvroute.plugins import BLOCK_ENV, DISABLE_AUTOLOAD_ENV, PLUGINS_ENV, PluginInfo


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
        fake_distribution(
            tmp_path, "kvroute-broken", "9.1", "broken", "kvroute_broken_mod", "raise ImportError('no numpy')"
        )
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
        fake_distribution(
            tmp_path, "kvroute-only", "1.0", "only", "kvroute_only_mod2", GOOD.replace("only-first", "only-2")
        )
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
        with pytest.raises(
            PluginLoadError, match="plugin 'bad' failed in hook kvroute_register_backend_kinds: RuntimeError: boom"
        ):
            _ = pm.backend_kinds

    def test_core_registers_openai_kind_and_no_strategy(self) -> None:
        """The core itself registers the generic openai backend kind and never a strategy."""
        pm = PluginManager(autoload=False)
        assert set(pm.backend_kinds) == {"openai"} and dict(pm.strategies) == {}


class _Greeter:
    """A plugin adding one command that prints its greeting."""

    def __init__(self, command: str, greeting: str) -> None:
        self.command = command
        self.greeting = greeting

    @kvroute.hookimpl
    def kvroute_register_commands(self, cli: click.Group) -> None:
        @cli.command(self.command)
        def greet() -> None:
            click.echo(self.greeting)


class TestRegisterCommands:
    def test_commands_are_added_and_attributed(self) -> None:
        """Each plugin's commands land in the group, and register_commands says which plugin added which."""
        pm = PluginManager(autoload=False)
        pm.register(_Greeter("hello", "hi"), name="plug-a")
        pm.register(_Greeter("bye", "ciao"), name="plug-b")
        group = click.Group("kvroute")
        assert pm.register_commands(group) == {"hello": PluginInfo("plug-a"), "bye": PluginInfo("plug-b")}
        assert CliRunner().invoke(group, ["hello"]).output == "hi\n"
        assert CliRunner().invoke(group, ["bye"]).output == "ciao\n"

    def test_duplicate_command_names_both(self) -> None:
        """Two plugins adding the same command name is a PluginLoadError naming both and the way out."""
        pm = PluginManager(autoload=False)
        pm.register(_Greeter("hello", "hi"), name="plug-a")
        pm.register(_Greeter("hello", "hey"), name="plug-b")
        with pytest.raises(PluginLoadError) as info:
            pm.register_commands(click.Group("kvroute"))
        assert re.fullmatch(
            r"command 'hello' is registered twice: by plugin 'plug-(a|b)' and by plugin 'plug-(a|b)'; "
            r"block one with KVROUTE_BLOCK_PLUGINS\.",
            str(info.value),
        ), info.value
        assert "'plug-a'" in str(info.value) and "'plug-b'" in str(info.value)

    def test_command_already_in_the_group_is_not_replaced(self) -> None:
        """A plugin adding a command the group already holds is refused, naming kvroute itself."""
        pm = PluginManager(autoload=False)
        pm.register(_Greeter("plugins", "mine"), name="squat")
        group = click.Group("kvroute")
        own = click.Command("plugins")
        group.add_command(own)
        with pytest.raises(
            PluginLoadError, match=r"^command 'plugins' is registered twice: by kvroute itself and by plugin 'squat'"
        ):
            pm.register_commands(group)

    def test_failing_command_hook_is_attributed(self) -> None:
        """An exception inside kvroute_register_commands names the plugin, the hook and the error, with the error as
        cause."""

        class Bad:
            @kvroute.hookimpl
            def kvroute_register_commands(self, cli: click.Group) -> None:
                raise RuntimeError("boom")

        pm = PluginManager(autoload=False)
        pm.register(Bad(), name="bad")
        with pytest.raises(PluginLoadError) as info:
            pm.register_commands(click.Group("kvroute"))
        assert str(info.value) == "plugin 'bad' failed in hook kvroute_register_commands: RuntimeError: boom"
        assert isinstance(info.value.__cause__, RuntimeError)

    def test_entry_point_plugin_names_its_distribution(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A command hook failing in an installed plugin names its distribution and version too."""
        source = "import kvroute\n\n@kvroute.hookimpl\ndef kvroute_register_commands(cli):\n    raise KeyError('cli')\n"
        fake_distribution(tmp_path, "kvroute-cmd-broken", "4.2", "cmd-broken", "kvroute_cmd_broken_mod", source)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
        monkeypatch.setenv(PLUGINS_ENV, "cmd-broken")
        with pytest.raises(PluginLoadError) as info:
            PluginManager().register_commands(click.Group("kvroute"))
        assert str(info.value) == (
            "plugin 'cmd-broken' (distribution kvroute-cmd-broken 4.2) failed in hook kvroute_register_commands: "
            "KeyError: 'cli'"
        )


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

    def test_adds_a_command(self) -> None:
        """The third-party plugin's `kvroute p2c-info` is listed, attributed to its distribution, and runs from the real
        script."""
        added = PluginManager().register_commands(click.Group("kvroute"))
        assert (added["p2c-info"].distribution, added["p2c-info"].version) == ("kvroute-p2c", "0.1.0")
        listing = subprocess.run(
            [sys.executable, "-m", "kvroute", "--help"], check=True, capture_output=True, text=True
        ).stdout
        assert re.search(r"^  p2c-info +Say what the p2c strategy does", listing, re.MULTILINE), listing
        run = subprocess.run([sys.executable, "-m", "kvroute", "p2c-info"], capture_output=True, text=True, check=False)
        assert (run.returncode, run.stderr) == (0, "")
        assert run.stdout.startswith("p2c: sample two backends")

    def test_installed_from_a_wheel(self) -> None:
        """kvroute-p2c is installed as a built distribution (not editable), so its entry points come from real package
        metadata."""
        distribution = metadata.distribution("kvroute-p2c")
        direct_url = json.loads(distribution.read_text("direct_url.json") or "{}")
        assert not direct_url.get("dir_info", {}).get("editable", False), direct_url
        import kvroute_p2c

        assert Path(kvroute_p2c.__file__).resolve().is_relative_to(Path(str(distribution.locate_file(""))).resolve())
        assert "tests/third_party" not in Path(kvroute_p2c.__file__).as_posix()
