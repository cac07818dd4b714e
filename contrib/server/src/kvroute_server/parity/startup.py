"""The proxy's check at startup: every routable backend against the strategy's tokenizer, logged."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import structlog

from kvroute.adapters import HttpClient
from kvroute.strategy import HasPromptTokenizer
from kvroute_server.parity.compare import check_backend
from kvroute_server.parity.report import ParityReport

__all__ = ["startup_check"]

# One logger name for every module of the check: what a host that filters or routes logs by name matches.
log = structlog.get_logger("kvroute_server.parity")


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
