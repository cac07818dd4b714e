"""Where a request's session id comes from: a list of header and body sources, read in order.

Agent harnesses and chat front ends already name their sessions, each in its own place. The
default sources, tried in this order (the first usable one wins):

====================================  =======================================================
source                                who sends it
====================================  =======================================================
``header:x-kvroute-affinity``         kvroute's own pinning header (any client)
``body:prompt_cache_key``             OpenAI's API: the key its prompt cache is routed by
``header:x-session-id``               llm-d's session affinity filter; OpenCode
``header:x-dynamo-session-id``        NVIDIA Dynamo's session header
``header:x-claude-code-session-id``   Claude Code
``header:session_id``                 OpenAI Codex CLI
``header:session-id``                 the same with a dash, as some gateways rewrite it
``body:metadata.session_id``          clients that tag requests in ``metadata`` (LiteLLM, Anthropic-style)
====================================  =======================================================

A source is ``header:NAME`` (a lower-case header name) or ``body:PATH`` (dotted keys into the
JSON body). A value is used when it is a non-empty string of at most `MAX_SESSION_ID_BYTES`
bytes of UTF-8; anything else is skipped with a reason (`SessionIdRead.ignored`) that the
proxy counts, and the next source is tried. A bad session id never fails a request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs

from kvroute.errors import ConfigError

__all__ = [
    "DEFAULT_SESSION_SOURCES",
    "MAX_SESSION_ID_BYTES",
    "IgnoredReason",
    "SessionIdRead",
    "SessionSource",
    "parse_sources",
    "read_session_id",
]

#: The longest session id used, in bytes of UTF-8 (longer ones are ignored, reason ``too_long``).
MAX_SESSION_ID_BYTES = 256

#: Why a present session id was not used.
IgnoredReason = Literal["too_long", "not_utf8", "wrong_type", "empty"]


@attrs.frozen
class SessionSource:
    """One place a session id may be: a header (lower-case name) or a dotted path into the body."""

    kind: Literal["header", "body"]
    name: str
    #: ``name`` split on dots (body sources).
    path: tuple[str, ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "path", tuple(self.name.split(".")))

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"

    @classmethod
    def parse(cls, text: str) -> SessionSource:
        """``header:x-session-id`` or ``body:metadata.session_id``; a `ConfigError` says what was wrong."""
        kind, sep, name = text.strip().partition(":")
        kind, name = kind.strip().lower(), name.strip()
        if not sep or kind not in ("header", "body") or not name:
            raise ConfigError(
                f"a session id source must be 'header:NAME' or 'body:PATH' (got {text!r}); "
                f"for example 'header:x-session-id' or 'body:metadata.session_id'."
            )
        if kind == "header":
            if any(c.isspace() or c == ":" for c in name):
                raise ConfigError(f"session id source {text!r}: a header name has no spaces or colons.")
            return cls("header", name.lower())
        if any(not part for part in name.split(".")):
            raise ConfigError(f"session id source {text!r}: the body path has an empty key.")
        return cls("body", name)


def parse_sources(value: str | Iterable[str | SessionSource]) -> tuple[SessionSource, ...]:
    """Sources from a comma-separated string or a list of strings; duplicates keep their first place."""
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[SessionSource] = []
    for item in items:
        if isinstance(item, str) and not item.strip():
            continue
        source = item if isinstance(item, SessionSource) else SessionSource.parse(item)
        if source not in out:
            out.append(source)
    return tuple(out)


#: The sources read by default, in order (see the module docstring for who sends each).
DEFAULT_SESSION_SOURCES: tuple[SessionSource, ...] = parse_sources(
    (
        "header:x-kvroute-affinity",
        "body:prompt_cache_key",
        "header:x-session-id",
        "header:x-dynamo-session-id",
        "header:x-claude-code-session-id",
        "header:session_id",
        "header:session-id",
        "body:metadata.session_id",
    )
)


@attrs.frozen
class SessionIdRead:
    """What the sources gave: the session id and where it came from, and the first reason one was skipped."""

    session_id: str | None = None
    source: SessionSource | None = None
    ignored: IgnoredReason | None = None


_NONE = SessionIdRead()


def _body_value(body: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = body
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _check(value: object, from_header: bool) -> tuple[str | None, IgnoredReason | None]:
    if not isinstance(value, str):
        return None, "wrong_type"
    if from_header:
        # Header values reach Python decoded as latin-1 (one char per byte): read them as UTF-8.
        try:
            value = value.encode("latin-1").decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            return None, "not_utf8"
    value = value.strip()
    if not value:
        return None, "empty"
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate from a JSON escape
        return None, "not_utf8"
    if size > MAX_SESSION_ID_BYTES:
        return None, "too_long"
    return value, None


def read_session_id(
    body: Mapping[str, Any], headers: Mapping[str, str], sources: Sequence[SessionSource]
) -> SessionIdRead:
    """The first usable session id among ``sources`` (``headers`` with lower-case names, latin-1 values)."""
    ignored: IgnoredReason | None = None
    for source in sources:
        if source.kind == "header":
            raw: object = headers.get(source.name)
        else:
            raw = _body_value(body, source.path)
        if raw is None:
            continue
        value, reason = _check(raw, source.kind == "header")
        if value is not None:
            return SessionIdRead(value, source, ignored)
        ignored = ignored or reason
    return _NONE if ignored is None else SessionIdRead(None, None, ignored)
