"""The settings corpus: ``kvroute serve --check`` and ``kvroute simulate`` behave as the reference code did.

``fixtures/settings_corpus/corpus.json`` holds each invocation with what the reference install printed
and its exit code (``make_corpus.py`` records it; ``cases.py`` lists the cases); the help of both
commands is stored beside it. Here every case runs again in-process and must match: the same exit
code, the same error lines, the same effective configuration.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import structlog
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.session_ids import DEFAULT_SESSION_SOURCES

#: The outlier detector's settings (docs/serve.md, "Gray failures") and their defaults, added as one table.
OUTLIERS_DEFAULTS: dict[str, Any] = {
    "enabled": True,
    "consecutive_errors": 5,
    "consecutive_deadlines": 3,
    "success_rate_ratio": 0.8,
    "latency_factor": 4.0,
    "min_requests": 20,
    "window": 30.0,
    "base_ejection": 10.0,
    "max_ejection": 300.0,
    "max_ejected_share": 0.6,
}
CORPUS = Path(__file__).parent / "fixtures" / "settings_corpus"
CASES: list[dict[str, Any]] = json.loads((CORPUS / "corpus.json").read_text(encoding="utf-8"))
#: Settings added since the corpus was recorded, with their defaults: the only keys ``--check`` may add.
ADDED: dict[str, Any] = {
    "http": "kvroute",
    "outliers": OUTLIERS_DEFAULTS,
    "sessions": {
        "enabled": True,
        "sources": [str(source) for source in DEFAULT_SESSION_SOURCES],
        "ttl": 300.0,
        "max_sessions": 100000,
        "conversations": True,
        "agree": "auto",
    },
    "slo": {
        "ttft_ms": None,
        "tpot_ms": None,
        "priority": "standard",
        "aware": False,
        "unmet": "home",
        "tpot_weight": 50.0,
        "prefill_rate": 10000.0,
        "decode_step": 0.02,
        "ttft_overhead": 0.02,
        "decode_load_weight": 0.02,
        "seats": None,
        "models": {},
    },
    "admission": {
        "mode": "off",
        "queue_size": 256,
        "order": "deadline",
        "max_wait": 30.0,
        "critical": "auto",
        "standard": "auto",
        "sheddable": "auto",
    },
    "tracing": {"endpoint": None, "protocol": None, "sample_ratio": None, "service_name": None, "max_queue": 2048},
    "peers": {
        "urls": [],
        "discovery": [],
        "token": None,
        "interval": 0.05,
        "batch": 1024,
        "queue": 16384,
        "timeout": 1.0,
    },
}
#: Keys of nested tables added since, with their defaults: ``{table: {key: default}}``.
ADDED_NESTED: dict[str, dict[str, Any]] = {"timeouts": {"deadline_floor": 5.0, "deadline_factor": 4.0}}
#: Options added since the help was recorded.
ADDED_OPTIONS: dict[str, set[str]] = {
    "serve": {
        "--http",
        "--sessions",
        "--session-sources",
        "--session-ttl",
        "--max-sessions",
        "--session-conversations",
        "--session-agree",
        "--first-byte-deadline-floor",
        "--first-byte-deadline-factor",
        *(f"--outlier-{name}" for name in ("detection", "consecutive-errors", "consecutive-deadlines")),
        *(f"--outlier-{name}" for name in ("success-rate-ratio", "latency-factor", "min-requests", "window")),
        *(f"--outlier-{name}" for name in ("base-ejection", "max-ejection", "max-ejected-share")),
        *(
            f"--slo-{name}"
            for name in ("ttft-ms", "tpot-ms", "priority", "aware", "unmet", "prefill-rate", "decode-step", "seats")
        ),
        "--admission",
        *(f"--admission-{name}" for name in ("queue-size", "order", "max-wait", "critical", "standard", "sheddable")),
        "--otlp-endpoint",
        "--otlp-protocol",
        "--trace-sample-ratio",
        *(f"--peer{name}" for name in ("", "-discovery", "-token", "-interval", "-batch", "-queue", "-timeout")),
    },
    # "-j," is how the first word of "-j, --jobs N" reads.
    "simulate": {"--sessions", "--ray", "-j,", "--slo", "--load"},
}


def _without_logs(text: str) -> list[str]:
    """The lines of ``text`` that are not structured log events (those carry timestamps)."""
    lines = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if not (isinstance(event, dict) and "event" in event):
            lines.append(line)
    return lines


#: Strategy options added since the corpus was recorded (the consistent-hash family's share bound).
ADDED_STRATEGY_OPTIONS = {
    "share_factor",
    "share_window",
    "share_keys",
    "share_choices",
    "key_factor",
    "share_conversations",
}


def _without_added(lines: list[str]) -> list[str]:
    """``lines`` with the added settings taken out of "expected some of: ..." lists of known keys, and the added
    strategy options out of a strategy's "has no option ... (expected one of: ...)" list."""
    out = []
    for line in lines:
        head, sep, known = line.partition("(expected one of: ")
        if sep and "has no option" in head:
            names, _, tail = known.partition(")")
            kept = [name for name in names.split(", ") if name not in ADDED_STRATEGY_OPTIONS]
            line = f"{head}{sep}{', '.join(kept)}){tail}"
        head, sep, known = line.partition("(expected some of: ")
        if sep:
            names, _, tail = known.partition(")")
            nested = {key for added in ADDED_NESTED.values() for key in added}
            kept = [name for name in names.split(", ") if name not in ADDED and name not in nested]
            line = f"{head}{sep}{', '.join(kept)}){tail}"
        out.append(line)
    return out


def _run(case: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    for name, text in case["files"].items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVROUTE_ADMIN_TOKEN", raising=False)
    # The commands configure structlog for the process. With loggers cached on first use, that would outlive the
    # test and blind every later test's capture_logs (tests/server/test_warm_join.py reads the proxy's events).
    saved = structlog.get_config()
    configure = structlog.configure
    monkeypatch.setattr(structlog, "configure", lambda **kw: configure(**{**kw, "cache_logger_on_first_use": False}))
    try:
        return CliRunner().invoke(main, [case["command"], *case["args"]], terminal_width=80, prog_name="kvroute")
    finally:
        configure(**saved)


def _options(help_text: str) -> dict[str, str]:
    """The help's options, each with its help text on one line; ``[default: 5.0]`` is read as ``[default: 5]``."""
    entries: dict[str, list[str]] = {}
    current: list[str] = []
    for line in help_text.split("Options:", 1)[1].splitlines():
        if re.match(r"^  -", line):
            decl, _, text = line.strip().partition("  ")
            current = entries.setdefault(decl.strip(), [])
            current.append(text.strip())
        elif line.strip():
            if len(line) - len(line.lstrip()) < 10:
                break  # the epilog (examples) after the options: not any option's help
            current.append(line.strip())
    out = {}
    for decl, parts in entries.items():
        if parts == ["Show this message and exit."]:
            continue  # click caches a command's help option with the names of the first context that built it
        text = re.sub(r"(\w)- (\w)", r"\1-\2", re.sub(r"\s+", " ", " ".join(parts)).strip())
        text = re.sub(r"\[default: (\d+(?:\.\d+)?)\]", lambda m: f"[default: {float(m[1]):g}]", text)
        out[decl.split()[0]] = text
    return out


class TestSettingsCorpus:
    @pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
    def test_same_behaviour(self, case: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The invocation exits with the recorded code, prints the recorded errors and the recorded configuration."""
        result = _run(case, tmp_path, monkeypatch)
        errors = _without_added(_without_logs(result.stderr))
        assert (result.exit_code, errors) == (case["exit_code"], _without_logs(case["stderr"]))
        if case["command"] == "serve" and case["exit_code"] == 0:
            shown = json.loads(result.stdout)
            assert {key: shown.pop(key) for key in ADDED} == ADDED
            for table, added in ADDED_NESTED.items():
                assert {key: shown[table].pop(key) for key in added} == added
            assert shown == json.loads(case["stdout"])
        else:
            assert _without_logs(result.stdout) == _without_logs(case["stdout"])

    @pytest.mark.parametrize("command", ["serve", "simulate"])
    def test_same_help(self, command: str) -> None:
        """Each option of the recorded help is still there with the same help text (numbers in defaults as %g)."""
        result = CliRunner().invoke(main, [command, "--help"], terminal_width=80, prog_name="kvroute")
        recorded = _options((CORPUS / f"{command}-help.txt").read_text(encoding="utf-8"))
        now = _options(result.stdout)
        assert set(now) - set(recorded) == ADDED_OPTIONS[command]
        assert {name: now[name] for name in recorded} == recorded
