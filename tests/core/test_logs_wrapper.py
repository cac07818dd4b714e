"""`kvroute.logs.filtering_bound_logger`: structlog's filtering bound logger, leaner per event, same output."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import pytest
import structlog

from kvroute.cli import configure_logging
from kvroute.logs import filtering_bound_logger, stamp_utc

#: The access line's fields as the proxy passes them (kvroute_server.proxy.app._access_line).
ACCESS = {
    "request_id": "5f0c6a1e9b7d4c2a8e3f1b0d6c9a7e21",
    "model": "m",
    "strategy": "bounded-load",
    "backend": "e1",
    "reason": "hash",
    "key": "9c1f0e6d2b3a4857",
    "spilled": False,
    "status": 200,
    "outcome": "ok",
    "attempts": 1,
    "stream": False,
    "ttft_s": None,
    "duration_s": 0.003101,
    "error": None,
}


def add_worker(logger: Any, name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """The processor ``kvroute serve --workers N`` puts first (kvroute_server.ops.workers)."""
    event.setdefault("worker", 1)
    return event


def every_kind_of_call(log: Any) -> list[Any]:
    """Log one event of each shape a caller can make; what each call returned."""
    results = [
        log.info("request", **ACCESS),
        log.bind(a=1, b=2).info("bound", b=3, c=4),
        log.warning("warned", n=1),
        log.warn("alias", n=2),
        log.msg("msg alias"),
        log.error("failed %s of %d", "x", 3),
        log.info("named %(who)s", {"who": "me"}),
        log.critical("critical"),
        log.fatal("fatal"),
        log.debug("below the level"),
        log.log(logging.WARNING, "by number", n=5),
        log.info('text é 日本 and "quotes"', value=2**70),
    ]
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        results.append(log.exception("raised", n=6))
    return results


@pytest.fixture
def restore_structlog(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """structlog's settings restored after the test; the clock stopped so timestamps repeat."""
    monkeypatch.setattr(time, "time", lambda: 1_796_160_000.25)
    saved = structlog.get_config()
    try:
        yield
    finally:
        structlog.configure(**saved)


def lines_with(wrapper: type[Any], processors: list[Any], capsys: pytest.CaptureFixture[str]) -> list[str]:
    structlog.configure(processors=processors, wrapper_class=wrapper, cache_logger_on_first_use=False)
    every_kind_of_call(structlog.get_logger("test.access"))
    return capsys.readouterr().err.splitlines()


@pytest.mark.usefixtures("restore_structlog")
class TestFilteringBoundLogger:
    @pytest.mark.parametrize("fmt", ["json", "console"])
    @pytest.mark.parametrize("worker", [False, True], ids=["one-process", "workers"])
    def test_lines_are_byte_identical(self, capsys: pytest.CaptureFixture[str], fmt: str, worker: bool) -> None:
        """Through the command line's processors (and the workers' ``worker`` one), every line equals structlog's."""
        configure_logging("info", fmt)
        processors = structlog.get_config()["processors"]
        if worker:
            processors = [add_worker, *processors]
        theirs = lines_with(structlog.make_filtering_bound_logger(logging.INFO), processors, capsys)
        ours = lines_with(filtering_bound_logger(logging.INFO), processors, capsys)
        assert len(theirs) >= 12 and not any("below the level" in line for line in theirs)
        assert ours == theirs

    @pytest.mark.parametrize(
        "last",
        [
            lambda logger, name, event: dict(event),
            lambda logger, name, event: ((name,), dict(event)),
            lambda logger, name, event: repr(sorted(event.items())).encode(),
            lambda logger, name, event: bytearray(b"raw"),
        ],
        ids=["dict", "tuple", "bytes", "bytearray"],
    )
    def test_what_the_logger_receives(self, last: Callable[..., Any]) -> None:
        """Whatever the last processor returns reaches the wrapped logger as with structlog's logger."""

        def results(wrapper: type[Any]) -> list[Any]:
            log = wrapper(structlog.ReturnLogger(), processors=[stamp_utc, last], context={"bound": 0})
            return every_kind_of_call(log)

        assert results(filtering_bound_logger(logging.DEBUG)) == results(structlog.make_filtering_bound_logger(0))

    def test_dropped_event(self) -> None:
        """A processor raising DropEvent drops the event: nothing reaches the logger, the call returns None."""

        def drop(logger: Any, name: str, event: Any) -> Any:
            raise structlog.DropEvent

        def fail(logger: Any, name: str, event: Any) -> Any:
            raise AssertionError("a processor after a dropped event ran")

        log = filtering_bound_logger(logging.INFO)(structlog.ReturnLogger(), processors=[drop, fail], context={})
        assert log.info("request", **ACCESS) is None

    def test_bad_last_processor(self) -> None:
        """A last processor returning something no logger takes raises ValueError, as structlog's does."""
        log = filtering_bound_logger(logging.INFO)(
            structlog.ReturnLogger(), processors=[lambda logger, name, event: 42], context={}
        )
        with pytest.raises(ValueError, match=r"the last processor must return .* \(got int\)"):
            log.info("request")

    def test_levels_below_are_skipped(self) -> None:
        """Levels below the minimum run no processor at all; the level methods at or above it are ours."""
        cls = filtering_bound_logger(logging.WARNING)
        log = cls(structlog.ReturnLogger(), processors=[lambda logger, name, event: pytest.fail("ran")], context={})
        assert log.debug("quiet") is None and log.info("quiet") is None
        assert cls.warning is not structlog.make_filtering_bound_logger(logging.WARNING).warning
        assert log.is_enabled_for(logging.WARNING) and log.get_effective_level() == logging.WARNING

    def test_one_class_per_level(self) -> None:
        """The class is made once per level, subclasses structlog's, and ``bind`` keeps it."""
        cls = filtering_bound_logger(logging.INFO)
        assert cls is filtering_bound_logger(logging.INFO)
        assert issubclass(cls, structlog.make_filtering_bound_logger(logging.INFO))
        assert type(cls(structlog.ReturnLogger(), processors=[], context={}).bind(a=1)) is cls

    def test_access_line_shape(self, capsys: pytest.CaptureFixture[str]) -> None:
        """One JSON line per event: the caller's keys in its order, then event, level and timestamp."""
        configure_logging("info", "json")
        structlog.configure(wrapper_class=filtering_bound_logger(logging.INFO))
        structlog.get_logger("test.access").info("request", **ACCESS)
        (line,) = capsys.readouterr().err.splitlines()
        fields = json.loads(line)  # compact with orjson (the server installs it), json.dumps' spacing without
        assert list(fields) == [*ACCESS, "event", "level", "timestamp"]
        assert fields["request_id"] == "5f0c6a1e9b7d4c2a8e3f1b0d6c9a7e21" and fields["error"] is None
        assert (fields["event"], fields["level"], fields["timestamp"]) == (
            "request",
            "info",
            "2026-12-01T21:20:00.250000Z",
        )
