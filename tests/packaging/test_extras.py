"""Extras resolve to the plugin distributions: run in the tox env `packaging`.

That env runs `pip install "./core[least-outstanding]" ./plugins/least-outstanding` (not
editable) into a fresh virtualenv, as a user would from a checkout. So it is also the one
place where the library is installed without its applications (kvroute-server,
kvroute-simulator) for real: what that user gets is pinned here.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.helpers import help_commands as _commands

#: What the applications bring and the library must not: their packages and their dependencies.
APPLICATION_MODULES = (
    "uvicorn",
    "aiohttp",
    "prometheus_client",
    "matplotlib",
    "rich",
    "kvroute_server",
    "kvroute_simulator",
)


def _kvroute(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the ``kvroute`` console script pip installed next to this interpreter (only where the applications are
    absent)."""
    if importlib.util.find_spec("kvroute_server") or importlib.util.find_spec("kvroute_simulator"):
        pytest.fail(
            "this environment has the applications (`kvroute serve` would start the proxy): run `tox -e packaging`"
        )
    script = shutil.which("kvroute", path=str(Path(sys.executable).parent))
    assert script is not None, f"no kvroute script next to {sys.executable}"
    return subprocess.run([script, *args], capture_output=True, text=True, timeout=120, check=False)


class TestExtras:
    def test_extra_installed_the_local_plugin(self) -> None:
        """The least-outstanding extra pulled in kvroute-least-outstanding at the core's pinned version."""
        requires = metadata.requires("kvroute") or []
        assert any(
            r.replace(" ", "").startswith("kvroute-least-outstanding==0.1.0;")
            and "least-outstanding" in r.split(";")[1]
            for r in requires
        ), requires
        assert metadata.version("kvroute-least-outstanding") == "0.1.0"

    def test_other_plugins_not_installed(self) -> None:
        """Only the plugin whose extra was asked for is installed."""
        with pytest.raises(metadata.PackageNotFoundError):
            metadata.version("kvroute-random")

    def test_cli_lists_only_that_strategy(self) -> None:
        """`kvroute plugins` shows exactly the strategy the extra installed."""
        out = subprocess.run(
            [sys.executable, "-m", "kvroute", "plugins", "--json"], check=True, capture_output=True, text=True
        ).stdout
        strategies = {r["name"] for r in json.loads(out) if r["type"] == "strategy"}
        assert strategies == {"least-outstanding"}

    def test_every_plugin_has_an_extra(self) -> None:
        """Each strategy distribution in plugins/ has its extra, and `all` lists every one of them."""
        import tomllib
        from pathlib import Path

        root = Path(__file__).resolve().parents[2]
        core = tomllib.loads((root / "core" / "pyproject.toml").read_text())
        extras = core["project"]["optional-dependencies"]
        for folder in sorted((root / "plugins").iterdir()):
            name = tomllib.loads((folder / "pyproject.toml").read_text())["project"]["name"]
            extra = folder.name
            assert any(req.startswith(name) for req in extras.get(extra, [])), f"no extra {extra!r} for {name}"
            assert any(req.startswith(name) for req in extras["all"]), f"{name} missing from the 'all' extra"


class TestLibraryAlone:
    """`pip install "kvroute[least-outstanding]"` gives the library and its command, not the applications."""

    def test_installed_from_a_build_not_the_checkout(self) -> None:
        """kvroute is imported from the environment's site-packages, so what follows tests the built distribution."""
        import kvroute

        assert "core/src" not in Path(kvroute.__file__).as_posix(), kvroute.__file__
        assert (
            not json.loads(metadata.distribution("kvroute").read_text("direct_url.json") or "{}")
            .get("dir_info", {})
            .get("editable")
        )

    @pytest.mark.parametrize("module", APPLICATION_MODULES)
    def test_application_dependency_not_installed(self, module: str) -> None:
        """The library's own requirements do not pull in what only the proxy and the simulator need."""
        assert importlib.util.find_spec(module) is None, f"{module} was installed with kvroute[least-outstanding]"

    def test_import_pulls_no_application_module(self) -> None:
        """`import kvroute` in a fresh interpreter imports none of the applications' packages or dependencies."""
        code = (
            "import sys, kvroute\n"
            f"print(sorted(m for m in sys.modules if m.partition('.')[0] in {APPLICATION_MODULES!r}))"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert result.stdout == "[]\n" and result.stderr == ""

    def test_help_lists_applications_as_needing_an_extra(self) -> None:
        """`kvroute --help` lists serve, check-parity, simulate and emulate, each marked with the pip command that
        brings it."""
        result = _kvroute("--help")
        assert (result.returncode, result.stderr) == (0, ""), result.stderr
        commands = _commands(result.stdout)
        assert sorted(commands) == ["check-parity", "emulate", "plugins", "serve", "simulate"]
        for name, extra in (
            ("serve", "server"),
            ("check-parity", "server"),
            ("simulate", "simulator"),
            ("emulate", "emulator"),
        ):
            assert commands[name].endswith(f'[needs: pip install "kvroute[{extra}]"]'), (name, commands[name])
        assert "needs:" not in commands["plugins"]

    @pytest.mark.parametrize(
        ("args", "distribution", "extra"),
        [
            (["serve"], "kvroute-server", "server"),
            (["serve", "--help"], "kvroute-server", "server"),
            (["serve", "--backend", "http://127.0.0.1:9", "--no-such-flag"], "kvroute-server", "server"),
            (["check-parity", "-h"], "kvroute-server", "server"),
            (["simulate", "--help"], "kvroute-simulator", "simulator"),
            (["emulate", "--no-such-flag", "0"], "kvroute-simulator", "emulator"),
        ],
    )
    def test_application_command_prints_the_install_hint(self, args: list[str], distribution: str, extra: str) -> None:
        """An application's command exits 1 with one line naming its distribution and the pip command; no traceback."""
        result = _kvroute(*args)
        assert (result.returncode, result.stdout) == (1, "")
        assert result.stderr == (
            f"Error: 'kvroute {args[0]}' comes with the {distribution} distribution, which is not installed. "
            f'Install it with: pip install "kvroute[{extra}]"\n'
        )
