"""`RouteRequest`: what the router knows about one OpenAI-compatible request.

The canonical routing text
--------------------------
Prefix strategies key on text, so the text must not depend on JSON formatting, key
order or whether content came as a string or as a list of parts. ``RouteRequest.text``
is rendered as follows (documented in docs/architecture.md, stable across versions):

* chat: if ``tools`` are given, ``<|tools|>`` + their canonical JSON + ``\\n`` first;
  then every message in order as ``<|ROLE|>`` (``<|ROLE:NAME|>`` when it has a
  ``name``) + its text content + its tool calls as canonical JSON + ``\\n``.
  Text parts of a list content are concatenated; an image part renders as
  ``<|image:HASH|>`` where HASH is a stable hash of its URL (data URLs are large).
* completions: the prompt string; a list of strings joined with ``\\n``; token ids
  rendered as ``<|ids|>`` + the ids joined by spaces (so character prefixes work on
  token prompts too), and also exposed as ``token_ids``.

Because each message renders on its own and messages are concatenated, a conversation's
turn N+1 text always starts with turn N's text: multi-turn prefixes nest.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from kvroute.errors import InvalidRequest
from kvroute.hashing import hash64

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

_MAX_CACHE_SALT = 128

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


def _canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _render_content(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces: list[str] = []
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
                pieces.append(text)
            elif kind in ("image_url", "input_image", "input_audio", "video_url"):
                ref = part.get(kind) or part.get("image_url") or part
                url = ref.get("url", "") if isinstance(ref, Mapping) else str(ref)
                pieces.append(f"<|{kind.split('_')[0]}:{hash64(_canonical_json(url)):016x}|>")
            else:
                # Unknown part types still shape the prompt: render them canonically.
                pieces.append(f"<|part|>{_canonical_json(part)}")
        return "".join(pieces)
    raise InvalidRequest(
        f"'{where}' must be a string or a list of content parts (got {_type_name(content)}).",
        param=where,
    )


def render_messages(messages: Sequence[Mapping[str, Any]], tools: object = None) -> str:
    """Render chat messages (and tools) to the canonical routing text; validates shapes."""
    out: list[str] = []
    if tools:
        out.append(f"<|tools|>{_canonical_json(tools)}\n")
    for i, message in enumerate(messages):
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
        name = message.get("name")
        head = f"<|{role}:{name}|>" if isinstance(name, str) and name else f"<|{role}|>"
        body = _render_content(message.get("content"), f"{where}.content")
        calls = message.get("tool_calls")
        if calls:
            body += f"<|tool_calls|>{_canonical_json(calls)}"
        out.append(f"{head}{body}\n")
    return "".join(out)


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
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
    #: The body's fields that shape the engine's prompt tokens (``tools``, ``documents``,
    #: ``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``,
    #: ``add_special_tokens``), for strategies that tokenize like the engine; ``None`` if absent.
    prompt_options: Mapping[str, Any] | None = attrs.field(default=None, eq=False)

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
        )

    @classmethod
    def from_openai(
        cls,
        body: object,
        *,
        endpoint: Endpoint = "chat",
        headers: Mapping[str, str] | None = None,
        request_id: str | None = None,
    ) -> RouteRequest:
        """Parse an OpenAI-compatible ``/v1/chat/completions`` or ``/v1/completions`` body.

        ``headers`` (lower-case names) may carry the affinity key, a LoRA adapter and the
        request id. Raises :class:`InvalidRequest` naming the field that is wrong.
        """
        if not isinstance(body, Mapping):
            raise InvalidRequest(f"The request body must be a JSON object (got {_type_name(body)}).")
        headers = headers or {}
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest(
                f"'model' must be a non-empty string (got {_type_name(model)}).", param="model"
            )
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise InvalidRequest(f"'stream' must be a boolean (got {_type_name(stream)}).", param="stream")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0):
            raise InvalidRequest(
                f"'max_tokens' must be a non-negative integer (got {max_tokens!r}).", param="max_tokens"
            )
        cache_salt = _optional_str(body, "cache_salt")
        if cache_salt is not None and len(cache_salt) > _MAX_CACHE_SALT:
            raise InvalidRequest(
                f"'cache_salt' must be at most {_MAX_CACHE_SALT} characters (got {len(cache_salt)}).",
                param="cache_salt",
            )
        lora = _optional_str(body, "lora_adapter") or headers.get(LORA_HEADER) or None

        token_ids: tuple[int, ...] | None = None
        messages: tuple[Mapping[str, Any], ...] | None = None
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
            text = render_messages(raw, tools)
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
                text = "<|ids|>" + " ".join(map(str, token_ids))
        else:
            raise InvalidRequest(f"endpoint must be 'chat' or 'completions' (got {endpoint!r}).")

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
            prompt_options={k: body[k] for k in _PROMPT_OPTIONS if body.get(k) is not None} or None,
        )
