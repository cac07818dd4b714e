"""The strategy template as a user meets it: installed from its folder, found by name, routing; and copyable.

Run in the tox env ``strategy-template``, which pip-installs ``./contrib/strategy-template``
(not editable) next to an editable kvroute.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from importlib import metadata
from pathlib import Path

import pytest

import kvroute

ROOT = Path(__file__).resolve().parents[3]
TEMPLATE = ROOT / "contrib" / "strategy-template"


def run(*args: str, cwd: Path | None = None) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, cwd=cwd, timeout=300).stdout


class TestInstalledTemplate:
    def test_installed_from_a_wheel_not_the_source_tree(self) -> None:
        """The distribution is installed (version 0.1.0) and imported from site-packages, not contrib/."""
        import kvroute_strategy_template

        assert metadata.version("kvroute-strategy-template") == "0.1.0"
        assert TEMPLATE not in Path(kvroute_strategy_template.__file__).resolve().parents

    def test_listed_by_the_cli(self) -> None:
        """`kvroute plugins --json` shows template-rendezvous from kvroute-strategy-template 0.1.0."""
        rows = json.loads(run(sys.executable, "-m", "kvroute", "plugins", "--json"))
        row = next(r for r in rows if (r["type"], r["name"]) == ("strategy", "template-rendezvous"))
        assert (row["distribution"], row["version"]) == ("kvroute-strategy-template", "0.1.0")

    def test_routes_requests(self) -> None:
        """A router built by name routes 300 leases over every backend, and the same prefix sticks."""
        fleet = kvroute.Fleet([kvroute.Backend(f"b{i}") for i in range(3)])
        router = kvroute.Router.create(fleet, "template-rendezvous", {"prefix_length": "1024"})
        homes = Counter()
        for i in range(300):
            with router.route(kvroute.RouteRequest.from_text(f"{i} " * 400)) as lease:
                homes[lease.backend.id] += 1
                assert fleet.get(lease.backend.id).in_flight == 1
        assert set(homes) == {"b0", "b1", "b2"} and all(s.in_flight == 0 for s in fleet)
        sticky = {router.decide(kvroute.RouteRequest.from_text("d" * 1024 + str(i)))[0].backend.id for i in range(10)}
        assert len(sticky) == 1


class TestCopyingTheTemplate:
    @pytest.fixture
    def renamed(self, tmp_path: Path) -> Path:
        """A copy renamed to `sticky` by running the README's own commands."""
        readme = (TEMPLATE / "README.md").read_text()
        section = readme.split("## Make it yours", 1)[1].split("## ", 1)[0]
        block = re.search(r"```console\n(.*?)```", section, re.S)
        assert block is not None, "the README lost its rename commands"
        commands = block.group(1).replace("\\\n", " ").splitlines()
        script = "\n".join(line.removeprefix("$ ") for line in commands if line.startswith("$ "))
        shutil.copytree(
            TEMPLATE, tmp_path / "strategy-template", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
        )
        subprocess.run(["bash", "-euo", "pipefail", "-c", script], check=True, cwd=tmp_path, timeout=60)
        return tmp_path / "kvroute-sticky"

    def test_renamed_copy_installs_and_routes(self, renamed: Path) -> None:
        """After the README's renames no template name is left in code or metadata, and the copy installs as
        `sticky`."""
        leftovers = [
            str(p.relative_to(renamed))
            for p in renamed.rglob("*")
            if p.is_file()
            and p.name != "README.md"
            and re.search(r"strategy[-_]template|template-rendezvous", p.read_text(errors="replace"))
        ]
        assert leftovers == []
        run(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", str(renamed))
        try:
            out = run(
                sys.executable,
                "-c",
                "import kvroute; f = kvroute.Fleet([kvroute.Backend('a'), kvroute.Backend('b')]); "
                "r = kvroute.Router.create(f, 'sticky'); "
                "print(r.decide(kvroute.RouteRequest.from_text('x'))[0].explain())",
            )
            lines = out.splitlines()  # the library logs through `logging`: nothing but the print
            assert len(lines) == 1, lines
            last = lines[0]
            assert last.startswith("sticky -> ") and "(rendezvous" in last
        finally:
            run(sys.executable, "-m", "pip", "uninstall", "--yes", "--quiet", "kvroute-sticky")
