"""The OpenAI-compatible adapter: the ``openai`` backend kind, and the base every engine adapter extends.

`OpenAIAdapter` holds what every OpenAI-compatible server shares: the factory that checks option names
(`OpenAIAdapter.create`), the health probe that carries the engine's reason when it fails, and the
served models. An engine adapter subclasses it with ``@attrs.define`` and adds its own options (attrs
fields with converters, such as `check_path`) and capabilities (``poll_load``, ``run_events``...).

`EngineMetrics` is what an adapter read of an engine's load telemetry; engines extend it with their own
fields and hand the core an `EngineLoad` with `EngineMetrics.to_load`. `prometheus_subset` keeps the
lines of the families an adapter reads from a Prometheus exposition, before it goes through a parser.
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection
from typing import Any, Self

import attrs

from kvroute.adapters.protocol import HttpGetter
from kvroute.backend import Backend, EngineLoad, RankLoad

__all__ = ["EngineMetrics", "OpenAIAdapter", "check_path", "parse_model_list", "prometheus_subset"]

_METRIC_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def check_path(value: object, name: str, *, allow_empty: bool = False) -> str:
    """An adapter option naming a path on the server: it starts with ``/`` (``allow_empty``: or is ``""``, off)."""
    if allow_empty and value in ("", None):
        return ""
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError(
            f"'{name}' must be a path starting with '/'{' or empty' if allow_empty else ''} (got {value!r})."
        )
    return value


def _health_path(value: object) -> str:
    return check_path(value, "health_path")


def _models_path(value: object) -> str:
    return check_path(value, "models_path")


def parse_model_list(data: object) -> list[str]:
    """Model ids from OpenAI's ``{"object": "list", "data": [{"id": ...}]}``; ``ValueError`` otherwise."""
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise ValueError(f"expected an object with a 'data' list of models (got {type(data).__name__}).")
    ids = [m.get("id") for m in data["data"] if isinstance(m, dict)]
    return [i for i in ids if isinstance(i, str) and i]


@attrs.define
class OpenAIAdapter:
    """Any OpenAI-compatible server: health on ``health_path``, models on ``models_path``, no telemetry.

    Registered as kind ``openai``, and the base of the engine adapters (``vllm``, ``tensorrt-llm``):
    a subclass keeps `create`, `probe` and `list_models` and adds what its engine has.
    """

    backend: Backend
    #: Path answering 200 when the engine can serve.
    health_path: str = attrs.field(default="/health", converter=_health_path)
    #: Path listing served models in OpenAI's ``{"object": "list", "data": [...]}`` shape.
    models_path: str = attrs.field(default="/v1/models", converter=_models_path)

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The option names `create` accepts: the attrs fields set in ``__init__``, but ``backend``."""
        return frozenset(a.name for a in attrs.fields(cls) if a.init and a.name != "backend")

    @classmethod
    def create(cls, backend: Backend, **options: Any) -> Self:
        """The factory to register for a backend kind; ``ValueError`` names options this adapter does not have."""
        known = cls.option_names()
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown option(s) {', '.join(map(repr, unknown))} (expected some of: {', '.join(sorted(known))})."
            )
        return cls(backend, **options)

    async def probe(self, http: HttpGetter) -> bool:
        """True when ``health_path`` answers 200; otherwise ``ValueError`` carrying the status and the engine's reason.

        The health checker counts the error as a failed probe and logs its text when it ejects the backend.
        """
        reply = await http.get(self.health_path)
        if reply.status == 200:
            return True
        reason = reply.body[:200].decode("utf-8", "replace").strip()
        raise ValueError(f"{self.health_path} answered {reply.status}{': ' + reason if reason else ''}")

    async def list_models(self, http: HttpGetter) -> list[str]:
        """The ids listed at ``models_path``; ``ValueError`` on a non-200 or a malformed body."""
        reply = (await http.get(self.models_path)).raise_for_status(self.models_path)
        return parse_model_list(reply.json())


@attrs.frozen
class EngineMetrics:
    """What one read of an engine's load telemetry says; ``None`` = not reported.

    The fields are `EngineLoad`'s (``prefix_cache_*`` in tokens, cumulative); an engine's subclass adds
    its own (capacity, start time, per-rank rows...), which `to_load` leaves out.
    """

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    block_size: int | None = None
    #: The KV cache's size in blocks (an engine's subclass fills it from its own report, e.g. vLLM's
    #: ``num_gpu_blocks``).
    kv_blocks: int | None = None
    #: Data-parallel ranks the engine reports, and each rank's load (engines that report per rank).
    data_parallel_size: int | None = None
    ranks: tuple[RankLoad, ...] = ()

    def to_load(self, observed_at: float | None = None) -> EngineLoad:
        """The core's `EngineLoad`, stamped ``observed_at`` (a ``time.monotonic()`` reading, default now).

        The stamp is when the engine was read, not when the load is handed over: a value read earlier and
        given again ages, and strategies stop trusting it (`BackendState.fresh_load`).
        """
        values = {a.name: getattr(self, a.name) for a in attrs.fields(EngineMetrics)}
        return EngineLoad(**values, observed_at=time.monotonic() if observed_at is None else observed_at)


def prometheus_subset(text: str, names: Collection[str]) -> str:
    """The lines of a Prometheus exposition about ``names``: their samples and their ``# HELP``/``# TYPE`` lines.

    ``names`` holds family names (as in ``# TYPE``) and sample names (with ``_total``, ``_sum``... as
    exposed). An engine's whole exposition can be hundreds of lines; a parser run on the few an adapter
    reads costs a fraction of it.
    """
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2] in names:
                out.append(line)
            continue
        found = _METRIC_NAME.match(line)
        if found is not None and found.group(0) in names:
            out.append(line)
    return "\n".join(out) + "\n"
