"""Loggers for library code: structlog events delivered through the standard library's `logging`.

A library must stay silent unless its host asks for its logs. structlog left unconfigured prints
every event to stdout, so library modules (the router, the fleet, the plugin manager, strategies
and adapters) do not take structlog's default logger: they wrap ``logging.getLogger(name)``.
The host then decides, with the standard library's tools, what it sees
(``logging.getLogger("kvroute").setLevel(logging.INFO)`` and a handler of its own). Events keep
structlog's shape: the host's structlog configuration, when it has one, renders them; otherwise
structlog's default processors turn each event into one line handed to the standard logger.

The command-line entry points (`kvroute simulate`, `kvroute serve`, ...) configure both, so a
process started from the CLI keeps its current output.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

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


def get_logger(name: str) -> Any:
    """A structlog logger for module ``name`` whose events go to ``logging.getLogger(name)``.

    Use it at module level in library and plugin code: ``log = get_logger(__name__)``. While the
    host leaves structlog unconfigured, an event below the standard logger's level is dropped
    before anything is rendered, so a quiet host pays a level check per event, nothing more.
    """
    return structlog.wrap_logger(logging.getLogger(name), processors=[_quiet_host_filter, _render])
