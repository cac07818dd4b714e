"""Loggers for library code: structlog events delivered through the standard library's `logging`.

A library must stay silent unless its host asks for its logs. structlog left unconfigured prints
every event to stdout, so library modules (the router, the fleet, the plugin manager, strategies
and adapters) do not take structlog's default logger: they wrap ``logging.getLogger(name)``.
The host then decides, with the standard library's tools, what it sees
(``logging.getLogger("kvroute").setLevel(logging.INFO)`` and a handler of its own). Events keep
structlog's shape: the host's structlog configuration, when it has one, renders them; otherwise
structlog's default processors turn each event into one line handed to the standard logger.

The command-line entry points (`kvroute simulate`, `kvroute serve`, ...) configure both, so a
process started from the CLI keeps its current output. They render with `stamp_utc` and
`render_json` below, two cheaper stand-ins for structlog's own processors: the proxy writes one
access line per request, and structlog's ISO timestamp and ``json.dumps`` cost it ~6 µs of the
~18 µs a line took.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import MutableMapping
from typing import Any

import structlog

try:  # installed with kvroute-server, whose access log is the hot path; optional for the library
    import orjson
except ImportError:  # pragma: no cover - exercised only where orjson is not installed
    orjson = None  # type: ignore[assignment]

__all__ = ["get_logger"]


#: How an event is rendered when the host never configured structlog: one logfmt line,
#: tracebacks as text without local variables (locals could hold prompt text).
_PLAIN: tuple[Any, ...] = (
    structlog.processors.add_log_level,
    structlog.processors.format_exc_info,
    structlog.processors.LogfmtRenderer(key_order=["event"], sort_keys=True),
)


def _quiet_host_filter(logger: Any, method_name: str, event_dict: Any) -> Any:
    """Drop an event below the standard logger's level before rendering, when structlog is unconfigured.

    A host that configured structlog filters with its own settings (and tests capture every
    event with ``structlog.testing.capture_logs``), so then every event goes on.
    """
    if not structlog.is_configured():
        return structlog.stdlib.filter_by_level(logger, method_name, event_dict)
    return event_dict


def _render(logger: Any, method_name: str, event_dict: Any) -> Any:
    """Render with the host's structlog processors when it configured structlog, else plainly."""
    chain = structlog.get_config()["processors"] if structlog.is_configured() else _PLAIN
    for processor in chain:
        event_dict = processor(logger, method_name, event_dict)
    return event_dict


class _Second:
    """The formatted UTC second of the last timestamp, reused while the clock stays within it."""

    whole = -1
    text = ""


def stamp_utc(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Add ``timestamp``: the UTC time as ISO 8601 with microseconds (``2026-12-01T21:35:03.420457Z``).

    The same text as ``structlog.processors.TimeStamper(fmt="iso", utc=True)`` except that the
    microseconds are always written (``isoformat`` drops them when they are 0), at a third of
    its cost: the date and time of day are formatted once per second.
    """
    now = time.time()
    whole = int(now)
    if whole != _Second.whole:
        _Second.text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
        _Second.whole = whole
    event_dict["timestamp"] = f"{_Second.text}.{int((now - whole) * 1e6):06d}Z"
    return event_dict


def _fallback(value: Any) -> Any:
    """What a value JSON has no type for becomes: its ``__structlog__()`` or its ``repr`` (as structlog does)."""
    structlog_form = getattr(value, "__structlog__", None)
    return structlog_form() if structlog_form is not None else repr(value)


def render_json(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> str:
    """The event as one line of JSON, keys in the event's order (stands in for structlog's ``JSONRenderer``).

    With orjson installed (it comes with kvroute-server) the line is compact (``{"a":1,"b":null}``)
    and non-ASCII text is written as UTF-8, at a tenth of ``json.dumps``'s cost; what orjson
    refuses (an integer beyond 64 bits, a key that is not a string) falls back to ``json.dumps``,
    so an event is never lost to its rendering.
    """
    if orjson is not None:
        try:
            return orjson.dumps(event_dict, default=_fallback).decode()
        except TypeError:  # orjson.JSONEncodeError
            pass
    return json.dumps(event_dict, default=_fallback)


def get_logger(name: str) -> Any:
    """A structlog logger for module ``name`` whose events go to ``logging.getLogger(name)``.

    Use it at module level in library and plugin code: ``log = get_logger(__name__)``. While the
    host leaves structlog unconfigured, an event below the standard logger's level is dropped
    before anything is rendered, so a quiet host pays a level check per event, nothing more.
    """
    return structlog.wrap_logger(logging.getLogger(name), processors=[_quiet_host_filter, _render])
