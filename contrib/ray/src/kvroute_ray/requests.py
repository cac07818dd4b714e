"""Read the routing text of a request Ray Serve is about to route (`PendingRequest`).

A request router sees the call's positional ``args`` and keyword ``kwargs`` as the caller
passed them to the deployment handle. The forms found in practice:

* Ray Serve LLM's ingress hands the ``LLMServer`` deployment a parsed OpenAI request object
  (a pydantic model with ``messages`` or ``prompt``; ``model_dump()`` gives its body);
* direct streaming (Ray 2.56+) routes on the raw JSON body wrapped in a
  ``types.SimpleNamespace`` whose attributes are the body's fields;
* an application's own handle calls pass plain dicts, or the raw body as ``bytes``/``str``.

Each becomes an OpenAI body that `kvroute.RouteRequest.from_openai` renders exactly as
``kvroute serve`` does, so the same conversation hashes to the same key here and there.
``None`` means no prompt could be read: the router counts it and routes by load.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from kvroute import AFFINITY_HEADER, LORA_HEADER, InvalidRequest, RouteRequest
from kvroute.logs import get_logger

__all__ = ["body_of", "route_request"]

log = get_logger(__name__)

_PROMPT_FIELDS = ("messages", "prompt")


def _has_prompt(body: Mapping[str, Any]) -> bool:
    return any(body.get(name) for name in _PROMPT_FIELDS)


def body_of(value: object) -> Mapping[str, Any] | None:
    """The OpenAI body carried by one handle argument, or None when it carries none."""
    body: object = None
    if isinstance(value, Mapping):
        body = value
    elif isinstance(value, bytes | bytearray | memoryview | str):
        raw = value if isinstance(value, str) else bytes(value)
        if raw.lstrip()[:1] not in ("{", b"{"):
            return None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return None
    elif callable(getattr(value, "model_dump", None)):  # pydantic v2 (Ray Serve LLM's request types)
        try:
            body = value.model_dump(exclude_none=True)  # type: ignore[attr-defined]
        except Exception:  # a model whose dump fails is not ours to fix: route by load
            return None
    elif any(hasattr(value, name) for name in _PROMPT_FIELDS):  # SimpleNamespace and plain objects
        try:
            body = dict(vars(value))
        except TypeError:  # __slots__ objects: read the two fields that matter
            body = {name: getattr(value, name) for name in (*_PROMPT_FIELDS, "model") if hasattr(value, name)}
    if isinstance(body, Mapping) and _has_prompt(body):
        return body
    return None


def _first_body(values: Iterable[object]) -> Mapping[str, Any] | None:
    for value in values:
        body = body_of(value)
        if body is not None:
            return body
    return None


def route_request(
    args: Iterable[object] | None,
    kwargs: Mapping[str, object] | None,
    *,
    request_id: str | None = None,
    multiplexed_model_id: str | None = None,
    session_id: str | None = None,
    default_model: str = "default",
) -> RouteRequest | None:
    """The `RouteRequest` for one handle call, or None when none of its arguments holds a prompt.

    ``multiplexed_model_id`` (Ray's multiplexed model, e.g. a LoRA adapter) keys the request
    like a LoRA header does in ``kvroute serve``; ``session_id`` pins it like the affinity
    header. A body that names no model is routed under ``default_model``.
    """
    body = _first_body(args or ())
    if body is None:
        body = _first_body((kwargs or {}).values())
    if body is None:
        return None
    if not isinstance(body.get("model"), str) or not body.get("model"):
        body = {**body, "model": default_model}
    headers: dict[str, str] = {}
    if multiplexed_model_id:
        headers[LORA_HEADER] = multiplexed_model_id
    if session_id:
        headers[AFFINITY_HEADER] = session_id
    endpoint: Literal["chat", "completions"] = "chat" if body.get("messages") else "completions"
    try:
        return RouteRequest.from_openai(body, endpoint=endpoint, headers=headers, request_id=request_id or None)
    except InvalidRequest as exc:
        log.debug("request_unparsed", error=str(exc))
        return None
