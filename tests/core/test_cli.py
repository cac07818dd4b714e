"""The command line as a user meets it: help, wrong flags, plugins listing, commands whose extra is missing."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvroute import cli
from kvroute.cli import main


class TestCli:
    def test_help_lists_commands(self) -> None:
        """`kvroute --help` lists the plugins command with examples."""
        result = CliRunner().invoke(main, ["--help"])
        assert result.exit_code == 0
        assert "plugins" in result.output and "Examples:" in result.output

    def test_unknown_command(self) -> None:
        """A wrong command exits 2 with click's usage error, not a traceback."""
        result = CliRunner().invoke(main, ["nonsense"])
        assert result.exit_code == 2 and "No such command 'nonsense'" in result.output

    def test_wrong_flag(self) -> None:
        """A wrong flag exits 2 and names the flag."""
        result = CliRunner().invoke(main, ["plugins", "--bogus"])
        assert result.exit_code == 2 and "--bogus" in result.output and "No such option" in result.output

    def test_plugins_table_and_json(self) -> None:
        """`kvroute plugins` prints a table; --json the same rows as JSON."""
        table = CliRunner().invoke(main, ["plugins"])
        assert table.exit_code == 0 and "least-outstanding" in table.output and "openai" in table.output
        rows = json.loads(CliRunner().invoke(main, ["plugins", "--json"]).output)
        openai = [r for r in rows if (r["type"], r["name"]) == ("backend kind", "openai")]
        assert len(openai) == 1 and openai[0]["distribution"] == "kvroute"

    def test_version(self) -> None:
        """`kvroute --version` prints the version."""
        result = CliRunner().invoke(main, ["--version"])
        assert result.exit_code == 0 and "kvroute, version" in result.output


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class TestLazyCommands:
    def test_every_command_is_listed(self) -> None:
        """`kvroute --help` lists every command of the table and `plugins`, installed extras or not."""
        result = CliRunner().invoke(main, ["--help"])
        assert result.exit_code == 0
        listed = {line.split()[0] for line in result.output.partition("Commands:")[2].splitlines() if line.startswith("  ") and not line.startswith("   ")}
        assert listed == {*cli._LAZY_COMMANDS, "plugins"}

    def test_table_names_match_the_commands(self) -> None:
        """Each table entry whose dependencies are here imports a click command of the same name (the others get a stand-in)."""
        for name, spec in cli._LAZY_COMMANDS.items():
            command = main.get_command(click.Context(main), name)
            assert command is not None and command.name == name
            if spec.missing_module() is None:
                module, _, attr = spec.target.partition(":")
                assert command is getattr(importlib.import_module(module), attr)
            else:
                result = CliRunner().invoke(main, [name])
                assert result.exit_code == 1 and f'pip install "kvroute[{spec.extra}]"' in result.stderr

    def test_needed_modules_come_from_the_extra(self) -> None:
        """Every module a command checks for is a requirement of the extra its hint tells users to install."""
        requires = metadata.requires("kvroute") or []
        for name, spec in cli._LAZY_COMMANDS.items():
            if spec.extra is None:
                assert spec.needs == (), name
                continue
            in_extra = {
                _canonical(re.match(r"[A-Za-z0-9._-]+", req).group())  # type: ignore[union-attr]
                for req in requires
                if re.search(rf"extra\s*==\s*['\"]{re.escape(spec.extra)}['\"]", req)
            }
            assert spec.needs and {_canonical(m) for m in spec.needs} <= in_extra, (name, spec.needs, in_extra)

    def test_missing_dependency_gives_install_hint(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A command whose needed module is absent is listed with its pip command and, whatever its arguments, exits 1 with the hint."""
        spec = cli._LazyCommand("kvroute.cli:main", "Do a thing.", "thing", ("kvroute_test_absent_dependency",), "the thing's dependencies")
        monkeypatch.setitem(cli._LAZY_COMMANDS, "thing", spec)
        listing = CliRunner().invoke(main, ["--help"])
        assert re.search(r'^  thing +Do a thing\. \[needs: pip install "kvroute\[thing\]"\]$', listing.output, re.MULTILINE), listing.output
        for args in ([], ["--help"], ["--no-such-flag", "value"]):
            result = CliRunner().invoke(main, ["thing", *args])
            assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
            assert result.stderr == (
                "Error: 'kvroute thing' needs the thing's dependencies (missing module 'kvroute_test_absent_dependency'). "
                'Install them with: pip install "kvroute[thing]"\n'
            )

    def test_undeclared_missing_import_gives_install_hint(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        """A command module that fails on a third-party import its entry does not list still gets the hint naming that module."""
        (tmp_path / "kvroute_test_command_module.py").write_text("import kvroute_test_absent_dependency\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        spec = cli._LazyCommand("kvroute_test_command_module:command", "Do a thing.", "thing", (), "the thing's dependencies")
        monkeypatch.setitem(cli._LAZY_COMMANDS, "thing", spec)
        result = CliRunner().invoke(main, ["thing"])
        assert result.exit_code == 1
        assert "(missing module 'kvroute_test_absent_dependency'). Install them with: pip install \"kvroute[thing]\"" in result.stderr

    def test_missing_kvroute_module_is_not_hidden(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A module of kvroute itself that is missing is a broken installation: the error surfaces instead of an install hint."""
        monkeypatch.setitem(cli._LAZY_COMMANDS, "thing", cli._LazyCommand("kvroute._no_such_module:command", "Do a thing.", "thing"))
        result = CliRunner().invoke(main, ["thing"])
        assert isinstance(result.exception, ModuleNotFoundError) and result.exception.name == "kvroute._no_such_module"

    def test_close_command_name_is_suggested(self) -> None:
        """A mistyped command exits 2 and suggests the closest one."""
        result = CliRunner().invoke(main, ["simulat"])
        assert result.exit_code == 2 and "No such command 'simulat'. Did you mean 'simulate'?" in result.stderr

    def test_help_imports_no_command_module(self) -> None:
        """`kvroute --help` lists the commands without importing the proxy, the emulator, the parity check or the simulator."""
        code = (
            "import sys\n"
            "from kvroute.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print([m for m in ('kvroute_server', 'kvroute_simulator.emulator', 'kvroute_server.parity', 'kvroute_simulator') if m in sys.modules], file=sys.stderr)\n"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert result.stderr == "[]\n" and "serve" in result.stdout
