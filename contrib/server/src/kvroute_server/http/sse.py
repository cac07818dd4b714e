"""Server-sent events and JSON bodies as bytes: where events end, and what a completion's answer looks like.

Used by the proxy to check an engine's answer before relaying it (`kvroute_server.proxy.answers`) and by the
health checker's probe request. A completion answered 200 is a JSON object; a stream's first event carries
a ``data:`` line (events that hold only comments, ``: keep-alive``, may come before it); a stream that ended
well has ``data: [DONE]`` as its last event. Nothing here parses a whole body: a JSON object starts with
``{`` and ends with ``}`` (an HTML error page, a truncated body or an empty one does not).
"""

from __future__ import annotations

__all__ = ["ends_with_done", "event_end", "first_data_event", "is_json_object"]

_WHITESPACE = b" \t\r\n"
_DONE = b"data: [DONE]"


def event_end(data: bytes) -> int:
    """Index just past the last complete SSE event in ``data`` (0 when none is complete)."""
    end = data.rfind(b"\n\n")
    end = end + 2 if end >= 0 else 0
    crlf = data.rfind(b"\r\n\r\n")
    if crlf >= 0 and crlf + 4 > end:
        end = crlf + 4
    return end


def is_json_object(body: bytes) -> bool:
    """Whether ``body`` looks like one JSON object (first and last non-blank bytes are braces)."""
    text = body.strip(_WHITESPACE)
    return text.startswith(b"{") and text.endswith(b"}")


def first_data_event(complete: bytes) -> bool | None:
    """Of the complete events in ``complete``: True when the first that is not only comments has a ``data:``
    line, False when it has none, None when every event is only comments (wait for more)."""
    for event in complete.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line for line in event.split(b"\n") if line and not line.startswith(b":")]
        if not lines:
            continue
        return any(line.startswith(b"data:") for line in lines)
    return None


def ends_with_done(sent_tail: bytes) -> bool:
    """Whether the last event sent (the tail of what was relayed) is ``data: [DONE]``."""
    return sent_tail.rstrip(_WHITESPACE).endswith(_DONE)
