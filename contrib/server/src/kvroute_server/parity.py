"""``kvroute check-parity``: does the router tokenize prompts exactly as the engine does?

A prefix-aware router that tokenizes differently from its engines (another tokenizer
revision, a different chat template, a missing BOS) computes block hashes that never match
what the engines cache, and nothing fails loudly: hit rates just stay low. This check sends
sample prompts and chat conversations to the engine's ``POST /tokenize`` and compares the ids
with the router's own (the strategy's ``prompt_tokenizer``, built from the same options the
proxy would use). Engines without ``/tokenize`` (TensorRT-LLM) are compared on the prompt
token counts their completions report in ``usage``, a weaker check that says so.

It also reports the engine's KV block size (read through the installed backend adapters)
and whether the strategy's ``block_size`` agrees with it.

Use it from the command line (``kvroute check-parity --backend URL --tokenizer DIR``), or
call `check_backend` / `startup_check` from code; the proxy calls `startup_check` when its
strategy tokenizes (tokenizer-prefix), and logs a warning per mismatching backend.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol

import anyio
import attrs
import click
import structlog

from kvroute.adapters import HttpClient, HttpReply
from kvroute.backend import Backend
from kvroute.errors import ConfigError, InvalidRequest, KvrouteError
from kvroute.request import RouteRequest
from kvroute.strategy import HasPromptTokenizer

__all__ = [
    "ParityCase",
    "ParityReport",
    "PromptTokenizer",
    "check_backend",
    "check_parity",
    "sample_chats",
    "sample_prompts",
    "startup_check",
]

log = structlog.get_logger(__name__)

Status = Literal["ok", "mismatch", "skipped"]


class PromptTokenizer(Protocol):
    """What the check needs from the router's tokenizer: a request's prompt ids, in chunks.

    A chunk is a sequence of ids, or a ``(key, loader)`` pair whose ``loader()`` returns them
    (tokenizer-prefix's lazily tokenized pieces). A tokenizer with a ``prompt_ids(request)``
    method is asked through it instead.
    """

    def chunks(self, request: RouteRequest) -> Iterable[Any]: ...


# -- samples -------------------------------------------------------------------------------

_WORDS = (
    "the",
    "router",
    "cache",
    "block",
    "prefix",
    "engine",
    "token",
    "model",
    "request",
    "latency",
    "of",
    "and",
    "to",
    "in",
    "is",
    "a",
    "for",
    "with",
    "on",
    "that",
    "by",
    "this",
    "we",
    "are",
    "from",
    "Hello",
    "world",
    "GPU",
    "KV",
    "vLLM",
    "Überprüfung",
    "naïve",
    "café",
    "東京",
    "数据",
    "😀",
    "x86_64",
    "3.14159",
    "1,234",
    "(a)",
    "[b]",
    "{c}",
    "don't",
    "it's",
    "e.g.",
    "--flag",
    "#include",
    "<tag>",
    "ß",
    "Ωmega",
)


def _long_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(words):
        out.append(rng.choice(_WORDS))
        r = rng.random()
        if r < 0.06:
            out.append(".\n" if rng.random() < 0.5 else ".\n\n")
        elif r < 0.12:
            out.append(",")
    text = ""
    for piece in out:
        text += piece if piece in (",", ".\n", ".\n\n") or text.endswith("\n") or not text else " " + piece
    return text.strip() + "."


def sample_prompts() -> list[tuple[str, str]]:
    """Built-in completion prompts ``(name, text)``: ASCII, code, Unicode, whitespace, and a long one."""
    return [
        ("hello", "Hello world"),
        ("code", "def square(x):\n    return x ** 2  # a comment\n\nprint(square(12))\n"),
        ("unicode", "Grüße aus Köln — 東京の天気は晴れ 😀 café naïve façade"),
        ("whitespace", "  leading spaces, 3.14159 and 1,234,567\ttabs\n\nnew paragraph\n   indented\r\nCRLF"),
        ("long", _long_text(7, 1400)),
    ]


def sample_chats() -> list[tuple[str, list[dict[str, Any]]]]:
    """Built-in chat conversations ``(name, messages)``: one turn, system prompt, multi-turn, content parts, long."""
    return [
        ("chat-hello", [{"role": "user", "content": "Hello world"}]),
        (
            "chat-system",
            [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is a KV cache?"}],
        ),
        (
            "chat-turns",
            [
                {"role": "user", "content": "Name a prime."},
                {"role": "assistant", "content": "7"},
                {"role": "user", "content": "Another one, please."},
            ],
        ),
        ("chat-parts", [{"role": "user", "content": [{"type": "text", "text": "Hello from a content part."}]}]),
        ("chat-long", [{"role": "user", "content": _long_text(11, 1200)}]),
    ]


# -- results -------------------------------------------------------------------------------


@attrs.frozen
class ParityCase:
    """One sample compared: the router's ids, the engine's, and how they were compared.

    ``method`` is ``tokenize`` (ids compared one by one) or ``usage`` (only the count, from a
    one-token completion's ``usage.prompt_tokens``).
    """

    name: str
    kind: Literal["prompt", "chat"]
    status: Status
    method: Literal["tokenize", "usage", "none"] = "tokenize"
    router_count: int | None = None
    engine_count: int | None = None
    first_difference: int | None = None
    router_around: tuple[int, ...] = ()
    engine_around: tuple[int, ...] = ()
    note: str | None = None

    def describe(self) -> str:
        """One line for humans."""
        if self.status == "ok":
            return f"{self.name}: {self.router_count} tokens, identical ({self.method})"
        if self.status == "skipped":
            return f"{self.name}: skipped ({self.note})"
        if self.method == "usage":
            return f"{self.name}: router {self.router_count} tokens, engine {self.engine_count} (usage counts differ)"
        return (
            f"{self.name}: router {self.router_count} tokens, engine {self.engine_count}; first difference at token "
            f"{self.first_difference}: router {list(self.router_around)} vs engine {list(self.engine_around)}"
        )


@attrs.frozen
class ParityReport:
    """The outcome for one backend."""

    backend: str
    model: str | None
    cases: tuple[ParityCase, ...] = ()
    engine_block_size: int | None = None
    block_size_source: str | None = None
    router_block_size: int | None = None
    error: str | None = None

    @property
    def block_size_ok(self) -> bool:
        """False when the strategy hashes fixed-size blocks that differ from the engine's."""
        return (
            self.router_block_size is None
            or self.engine_block_size is None
            or self.router_block_size == self.engine_block_size
        )

    @property
    def compared(self) -> int:
        return sum(c.status != "skipped" for c in self.cases)

    @property
    def ok(self) -> bool:
        """Every compared sample matched, at least one was compared, and block sizes agree."""
        return (
            self.error is None
            and self.compared > 0
            and self.block_size_ok
            and all(c.status != "mismatch" for c in self.cases)
        )

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self, recurse=True)
        data["ok"] = self.ok
        data["block_size_ok"] = self.block_size_ok
        return data

    def lines(self) -> list[str]:
        """A human-readable report."""
        out = [f"backend {self.backend} (model {self.model or '?'})"]
        if self.error is not None:
            out.append(f"  error: {self.error}")
            return out
        if self.engine_block_size is not None:
            out.append(f"  engine block size: {self.engine_block_size} tokens ({self.block_size_source})")
        else:
            out.append("  engine block size: not reported")
        if self.router_block_size is None:
            out.append("  router block size: from the engine (strategy option block_size unset)")
        else:
            agree = (
                "agrees"
                if self.block_size_ok
                else "DIFFERS: set the strategy's block_size to the engine's or leave it unset"
            )
            out.append(f"  router block size: {self.router_block_size} ({agree})")
        out.extend("  " + c.describe() for c in self.cases)
        verdict = "PASS" if self.ok else "FAIL"
        mismatches = sum(c.status == "mismatch" for c in self.cases)
        out.append(f"  {verdict}: {self.compared - mismatches}/{self.compared} samples identical")
        return out


# -- comparing -----------------------------------------------------------------------------


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


async def startup_check(
    strategy: object,
    targets: Iterable[tuple[str, str, HttpClient]],
    *,
    kinds: Mapping[str, Callable[..., Any]] | None = None,
    prompts: Sequence[tuple[str, str]] | None = None,
    chats: Sequence[tuple[str, list[dict[str, Any]]]] | None = None,
) -> list[ParityReport]:
    """The proxy's check at startup: each ``(backend id, url, client)`` against the strategy's tokenizer.

    Does nothing (returns ``[]``) when the strategy has no ``prompt_tokenizer``. Logs
    ``tokenizer_parity_ok`` per matching backend and a ``tokenizer_parity_mismatch`` warning
    with the details per mismatching one; never raises on a backend's failure.
    """
    tokenizer = strategy.prompt_tokenizer if isinstance(strategy, HasPromptTokenizer) else None
    if tokenizer is None:
        return []
    fixed = getattr(strategy, "block_size", None)
    reports = []
    for backend_id, url, http in targets:
        if getattr(http, "post", None) is None:
            log.warning("tokenizer_parity_unchecked", backend=backend_id, reason="the HTTP client cannot POST")
            continue
        report = await check_backend(
            http,
            tokenizer,
            backend=url,
            prompts=prompts,
            chats=chats,
            router_block_size=fixed if isinstance(fixed, int) else None,
            kinds=kinds,
        )
        reports.append(report)
        if report.ok:
            log.info(
                "tokenizer_parity_ok",
                backend=backend_id,
                samples=report.compared,
                engine_block_size=report.engine_block_size,
            )
        else:
            log.warning(
                "tokenizer_parity_mismatch",
                backend=backend_id,
                tokenizer=getattr(tokenizer, "name", type(tokenizer).__name__),
                details=[line.strip() for line in report.lines()[1:]],
                hint="the router's prefix blocks will not match what this engine caches: configure the strategy's "
                "'tokenizer' and 'chat_template' to the engine's model (kvroute check-parity shows each difference)",
            )
    return reports


# -- command line --------------------------------------------------------------------------


class _Client:
    """A small aiohttp client bound to one base URL (the command line's `HttpClient`)."""

    def __init__(self, base_url: str, timeout: float, api_key: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: Any = None

    async def __aenter__(self) -> _Client:
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout), headers=self.headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    async def _call(self, method: str, path: str, body: object = None) -> HttpReply:
        import aiohttp

        url = self.base_url + path
        try:
            async with self._session.request(method, url, json=body) as response:
                return HttpReply(response.status, await response.read())
        except aiohttp.ClientError as exc:
            raise OSError(f"{method} {url} failed: {type(exc).__name__}: {exc}") from exc

    async def get(self, path: str) -> HttpReply:
        return await self._call("GET", path)

    async def post(self, path: str, body: object) -> HttpReply:
        return await self._call("POST", path, body)


def _build_tokenizer(strategy_name: str, options: dict[str, str]) -> tuple[Any, int | None]:
    from kvroute.plugins import PluginManager

    strategy = PluginManager().create_strategy(strategy_name, options)
    tokenizer = strategy.prompt_tokenizer if isinstance(strategy, HasPromptTokenizer) else None
    if tokenizer is None:
        raise ConfigError(f"strategy {strategy_name!r} does not tokenize prompts (it has no prompt_tokenizer).")
    fixed = getattr(strategy, "block_size", None)
    return tokenizer, fixed if isinstance(fixed, int) else None


async def _run(
    urls: Sequence[str],
    strategy_name: str,
    options: dict[str, str],
    model: str | None,
    prompts: list[tuple[str, str]],
    chats: list[tuple[str, list[dict[str, Any]]]],
    kind: str | None,
    http_timeout: float,
    api_key: str | None,
) -> list[ParityReport]:
    reports = []
    for url in urls:
        async with _Client(url, http_timeout, api_key) as http:
            local = dict(options)
            if "tokenizer" not in local:
                try:
                    models = await _models(http)
                except (OSError, TimeoutError, ValueError) as exc:
                    reports.append(ParityReport(url, model, error=f"{type(exc).__name__}: {exc}"))
                    continue
                entry = next((m for m in models if model is None or m["id"] == model), None)
                root = entry.get("root") if entry else None
                from pathlib import Path

                if not (isinstance(root, str) and (Path(root) / "tokenizer.json").is_file()):
                    raise ConfigError(
                        "give --tokenizer (a tokenizer.json, a model directory or a cached Hub id): "
                        f"the engine at {url} serves {root!r}, which is not a model directory on this machine."
                    )
                local["tokenizer"] = root
            tokenizer, fixed = _build_tokenizer(strategy_name, local)
            reports.append(
                await check_backend(
                    http,
                    tokenizer,
                    backend=url,
                    model=model,
                    prompts=prompts,
                    chats=chats,
                    router_block_size=fixed,
                    kind=kind,
                )
            )
    return reports


@click.command("check-parity")
@click.option(
    "--backend", "backends", multiple=True, required=True, metavar="URL", help="An engine's base URL (repeatable)."
)
@click.option(
    "--tokenizer",
    help=(
        "The router's tokenizer: tokenizer.json, model directory or cached Hub id "
        "[default: the engine's model directory when it is on this machine]."
    ),
)
@click.option("--chat-template", help="A chat template file or text overriding the tokenizer's.")
@click.option(
    "--strategy",
    "strategy_name",
    default="tokenizer-prefix",
    show_default=True,
    help="The strategy whose tokenizer is checked.",
)
@click.option(
    "--option",
    "options",
    multiple=True,
    metavar="KEY=VALUE",
    help="A strategy option, as for kvroute serve (repeatable).",
)
@click.option("--model", help="Model name sent to the engine [default: the first one it lists].")
@click.option("--kind", help="Backend kind whose adapter reads the block size [default: try the installed ones].")
@click.option("--prompt", "extra_prompts", multiple=True, help="An extra completion prompt to compare (repeatable).")
@click.option(
    "--messages",
    "extra_messages",
    multiple=True,
    metavar="JSON",
    help="An extra chat, as a JSON list of messages (repeatable).",
)
@click.option("--no-samples", is_flag=True, help="Compare only --prompt/--messages, not the built-in samples.")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds per HTTP call.")
@click.option(
    "--api-key", envvar="KVROUTE_BACKEND_API_KEY", help="Bearer token for the engine (env KVROUTE_BACKEND_API_KEY)."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def check_parity(
    backends: tuple[str, ...],
    tokenizer: str | None,
    chat_template: str | None,
    strategy_name: str,
    options: tuple[str, ...],
    model: str | None,
    kind: str | None,
    extra_prompts: tuple[str, ...],
    extra_messages: tuple[str, ...],
    no_samples: bool,
    timeout: float,
    api_key: str | None,
    as_json: bool,
) -> None:
    """Compare the router's tokenization with each engine's /tokenize, and report the engine's block size.

    Exit status: 0 when every backend matches, 1 on a mismatch, 2 when a backend could not be checked.

    \b
    Example:
      kvroute check-parity --backend http://10.0.0.1:8000 --tokenizer /models/llama-3.1-8b
    """
    opts: dict[str, str] = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE (got {item!r})", param_hint="--option")
        opts[key.strip().replace("-", "_")] = value.strip()
    if tokenizer:
        opts["tokenizer"] = tokenizer
    if chat_template:
        opts["chat_template"] = chat_template
    prompts = [] if no_samples else sample_prompts()
    prompts += [(f"prompt-{i + 1}", p) for i, p in enumerate(extra_prompts)]
    chats = [] if no_samples else sample_chats()
    for i, raw in enumerate(extra_messages):
        try:
            messages = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--messages") from None
        if not isinstance(messages, list) or not messages:
            raise click.BadParameter(
                f"expected a non-empty JSON list of messages (got {raw[:60]!r})", param_hint="--messages"
            )
        chats.append((f"messages-{i + 1}", messages))
    if not prompts and not chats:
        raise click.UsageError("nothing to compare: give --prompt or --messages with --no-samples.")
    try:
        reports = anyio.run(_run, backends, strategy_name, opts, model, prompts, chats, kind, timeout, api_key)
    except KvrouteError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps([r.to_json() for r in reports], indent=2))
    else:
        for report in reports:
            for line in report.lines():
                click.echo(line)
    if any(r.error is not None for r in reports):
        sys.exit(2)
    if not all(r.ok for r in reports):
        sys.exit(1)
