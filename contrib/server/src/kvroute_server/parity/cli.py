"""``kvroute check-parity``: the command line over `kvroute_server.parity.check_backend`."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import anyio
import click

from kvroute.adapters import HttpReply
from kvroute.errors import ConfigError, KvrouteError
from kvroute.strategy import HasPromptTokenizer
from kvroute.validators import parse_key_values
from kvroute_server.parity.compare import _models, check_backend
from kvroute_server.parity.report import ParityReport
from kvroute_server.parity.samples import sample_chats, sample_prompts

__all__ = ["check_parity"]


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
    opts = dict(
        parse_key_values(
            options, lambda item: click.BadParameter(f"expected KEY=VALUE (got {item!r})", param_hint="--option")
        )
    )
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
