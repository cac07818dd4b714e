"""`RouteRequest`: what the router knows about one OpenAI-compatible request.

The canonical routing text
--------------------------
Prefix strategies key on text, so the text must not depend on JSON formatting, key
order or whether content came as a string or as a list of parts. ``RouteRequest.text``
is rendered as follows (documented in docs/architecture.md, stable across versions):

* chat: if ``tools`` are given, ``<|tools|>`` + their canonical JSON + ``\\n`` first;
  then every message in order as ``<|ROLE|>`` (``<|ROLE:NAME|>`` when it has a
  ``name``) + its content + ``<|tool_calls|>`` and their canonical JSON if any + ``\\n``.
  Text parts of a list content are concatenated; a media part renders as
  ``<|image:HASH|>`` (``audio``, ``video``, ``file``) where HASH is a stable hash of the
  URL, base64 data or file id that identifies it; any other part as ``<|part|>`` + JSON.
* escaping keeps the rendering one-to-one: in text, ``<`` + any backslashes + ``|`` gets
  one more backslash before the ``|`` (ordinary text is unchanged); in ROLE and NAME a
  backslash escapes ``\\`` and ``|`` (and ``:`` in ROLE); a role spelled like a marker
  (``tools``, ``tool_calls``, ``part``, ``image``, ``audio``, ``video``, ``file``) gets a
  leading backslash. So message text cannot pass for a message boundary or a media part.
* completions: the prompt string; a list of strings joined with ``\\n``; token ids
  rendered as ``<|ids|>`` + the ids joined by spaces (so character prefixes work on
  token prompts too), and also exposed as ``token_ids``.

Because each message renders on its own and messages are concatenated, a conversation's
turn N+1 text always starts with turn N's text: multi-turn prefixes nest.
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Literal

import attrs

from kvroute.errors import InvalidRequest
from kvroute.hashing import hash64, hash_parts
from kvroute.session_ids import DEFAULT_SESSION_SOURCES, IgnoredReason, SessionSource, read_session_id
from kvroute.slo import Objectives

__all__ = [
    "AFFINITY_HEADER",
    "LORA_HEADER",
    "REQUEST_ID_HEADER",
    "Endpoint",
    "RouteRequest",
    "render_messages",
]

#: Header a caller sets to pin requests to one key (a session id, a tenant's document id).
AFFINITY_HEADER = "x-kvroute-affinity"
#: Header naming a LoRA adapter when the gateway does not put it in ``model``.
LORA_HEADER = "x-kvroute-lora"
#: Header carrying the request id; created when absent.
REQUEST_ID_HEADER = "x-request-id"

Endpoint = Literal["chat", "completions"]

_NO_SESSION = read_session_id({}, {}, ())

_MAX_CACHE_SALT = 128
#: Token ids are unsigned 64-bit integers (engines and block hashes store them so).
_TOKEN_ID_LIMIT = 2**64

#: Body fields that change how an engine builds the prompt's tokens (kept in ``prompt_options``).
_PROMPT_OPTIONS = (
    "tools",
    "documents",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
)


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _depth(value: object) -> int:
    """How deeply lists and objects nest in ``value`` (iterative, and each container counted
    once, so any depth and even a cycle are safe; exact for trees such as parsed JSON)."""
    deepest, stack, seen = 0, [(value, 0)], set()
    while stack:
        item, level = stack.pop()
        if not isinstance(item, Mapping | list | tuple) or id(item) in seen:
            continue
        seen.add(id(item))
        children = item.values() if isinstance(item, Mapping) else item
        stack.extend((child, level + 1) for child in children)
        deepest = max(deepest, level + 1)
    return deepest


def _canonical_json(value: object, where: str, param: str | None = None) -> str:
    """Sorted keys, no spaces; a value JSON cannot encode raises InvalidRequest naming ``where``."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        raise InvalidRequest(
            f"'{where}' must be JSON nested less deeply than the recursion limit "
            f"({sys.getrecursionlimit()}) (got {_depth(value)} levels).",
            param=param or where,
        ) from None
    except (TypeError, ValueError) as exc:  # non-JSON types, non-string keys, cycles, huge ints
        raise InvalidRequest(f"'{where}' must be a JSON value ({exc}).", param=param or where) from None


# -- escaping: user-controlled text never reads as a marker ----------------------------
#
# Markers all open with ``<|``. In text, ``<`` followed by zero or more backslashes and
# ``|`` gets one more backslash before the ``|``: ``<|`` -> ``<\|``, ``<\|`` -> ``<\\|``.
# The mapping is one-to-one, leaves text without such sequences unchanged, and escaped
# text never contains ``<|``.
_MARKER_OPENING = re.compile(r"<(\\*)\|")

#: Roles that would render like a marker (``<|image:HASH|>``, ``<|tools|>``...): their
#: header gets a leading backslash. Elsewhere an escaped role has a backslash only before
#: ``\``, ``|`` or ``:``, so ``\image`` can only be the reserved role.
_RESERVED_ROLES = frozenset({"tools", "tool_calls", "part", "image", "audio", "video", "file"})


def _escape_text(text: str) -> str:
    # Most prompts hold no "<" at all: looking for one character is a memchr, ~50x faster on
    # a 3 KB prompt than each of the two-character searches (~2.5 µs each).
    if "<" not in text or ("<|" not in text and "<\\" not in text):
        return text
    return _MARKER_OPENING.sub(r"<\1\\|", text)


def _escape_field(value: str, specials: str) -> str:
    # An identifier ("system", "tool_1") holds none of the specials (backslash, bar, colon):
    # one C call instead of a generator per special.
    if value.isidentifier() or not any(c in value for c in specials):
        return value
    return "".join("\\" + c if c in specials else c for c in value)


def _header(role: str, name: object) -> str:
    """``<|ROLE|>`` or ``<|ROLE:NAME|>``; a backslash escapes ``\\ | :`` in the role and ``\\ |`` in the name."""
    head = "\\" + role if role in _RESERVED_ROLES else _escape_field(role, "\\|:")
    if isinstance(name, str) and name:
        head += ":" + _escape_field(name, "\\|")
    return f"<|{head}|>"


# -- media parts ------------------------------------------------------------------------

#: Content part type -> the marker name it renders as.
_MEDIA_KINDS = {
    "image_url": "image",
    "input_image": "image",
    "input_audio": "audio",
    "audio_url": "audio",
    "video_url": "video",
    "file": "file",
    "input_file": "file",
}
#: The fields that identify a media part's content, looked up in this order in the part's
#: payload (``part[type]``) or, for flat parts (the Responses API's ``input_image`` and
#: ``input_file``), in the part itself; each with the kind of source it is.
_MEDIA_SOURCES = {
    "url": "url",
    "image_url": "url",
    "file_url": "url",
    "data": "data",
    "file_data": "data",
    "file_id": "file_id",
}


def _media_marker(part: Mapping[str, Any], kind: str, where: str, param: str) -> str:
    """``<|image:HASH|>`` (or audio, video, file): HASH is 16 hex digits of a stable hash of
    the value that identifies the content (its URL, base64 data or file id)."""
    payload = part.get(kind)
    source: str = "part"  # nothing identifies it: the whole part does
    value: object = part
    if isinstance(payload, str):  # {"type": "image_url", "image_url": "https://..."}
        source, value = "url", payload
    else:
        holder = payload if isinstance(payload, Mapping) else part
        for field, kind_of_source in _MEDIA_SOURCES.items():
            if holder.get(field) is not None:
                source, value = kind_of_source, holder[field]
                break
    ident = _canonical_json(value, where, param)
    # A URL hashes as in earlier versions (image and video keys stay the same); other sources
    # are tagged with their kind, so a file id never renders like an equal URL.
    digest = hash64(ident) if source == "url" else hash_parts(source, ident)
    return f"<|{_MEDIA_KINDS[kind]}:{digest:016x}|>"


def _render_content(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return _escape_text(content)
    if isinstance(content, list):
        pieces: list[str] = []
        texts: list[str] = []  # adjacent text parts are escaped together: "<" + "|" is "<|"
        for i, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise InvalidRequest(
                    f"'{where}[{i}]' must be a content part object (got {_type_name(part)}).",
                    param=where,
                )
            kind = part.get("type")
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise InvalidRequest(
                        f"'{where}[{i}].text' must be a string (got {_type_name(text)}).",
                        param=where,
                    )
                texts.append(text)
                continue
            if texts:
                pieces.append(_escape_text("".join(texts)))
                texts.clear()
            if isinstance(kind, str) and kind in _MEDIA_KINDS:
                pieces.append(_media_marker(part, kind, f"{where}[{i}]", where))
            else:
                # Unknown part types still shape the prompt: render them canonically.
                pieces.append(f"<|part|>{_canonical_json(part, f'{where}[{i}]', where)}")
        if texts:
            pieces.append(_escape_text("".join(texts)))
        return "".join(pieces)
    raise InvalidRequest(
        f"'{where}' must be a string or a list of content parts (got {_type_name(content)}).",
        param=where,
    )


def render_messages(messages: Sequence[Mapping[str, Any]], tools: object = None) -> str:
    """Render chat messages (and tools) to the canonical routing text; validates shapes."""
    return _render_chat(messages, tools)[0]


def _render_chat(messages: Sequence[Mapping[str, Any]], tools: object) -> tuple[str, tuple[int, ...]]:
    """The routing text, and where each message starts in it followed by the text's length."""
    out: list[str] = []
    offsets: list[int] = []
    size = 0
    if tools:
        out.append(f"<|tools|>{_canonical_json(tools, 'tools')}\n")
        size = len(out[0])
    for i, message in enumerate(messages):
        offsets.append(size)
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequest(
                f"'{where}' must be an object with 'role' and 'content' (got {_type_name(message)}).",
                param="messages",
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(
                f"'{where}.role' must be a non-empty string (got {_type_name(role)}).",
                param="messages",
            )
        body = _render_content(message.get("content"), f"{where}.content")
        calls = message.get("tool_calls")
        if calls:
            body += f"<|tool_calls|>{_canonical_json(calls, f'{where}.tool_calls', 'messages')}"
        out.append(f"{_header(role, message.get('name'))}{body}\n")
        size += len(out[-1])
    offsets.append(size)
    return "".join(out), tuple(offsets)


def _describe_int(value: int) -> str:
    # str() of an int over 4,300 digits raises ValueError: name huge values by their size.
    return str(value) if value.bit_length() <= 256 else f"an integer of {value.bit_length()} bits"


def _is_token_list(value: object) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"'{key}' must be a string (got {_type_name(value)}).", param=key)
    return value


@attrs.frozen
class RouteRequest:
    """One request as the router sees it: the routing text, the keys that split caches, and flags.

    Build it with :meth:`from_openai` (from a JSON body) or :meth:`from_text` (tests,
    simulation, embedding); ``__init__`` only stores fields.
    """

    request_id: str
    model: str
    text: str
    endpoint: Endpoint = "chat"
    token_ids: tuple[int, ...] | None = None
    messages: tuple[Mapping[str, Any], ...] | None = attrs.field(default=None, eq=False)
    stream: bool = False
    lora: str | None = None
    cache_salt: str | None = None
    affinity_key: str | None = None
    max_tokens: int | None = None
    #: The session this request belongs to, read from the first usable source
    #: (`kvroute.session_ids`): requests of one session stay on one backend when the router
    #: keeps sessions (`kvroute.sessions`).
    session_id: str | None = None
    #: Why a session id that was present was not used (``too_long``, ``not_utf8``, ``wrong_type``, ``empty``).
    session_ignored: IgnoredReason | None = attrs.field(default=None, eq=False)
    #: The body's fields that shape the engine's prompt tokens (``tools``, ``documents``,
    #: ``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``,
    #: ``add_special_tokens``), for strategies that tokenize like the engine; ``None`` if absent.
    prompt_options: Mapping[str, Any] | None = attrs.field(default=None, eq=False)
    #: Chat only: where each message starts in ``text``, then ``len(text)`` (one more offset than
    #: messages), so keys can be cut at message boundaries (`kvroute.keys.message_cuts`).
    message_offsets: tuple[int, ...] | None = attrs.field(default=None, eq=False)
    #: The request's latency objectives and priority class (`kvroute.slo`), set by the host
    #: from headers or per-model defaults; ``None``: none.
    objectives: Objectives | None = attrs.field(default=None, eq=False)
    #: Values derived from this request by whoever first needed them, keyed by how they were derived (the
    #: cache view keeps the prompt's block hashes here), so that the other readers of the same request (a dry
    #: run before its lease, a retry, a shadow's view) do not derive them again. Not part of equality; a
    #: request made with ``attrs.evolve`` starts with an empty one (its text may differ).
    memo: dict[Hashable, Any] = attrs.field(factory=dict, init=False, eq=False, repr=False)

    @classmethod
    def from_text(
        cls,
        text: str,
        *,
        model: str = "default",
        request_id: str | None = None,
        token_ids: Sequence[int] | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
        affinity_key: str | None = None,
        max_tokens: int | None = None,
        session_id: str | None = None,
    ) -> RouteRequest:
        """Build a request from already-rendered routing text."""
        return cls(
            request_id=request_id or uuid.uuid4().hex,
            model=model,
            text=text,
            endpoint="completions",
            token_ids=tuple(token_ids) if token_ids is not None else None,
            lora=lora,
            cache_salt=cache_salt,
            affinity_key=affinity_key,
            max_tokens=max_tokens,
            session_id=session_id,
        )

    @classmethod
    def from_openai(
        cls,
        body: object,
        *,
        endpoint: Endpoint = "chat",
        headers: Mapping[str, str] | None = None,
        request_id: str | None = None,
        session_sources: Sequence[SessionSource] = DEFAULT_SESSION_SOURCES,
    ) -> RouteRequest:
        """Parse an OpenAI-compatible ``/v1/chat/completions`` or ``/v1/completions`` body.

        ``headers`` (lower-case names) may carry the affinity key, a LoRA adapter, the
        request id and a session id. The session id is read from ``session_sources`` in order
        (`kvroute.session_ids`; ``()`` reads none); an unusable one is skipped, never an error.
        Raises :class:`InvalidRequest` naming the field that is wrong.
        """
        if not isinstance(body, Mapping):
            raise InvalidRequest(f"The request body must be a JSON object (got {_type_name(body)}).")
        headers = headers or {}
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest(f"'model' must be a non-empty string (got {_type_name(model)}).", param="model")
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise InvalidRequest(f"'stream' must be a boolean (got {_type_name(stream)}).", param="stream")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0
        ):
            got = _describe_int(max_tokens) if isinstance(max_tokens, int) else _type_name(max_tokens)
            raise InvalidRequest(f"'max_tokens' must be a non-negative integer (got {got}).", param="max_tokens")
        cache_salt = _optional_str(body, "cache_salt")
        if cache_salt is not None and len(cache_salt) > _MAX_CACHE_SALT:
            raise InvalidRequest(
                f"'cache_salt' must be at most {_MAX_CACHE_SALT} characters (got {len(cache_salt)}).",
                param="cache_salt",
            )
        lora = _optional_str(body, "lora_adapter") or headers.get(LORA_HEADER) or None

        token_ids: tuple[int, ...] | None = None
        messages: tuple[Mapping[str, Any], ...] | None = None
        offsets: tuple[int, ...] | None = None
        if endpoint == "chat":
            raw = body.get("messages")
            if not isinstance(raw, list) or not raw:
                raise InvalidRequest(
                    f"'messages' must be a non-empty list of message objects (got {_type_name(raw)}).",
                    param="messages",
                )
            tools = body.get("tools")
            if tools is not None and not isinstance(tools, list):
                raise InvalidRequest(f"'tools' must be a list (got {_type_name(tools)}).", param="tools")
            text, offsets = _render_chat(raw, tools)
            messages = tuple(raw)
        elif endpoint == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                text = prompt
            elif _is_token_list(prompt):
                token_ids = tuple(prompt)  # type: ignore[arg-type]
            elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                text = "\n".join(prompt)
            elif isinstance(prompt, list) and prompt and all(_is_token_list(p) for p in prompt):
                token_ids = tuple(prompt[0])
            else:
                raise InvalidRequest(
                    "'prompt' must be a string, a list of strings, a list of token ids or a list of "
                    f"token id lists (got {_type_name(prompt)}).",
                    param="prompt",
                )
            if token_ids is not None:
                bad = next((t for t in token_ids if not 0 <= t < _TOKEN_ID_LIMIT), None)
                if bad is not None:
                    raise InvalidRequest(
                        f"'prompt' token ids must be integers from 0 to 2**64 - 1 (got {_describe_int(bad)}).",
                        param="prompt",
                    )
                text = "<|ids|>" + " ".join(map(str, token_ids))
        else:
            got = repr(endpoint) if isinstance(endpoint, str) else _type_name(endpoint)
            raise InvalidRequest(f"endpoint must be 'chat' or 'completions' (got {got}).")

        session = read_session_id(body, headers, session_sources) if session_sources else _NO_SESSION
        return cls(
            request_id=request_id or headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex,
            model=model,
            text=text,
            endpoint=endpoint,
            token_ids=token_ids,
            messages=messages,
            stream=stream,
            lora=lora,
            cache_salt=cache_salt,
            affinity_key=headers.get(AFFINITY_HEADER) or None,
            max_tokens=max_tokens,
            session_id=session.session_id,
            session_ignored=session.ignored,
            prompt_options={k: body[k] for k in _PROMPT_OPTIONS if body.get(k) is not None} or None,
            message_offsets=offsets,
        )
