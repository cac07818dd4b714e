"""The README's `kvroute simulate` table, and docs/simulation.md's calibration table, are what a fresh default run
prints.

Wall-clock columns (routing cost, run time) are left out. When a change moves a figure, rerun
`kvroute simulate` and copy what it prints.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.plugins import PluginManager

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SIMULATION_DOC = ROOT / "docs" / "simulation.md"

_MS = r"[\d,]+ ms(?: \([+-]\d+%\))?"
_ROW = re.compile(
    rf"^(?P<strategy>[a-z0-9-]+)\s+(?P<p50>{_MS})\s+(?P<p90>{_MS})\s+(?P<p99>{_MS})"
    r"\s+(?P<hit>[\d.]+%(?: \([+-][\d.]+ pt\))?)\s+(?P<share>[\d.]+% / [\d.]+%)\s+(?P<spills>\d+)\s+\S.*$"
)
#: The compared figures; the routing cost (µs, wall clock) and the wall time are left out.
FIGURES = ("p50", "p90", "p99", "hit", "share", "spills")


def readme_block() -> list[str]:
    """Return the lines of the README's code block that shows the default `kvroute simulate` output."""
    blocks = re.findall(r"^```\n(kvroute simulate: .*?)^```$", README.read_text(encoding="utf-8"), flags=re.M | re.S)
    assert len(blocks) == 1, "README.md must hold one code block starting with 'kvroute simulate: '"
    return blocks[0].splitlines()


def readme_rows(block: list[str]) -> dict[str, dict[str, str]]:
    rows = {}
    for line in block[2:]:
        match = _ROW.match(line)
        if match is not None:
            rows[match["strategy"]] = {k: match[k] for k in FIGURES}
    return rows


def printed_rows(output: str) -> dict[str, dict[str, str]]:
    """Parse the rows of the rich table `kvroute simulate` printed."""
    rows = {}
    for line in output.splitlines():
        if not line.startswith("│"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
        strategy, p50, p90, p99, hit, throughput, share, spills, _routing = cells
        rows[strategy] = dict(zip(FIGURES, (p50, p90, p99, hit, share, spills), strict=True))
        rows[strategy]["throughput"] = throughput.split(" (")[0]
    return rows


#: docs/simulation.md's calibration table columns (its percents have a space: "79.9 %").
DOC_FIGURES = ("p50", "p90", "p99", "hit", "throughput", "spills")


def doc_rows() -> dict[str, dict[str, str]]:
    """Parse the calibration table of docs/simulation.md (the one under "Calibration against the seed")."""
    text = SIMULATION_DOC.read_text(encoding="utf-8")
    section = text[text.index("## Calibration against the seed") :]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) != 7 or cells[0] in ("strategy", "---"):
            continue
        rows[cells[0]] = {k: v.replace(" %", "%") for k, v in zip(DOC_FIGURES, cells[1:], strict=True)}
    return rows


@pytest.fixture(scope="module")
def block() -> list[str]:
    return readme_block()


@pytest.fixture(scope="module")
def fresh_run(block: list[str]) -> str:
    """Run `kvroute simulate` on its defaults with the documented strategies that are installed here."""
    installed = PluginManager().strategies
    names = [name for name in {**readme_rows(block), **doc_rows()} if name in installed]
    assert {"random", "consistent-hash"} <= set(names), "the README table must show random and consistent-hash"
    result = CliRunner().invoke(main, ["simulate", "-s", ",".join(names), "--no-progress"])
    assert result.exit_code == 0, result.output
    return result.output


class TestReadmeSimulateTable:
    def test_the_block_parses(self, block: list[str]) -> None:
        """Every line between the title and the caption is a strategy row this test can read."""
        rows = [line for line in block[2:] if not line.startswith(("upper bound", "changes are"))]
        assert len(readme_rows(block)) == len(rows) >= 3

    def test_title_is_the_default_scenario(self, block: list[str], fresh_run: str) -> None:
        """The block's first line is the printed title without its wall time."""
        printed = next(line.strip() for line in fresh_run.splitlines() if "kvroute simulate:" in line)
        assert re.sub(r" \([\d.]+ s\)$", "", printed) == block[0]

    def test_upper_bound_line_matches_a_fresh_run(self, block: list[str], fresh_run: str) -> None:
        """The upper-bound line is the one a fresh run prints."""
        printed = [line.strip() for line in fresh_run.splitlines() if line.startswith("upper bound")]
        written = [line for line in block if line.startswith("upper bound")]
        assert written == printed and len(printed) == 1

    def test_figures_match_a_fresh_run(self, block: list[str], fresh_run: str) -> None:
        """TTFT p50/p90/p99, hit rate, shares and spills of every README row installed here are what a run prints."""
        printed = printed_rows(fresh_run)
        written = {name: row for name, row in readme_rows(block).items() if name in printed}
        assert written == {name: {k: printed[name][k] for k in FIGURES} for name in written}


class TestSimulationDocCalibrationTable:
    def test_the_table_parses(self) -> None:
        """The calibration table has a row per strategy, random first."""
        rows = doc_rows()
        assert next(iter(rows)) == "random" and len(rows) >= 3

    def test_figures_match_a_fresh_run(self, fresh_run: str) -> None:
        """TTFT p50/p90/p99, hit rate, output throughput and spills of every row installed here are what a run
        prints."""
        printed = printed_rows(fresh_run)
        written = {name: row for name, row in doc_rows().items() if name in printed}
        hit = {name: {**row, "hit": row["hit"].split(" (")[0]} for name, row in printed.items()}
        assert written == {name: {k: hit[name][k] for k in DOC_FIGURES} for name in written}

    def test_upper_bound_matches_a_fresh_run(self, fresh_run: str) -> None:
        """The calibration section's upper bound is the printed one."""
        printed = next(line for line in fresh_run.splitlines() if line.startswith("upper bound"))
        bound = printed.strip().rsplit(" ", 1)[1]
        text = SIMULATION_DOC.read_text(encoding="utf-8")
        section = text[text.index("## Calibration against the seed") :]
        assert f"Upper bound: {bound.replace('%', ' %')}." in section
