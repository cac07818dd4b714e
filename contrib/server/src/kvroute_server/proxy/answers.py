"""What an engine's answer must look like before the proxy relays it, and the SSE pieces it writes itself.

A completion answered 2xx is a JSON object; a stream's first event carries a ``data:`` line (events
that hold only comments, ``: keep-alive``, may come before it); a stream that ended well has
``data: [DONE]`` as its last event. These checks look at bytes the proxy holds anyway and never parse
a whole body: a JSON object starts with ``{`` and ends with ``}`` (an HTML error page, a truncated
body or an empty one does not).
"""

from __future__ import annotations

from kvroute_server.fleet.outliers import Likeness, likeness
from kvroute_server.http.asgi import dumps, openai_error
from kvroute_server.proxy.usage import UsageSniffer

__all__ = [
    "answered_like",
    "ends_with_done",
    "event_end",
    "first_data_event",
    "is_json_object",
    "prompt_tokens_estimate",
    "stream_error_event",
]

_WHITESPACE = b" \t\r\n"
_DONE = b"data: [DONE]"
#: Characters per token of the prompt estimate (when the request carries no token ids).
CHARS_PER_TOKEN = 4


def event_end(data: bytes) -> int:
    """Index just past the last complete SSE event in ``data`` (0 when none is complete)."""
    end = data.rfind(b"\n\n")
    end = end + 2 if end >= 0 else 0
    crlf = data.rfind(b"\r\n\r\n")
    if crlf >= 0 and crlf + 4 > end:
        end = crlf + 4
    return end


def stream_error_event(message: str, code: str) -> bytes:
    """An SSE error event in OpenAI's error shape, then ``[DONE]``."""
    body = openai_error(502, message, code=code)
    return b"data: " + dumps(body) + b"\n\ndata: [DONE]\n\n"


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


def prompt_tokens_estimate(token_ids: tuple[int, ...] | None, text: str) -> int:
    """The prompt's size in tokens: its token ids when given, else its text's length over `CHARS_PER_TOKEN`."""
    return len(token_ids) if token_ids is not None else len(text) // CHARS_PER_TOKEN


def answered_like(stream: bool, prompt_estimate: int, max_tokens: int | None, sniffer: UsageSniffer) -> Likeness:
    """An answered request's likeness: its uncached prompt when the engine reported usage, else the estimate."""
    prompt = prompt_estimate
    if sniffer.prompt_tokens is not None:
        prompt = sniffer.prompt_tokens - (sniffer.cached_tokens or 0)
    return likeness(stream, prompt, max_tokens)
