"""The command line as a user meets it: help, wrong flags, plugins listing."""

from __future__ import annotations

import json

from click.testing import CliRunner

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
