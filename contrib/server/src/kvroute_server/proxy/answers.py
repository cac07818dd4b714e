"""What the proxy checks of an engine's answer before relaying it, and the SSE pieces it writes itself.

The checks are `kvroute_server.http.sse`'s (shared with the health checker's probe request), re-exported
here: a completion answered 200 must be a JSON object, a stream's first event a data event, a finished stream's last
event ``data: [DONE]``. Also here: the error event the proxy appends to a broken stream, and the prompt's
size estimate and an answered request's likeness for the outlier detector.
"""

from __future__ import annotations

from kvroute_server.fleet.outliers import Likeness, likeness
from kvroute_server.http.asgi import dumps, openai_error
from kvroute_server.http.sse import ends_with_done, event_end, first_data_event, is_json_object
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

#: Characters per token of the prompt estimate (when the request carries no token ids).
CHARS_PER_TOKEN = 4


def stream_error_event(message: str, code: str) -> bytes:
    """An SSE error event in OpenAI's error shape, then ``[DONE]``."""
    body = openai_error(502, message, code=code)
    return b"data: " + dumps(body) + b"\n\ndata: [DONE]\n\n"


def prompt_tokens_estimate(token_ids: tuple[int, ...] | None, text: str) -> int:
    """The prompt's size in tokens: its token ids when given, else its text's length over `CHARS_PER_TOKEN`."""
    return len(token_ids) if token_ids is not None else len(text) // CHARS_PER_TOKEN


def answered_like(stream: bool, prompt_estimate: int, max_tokens: int | None, sniffer: UsageSniffer) -> Likeness:
    """An answered request's likeness: its uncached prompt when the engine reported usage, else the estimate."""
    prompt = prompt_estimate
    if sniffer.prompt_tokens is not None:
        prompt = sniffer.prompt_tokens - (sniffer.cached_tokens or 0)
    return likeness(stream, prompt, max_tokens)
