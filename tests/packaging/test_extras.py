"""Extras resolve to the plugin distributions: run in the tox env `packaging`.

That env runs `pip install "./core[least-outstanding]" ./plugins/least-outstanding` (not
editable) into a fresh virtualenv, as a user would from a checkout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest


class TestExtras:
    def test_extra_installed_the_local_plugin(self) -> None:
        """The least-outstanding extra pulled in kvroute-least-outstanding at the core's pinned version."""
        requires = metadata.requires("kvroute") or []
        assert any(
            r.replace(" ", "").startswith("kvroute-least-outstanding==0.1.0;") and "least-outstanding" in r.split(";")[1]
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
