"""The command line's log rendering: `kvroute.logs.stamp_utc`, `render_json` and `configure_logging`'s output."""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from kvroute.cli import configure_logging
from kvroute.logs import render_json, stamp_utc


def _parse_stamp(text: str) -> float:
    assert text.endswith("Z"), text
    return datetime.datetime.fromisoformat(text[:-1] + "+00:00").timestamp()


class TestStampUtc:
    def test_iso_utc_with_microseconds(self) -> None:
        """The timestamp is ISO 8601 UTC with six digits of microseconds and a trailing Z, read from the clock."""
        before = time.time()
        stamp = stamp_utc(None, "info", {})["timestamp"]
        after = time.time()
        assert len(stamp) == len("2026-12-01T21:35:03.420457Z")
        assert before - 1e-6 <= _parse_stamp(stamp) <= after + 1e-6

    def test_matches_structlog_stamper(self) -> None:
        """Apart from the microseconds, the text is structlog's own ISO UTC timestamp's (same second)."""
        for _ in range(3):  # a second may tick over between the two calls: retry
            ours = stamp_utc(None, "info", {})["timestamp"]
            theirs = structlog.processors.TimeStamper(fmt="iso", utc=True)(None, "info", {})["timestamp"]
            if ours[:19] == theirs[:19]:
                break
        assert ours[:19] == theirs[:19]
        assert abs(_parse_stamp(ours) - _parse_stamp(theirs)) < 1.0

    def test_second_changes(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The cached second is replaced when the clock moves to another second."""
        now = [1_796_160_000.25]
        monkeypatch.setattr(time, "time", lambda: now[0])
        assert stamp_utc(None, "info", {})["timestamp"] == "2026-12-01T21:20:00.250000Z"
        now[0] = 1_796_160_061.5
        assert stamp_utc(None, "info", {})["timestamp"] == "2026-12-01T21:21:01.500000Z"


class _Custom:
    def __repr__(self) -> str:
        return "<custom>"


class _Structlogged:
    def __structlog__(self) -> dict[str, int]:
        return {"as": 1}


class TestRenderJson:
    def test_same_content_and_key_order(self) -> None:
        """The line parses back to the event, keys in the event's order, one line with no newline."""
        event = {"event": "request", "status": 200, "ok": True, "none": None, "ttft_s": 0.001234, "text": "é<|"}
        line = render_json(None, "info", dict(event))
        assert "\n" not in line
        assert json.loads(line) == event
        assert list(json.loads(line)) == list(event)

    def test_unknown_types_become_repr_or_structlog_form(self) -> None:
        """A value JSON has no type for renders as its ``__structlog__()`` or its repr, as structlog's renderer does."""
        line = render_json(None, "info", {"a": _Custom(), "b": _Structlogged()})
        assert json.loads(line) == {"a": "<custom>", "b": {"as": 1}}

    def test_what_orjson_refuses_still_renders(self) -> None:
        """An integer beyond 64 bits and a non-string key still give a line (the standard library's)."""
        assert json.loads(render_json(None, "info", {"big": 2**70})) == {"big": 2**70}
        assert json.loads(render_json(None, "info", {"map": {1: "x"}})) == {"map": {"1": "x"}}


@pytest.fixture
def stderr(capsys: pytest.CaptureFixture[str]) -> Iterator[pytest.CaptureFixture[str]]:
    """pytest's captured stderr, which `configure_logging` writes to; structlog's settings restored after."""
    saved_config = structlog.get_config()
    try:
        yield capsys
    finally:
        structlog.configure(**saved_config)


class TestConfigureLogging:
    def _log(self, **fields: Any) -> None:
        structlog.get_logger("test.access").info("request", **fields)

    def test_json_line_per_event(self, stderr: pytest.CaptureFixture[str]) -> None:
        """With ``json``, every event is one JSON line with its fields, level and timestamp, in order."""
        configure_logging("info", "json")
        self._log(status=200, n=1)
        self._log(status=502, n=2)
        structlog.get_logger("test.access").debug("hidden")
        lines = stderr.readouterr().err.splitlines()
        assert len(lines) == 2
        first, second = (json.loads(line) for line in lines)
        assert {k: first[k] for k in ("event", "status", "n", "level")} == {
            "event": "request",
            "status": 200,
            "n": 1,
            "level": "info",
        }
        assert second["n"] == 2
        assert abs(_parse_stamp(first["timestamp"]) - time.time()) < 60

    def test_console_line_per_event(self, stderr: pytest.CaptureFixture[str]) -> None:
        """With ``console``, every event is one line: timestamp, level, event, then sorted key=value pairs."""
        configure_logging("info", "console")
        self._log(status=200, backend="e1")
        (line,) = stderr.readouterr().err.splitlines()
        stamp, rest = line.split(" ", 1)
        _parse_stamp(stamp)
        assert rest.startswith("[info     ] request")
        assert rest.endswith("backend=e1 status=200")
