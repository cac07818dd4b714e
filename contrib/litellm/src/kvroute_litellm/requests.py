"""Turn what LiteLLM's Router hands a routing strategy into a `kvroute.RouteRequest`.

LiteLLM calls a custom strategy with the model group, the chat ``messages`` (or the
``input`` of an embedding / text completion) and the call's keyword arguments. The
routing text is rendered exactly as ``kvroute serve`` renders the same OpenAI body, so a
gateway and a standalone proxy hash the same prefix for the same request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvroute import AFFINITY_HEADER, LORA_HEADER, InvalidRequest, RouteRequest
from kvroute.logs import get_logger

__all__ = ["METADATA_AFFINITY_KEY", "metadata_of", "route_request"]

log = get_logger(__name__)

#: A metadata key a caller may set to pin requests to one routing key (a session id).
METADATA_AFFINITY_KEY = "kvroute_affinity_key"


def metadata_of(kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The call's metadata dict (``litellm_metadata`` on newer endpoints, else ``metadata``), or None."""
    for name in ("litellm_metadata", "metadata"):
        value = kwargs.get(name)
        if isinstance(value, dict):
            return value
    return None


def _headers(request_kwargs: Mapping[str, Any]) -> dict[str, str]:
    """Lower-cased headers from the places LiteLLM keeps them: the proxy's metadata and extra_headers."""
    found: dict[str, str] = {}
    metadata = metadata_of(request_kwargs) or {}
    for source in (metadata.get("headers"), request_kwargs.get("extra_headers"), request_kwargs.get("headers")):
        if isinstance(source, Mapping):
            for key, value in source.items():
                if isinstance(key, str) and isinstance(value, str):
                    found[key.lower()] = value
    affinity = metadata.get(METADATA_AFFINITY_KEY)
    if isinstance(affinity, str) and affinity:
        found[AFFINITY_HEADER] = affinity
    return found


def _prompt_of(input: object) -> object:
    """An embedding/text-completion ``input`` as an OpenAI ``prompt`` value."""
    if isinstance(input, str | list):
        return input
    return str(input)


def route_request(
    model: str,
    messages: Sequence[Mapping[str, Any]] | None,
    input: object,
    request_kwargs: Mapping[str, Any] | None,
) -> RouteRequest:
    """Build the routing request for one LiteLLM call.

    Chat calls render their ``messages`` (and ``tools``); other calls use ``input`` or
    ``prompt`` as a completions prompt. ``cache_salt`` (top level or in ``extra_body``) and
    the affinity / LoRA headers are honoured like in ``kvroute serve``. A body kvroute cannot
    parse (LiteLLM accepts shapes OpenAI does not) is routed on its string form instead of
    failing the call: routing is best effort, the provider validates the request.
    """
    kwargs = request_kwargs or {}
    body: dict[str, Any] = {"model": model}
    extra_body = kwargs.get("extra_body")
    salt = kwargs.get("cache_salt")
    if salt is None and isinstance(extra_body, Mapping):
        salt = extra_body.get("cache_salt")
    if salt is not None:
        body["cache_salt"] = salt
    if kwargs.get("tools") is not None:
        body["tools"] = kwargs["tools"]
    headers = _headers(kwargs)
    if messages:
        body["messages"] = list(messages)
        endpoint = "chat"
    else:
        prompt = input if input is not None else kwargs.get("prompt", kwargs.get("input"))
        body["prompt"] = _prompt_of(prompt) if prompt is not None else ""
        endpoint = "completions"
    try:
        return RouteRequest.from_openai(body, endpoint=endpoint, headers=headers)  # type: ignore[arg-type]
    except InvalidRequest as exc:
        log.warning("request_unparsed", model=model, error=str(exc))
        try:
            text = str(body.get("messages", body.get("prompt", "")))
        except (RecursionError, ValueError):  # nested too deeply, or an int too long to print
            text = ""
        return RouteRequest.from_text(
            text,
            model=model,
            affinity_key=headers.get(AFFINITY_HEADER),
            lora=headers.get(LORA_HEADER),
            cache_salt=salt if isinstance(salt, str) else None,
        )
