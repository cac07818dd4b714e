"""The comparison: the router's prompt ids against one engine's ``/tokenize`` (or its usage counts), and the
engine's KV block size read through the installed backend adapters."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol

import anyio

from kvroute.adapters import HttpClient, HttpReply
from kvroute.backend import Backend
from kvroute.errors import ConfigError, InvalidRequest
from kvroute.request import RouteRequest
from kvroute_server.parity.report import ParityCase, ParityReport, Status
from kvroute_server.parity.samples import sample_chats, sample_prompts

__all__ = ["PromptTokenizer", "check_backend", "engine_block_size"]


class PromptTokenizer(Protocol):
    """What the check needs from the router's tokenizer: a request's prompt ids, in chunks.

    A chunk is a sequence of ids, or a ``(key, loader)`` pair whose ``loader()`` returns them
    (tokenizer-prefix's lazily tokenized pieces). A tokenizer with a ``prompt_ids(request)``
    method is asked through it instead.
    """

    def chunks(self, request: RouteRequest) -> Iterable[Any]: ...


def _router_ids(tokenizer: PromptTokenizer, request: RouteRequest) -> list[int]:
    whole = getattr(tokenizer, "prompt_ids", None)
    if callable(whole):
        return [int(t) for t in whole(request)]
    out: list[int] = []
    for chunk in tokenizer.chunks(request):
        if isinstance(chunk, tuple) and len(chunk) == 2 and callable(chunk[1]):
            chunk = chunk[1]()
        out.extend(int(t) for t in chunk)
    return out


def _compare(name: str, kind: Literal["prompt", "chat"], router: list[int], engine: list[int]) -> ParityCase:
    if router == engine:
        return ParityCase(name, kind, "ok", "tokenize", len(router), len(engine))
    at = next(
        (i for i, (a, b) in enumerate(zip(router, engine, strict=False)) if a != b), min(len(router), len(engine))
    )
    lo = max(0, at - 3)
    return ParityCase(
        name,
        kind,
        "mismatch",
        "tokenize",
        len(router),
        len(engine),
        at,
        tuple(router[lo : at + 4]),
        tuple(engine[lo : at + 4]),
    )


def _error_text(reply: HttpReply) -> str:
    try:
        data = reply.json()
        message = data.get("error", {}).get("message") if isinstance(data.get("error"), dict) else data.get("message")
        if message:
            return f"{reply.status}: {str(message)[:200]}"
    except (ValueError, AttributeError):
        pass
    return f"{reply.status}: {reply.body[:200].decode('utf-8', 'replace')}"


async def _engine_ids(http: HttpClient, body: Mapping[str, Any]) -> tuple[list[int] | None, str | None, int]:
    """(ids, problem, status) from ``POST /tokenize``."""
    reply = await http.post("/tokenize", dict(body))
    if reply.status != 200:
        return None, _error_text(reply), reply.status
    data = reply.json()
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        return None, f"/tokenize answered without a 'tokens' list of integers: {str(data)[:120]}", reply.status
    return tokens, None, reply.status


async def _usage_count(http: HttpClient, path: str, body: Mapping[str, Any]) -> tuple[int | None, str | None]:
    reply = await http.post(path, {**body, "max_tokens": 1, "stream": False})
    if reply.status != 200:
        return None, _error_text(reply)
    data = reply.json()
    usage = data.get("usage") if isinstance(data, dict) else None
    count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if not isinstance(count, int):
        return None, f"{path} answered without usage.prompt_tokens"
    return count, None


async def _models(http: HttpClient) -> list[dict[str, Any]]:
    reply = await http.get("/v1/models")
    if reply.status != 200:
        raise ValueError(f"/v1/models answered {_error_text(reply)}")
    data = reply.json()
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise ValueError("/v1/models did not answer OpenAI's {'object': 'list', 'data': [...]}")
    return [m for m in data["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]


async def engine_block_size(
    http: HttpClient, url: str, kinds: Mapping[str, Callable[..., Any]], prefer: str | None = None
) -> tuple[int | None, str | None]:
    """The engine's block size through the installed adapters (``prefer`` first): ``(size, "kind adapter")``."""
    order = [prefer] if prefer is not None and prefer in kinds else []
    order += [k for k in ("vllm", "tensorrt-llm") if k in kinds and k != prefer]
    order += [k for k in kinds if k not in order]
    for kind in order:
        try:
            adapter = kinds[kind](Backend(id="parity-check", url=url, kind=kind))
        except (TypeError, ValueError):
            continue
        poll = getattr(adapter, "poll_load", None)
        if poll is None:
            continue
        try:
            with anyio.fail_after(10):
                load = await poll(http)
        except (OSError, TimeoutError, ValueError, KeyError):
            continue
        size = getattr(load, "block_size", None)
        if size:
            return int(size), f"{kind} adapter"
        if prefer == kind:
            break
    return None, None


async def check_backend(
    http: HttpClient,
    tokenizer: PromptTokenizer,
    *,
    backend: str,
    model: str | None = None,
    prompts: Sequence[tuple[str, str]] | None = None,
    chats: Sequence[tuple[str, list[dict[str, Any]]]] | None = None,
    router_block_size: int | None = None,
    kinds: Mapping[str, Callable[..., Any]] | None = None,
    kind: str | None = None,
) -> ParityReport:
    """Compare ``tokenizer`` with one engine on ``prompts`` and ``chats`` (the built-in samples by default).

    ``http`` talks to the engine (paths relative to its base URL ``backend``). ``kinds`` maps
    backend kinds to adapter factories (the installed ones by default), used to read the
    engine's block size. Transport failures end up in ``ParityReport.error``.
    """
    prompts = sample_prompts() if prompts is None else prompts
    chats = sample_chats() if chats is None else chats
    try:
        if model is None:
            models = await _models(http)
            if not models:
                return ParityReport(backend, None, error="the engine lists no model at /v1/models")
            model = str(models[0]["id"])
        cases: list[ParityCase] = []
        use_usage = False
        samples: list[tuple[str, Literal["prompt", "chat"], dict[str, Any]]] = [
            (name, "prompt", {"model": model, "prompt": text}) for name, text in prompts
        ] + [(name, "chat", {"model": model, "messages": messages}) for name, messages in chats]
        for name, what, body in samples:
            endpoint: Literal["chat", "completions"] = "chat" if what == "chat" else "completions"
            try:
                router = _router_ids(tokenizer, RouteRequest.from_openai(body, endpoint=endpoint))
            except (InvalidRequest, ConfigError) as exc:
                cases.append(ParityCase(name, what, "skipped", "none", note=f"the router cannot tokenize it: {exc}"))
                continue
            if not use_usage:
                ids, problem, status = await _engine_ids(http, body)
                if ids is not None:
                    cases.append(_compare(name, what, router, ids))
                    continue
                if status in (404, 405):
                    use_usage = True
                else:
                    cases.append(
                        ParityCase(name, what, "skipped", "none", router_count=len(router), note=f"engine: {problem}")
                    )
                    continue
            path = "/v1/chat/completions" if what == "chat" else "/v1/completions"
            count, problem = await _usage_count(http, path, body)
            if count is None:
                cases.append(
                    ParityCase(name, what, "skipped", "none", router_count=len(router), note=f"engine: {problem}")
                )
            else:
                status_: Status = "ok" if count == len(router) else "mismatch"
                cases.append(
                    ParityCase(name, what, status_, "usage", len(router), count, note="engine has no /tokenize")
                )
        if kinds is None:
            from kvroute.plugins import PluginManager

            kinds = {name: reg.factory for name, reg in PluginManager().backend_kinds.items()}
        size, source = await engine_block_size(http, backend, kinds, kind)
    except (OSError, TimeoutError, ValueError) as exc:
        return ParityReport(backend, model, error=f"{type(exc).__name__}: {exc}")
    return ParityReport(
        backend,
        model,
        tuple(cases),
        engine_block_size=size,
        block_size_source=source,
        router_block_size=router_block_size,
    )
