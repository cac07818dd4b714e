"""Backend adapters: everything engine-specific about talking to one backend.

A backend kind (``openai``, ``vllm``, ``tensorrt-llm``...) is registered through the
``kvroute_register_backend_kinds`` hook with a factory ``factory(backend, **options)``
returning an object that follows `BackendAdapter`. The core ships ``openai``: any
OpenAI-compatible server, probed on ``/health``, with no engine telemetry.

Optional capabilities, each declared as a `runtime_checkable` protocol below (`Probes`,
`ListsModels`, `PollsLoad`, `StreamsEvents`, `Closes`): the proxy's health checker calls them when
an adapter has them, and falls back to plain HTTP on the paths otherwise. Each is given an
`HttpGetter` bound to the backend's base URL, its credentials and the probe timeout (a client may
also offer ``with_timeout(seconds)`` for engine endpoints that hold their answer):

* ``probe(http) -> bool``: is the engine able to serve? (default: ``GET health_path`` is 200)
* ``list_models(http) -> list[str]``: served model ids (default: parse ``GET models_path``)
* ``poll_load(http) -> EngineLoad | None``: the engine's load telemetry, stored with
  ``Fleet.update_load`` so strategies can read it (default: none)
* ``run_events(http, sink, *, task_status)``: a long-running task that feeds the engine's KV
  cache events into ``sink`` (a `KvEventSink`, see `kv_event_sink`) until cancelled. The
  proxy starts it in its task group, once per backend, when the strategy offers a sink;
  ``http`` may also have ``post`` (`HttpClient`). It handles its own reconnects and never
  raises except on cancellation.

Transport errors raised from these methods count as a failed probe / a skipped poll.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from kvroute.backend import Backend, EngineLoad

__all__ = [
    "BackendAdapter",
    "Closes",
    "HttpClient",
    "HttpGetter",
    "HttpReply",
    "KvEventSink",
    "ListsModels",
    "OpenAIAdapter",
    "PollsLoad",
    "Probes",
    "StreamsEvents",
    "kv_event_sink",
    "parse_model_list",
    "set_backend_exact",
]


@attrs.frozen
class HttpReply:
    """A small HTTP response as adapters see it: status and the whole body."""

    status: int
    body: bytes = b""

    def json(self) -> Any:
        """The body parsed as JSON (raises ``ValueError`` when it is not JSON)."""
        return json.loads(self.body)


class HttpGetter(Protocol):
    """What adapters use to talk to their backend; paths are relative to its base URL."""

    async def get(self, path: str) -> HttpReply:
        """``GET path``; raises ``OSError`` or ``TimeoutError`` on transport failures."""
        ...


class HttpClient(HttpGetter, Protocol):
    """An `HttpGetter` that can also POST JSON (KV event polling, ``/tokenize``)."""

    async def post(self, path: str, body: object) -> HttpReply:
        """``POST path`` with ``body`` as JSON; raises ``OSError`` or ``TimeoutError`` on transport failures."""
        ...


@runtime_checkable
class KvEventSink(Protocol):
    """Where adapters send an engine's KV cache events, per backend id.

    The tokenizer-prefix strategy's block index follows it. Token ids are the stored blocks'
    ids, flat; the sink recomputes its own block hashes from them (never the engine's), and
    keeps the engine's hashes only to resolve later removals and parents.
    """

    #: Tokens per block the sink hashes with; events of another block size cannot be applied.
    block_size: int

    def set_exact(self, backend: str, exact: bool = True) -> None:
        """Mark ``backend`` as fed by KV events (``False``: back to the strategy's own records).

        ``exact`` must be true only while no event of that backend could have been skipped or
        lost since its blocks were last cleared. A sink may also accept an optional keyword
        ``reason: str | None`` (why the backend is not exact, e.g. ``"lost_batches"``);
        adapters pass it through `set_backend_exact`, which leaves it out for sinks that do not.
        """
        ...

    def blocks_stored(
        self,
        backend: str,
        token_ids: Sequence[int],
        *,
        block_size: int,
        parent_engine_hash: int | None = None,
        engine_hashes: Sequence[int] | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        """Full blocks of ``token_ids`` were stored, continuing the block ``parent_engine_hash``."""
        ...

    def blocks_removed(self, backend: str, engine_hashes: Iterable[int] = ()) -> int:
        """Blocks named by the engine's hashes were evicted; returns how many were known."""
        ...

    def all_cleared(self, backend: str) -> None:
        """The engine dropped every cached block (cache reset or restart)."""
        ...


def _takes_reason(method: object) -> bool:
    try:
        parameters = inspect.signature(method).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return "reason" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def set_backend_exact(sink: KvEventSink, backend: str, exact: bool, *, reason: str | None = None) -> None:
    """``sink.set_exact(backend, exact)``, with ``reason=`` when the sink's ``set_exact`` accepts that keyword."""
    if reason is not None and _takes_reason(sink.set_exact):
        sink.set_exact(backend, exact, reason=reason)  # type: ignore[call-arg]
    else:
        sink.set_exact(backend, exact)


def kv_event_sink(strategy: object) -> KvEventSink | None:
    """The KV event sink a strategy offers: its ``kv_event_sink``, else its ``index``, if a `KvEventSink`."""
    for name in ("kv_event_sink", "index"):
        candidate = getattr(strategy, name, None)
        if candidate is not None and isinstance(candidate, KvEventSink):
            return candidate
    return None


def parse_model_list(data: object) -> list[str]:
    """Model ids from OpenAI's ``{"object": "list", "data": [{"id": ...}]}``; ``ValueError`` otherwise."""
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise ValueError(f"expected an object with a 'data' list of models (got {type(data).__name__}).")
    ids = [m.get("id") for m in data["data"] if isinstance(m, dict)]
    return [i for i in ids if isinstance(i, str) and i]


@runtime_checkable
class BackendAdapter(Protocol):
    """What the proxy needs to know about one backend's engine."""

    backend: Backend

    #: Path answering 200 when the engine can serve (probed by active health checks).
    health_path: str
    #: Path listing served models in OpenAI's ``{"object": "list", "data": [...]}`` shape.
    models_path: str


# -- optional capabilities, declared ----------------------------------------------------
# A host (the proxy, an embedding gateway) asks ``isinstance(adapter, PollsLoad)`` rather than
# probing attribute names; an adapter has a capability by having the method.


@runtime_checkable
class Probes(Protocol):
    """An adapter that decides itself whether its engine can serve (else: ``GET health_path`` is 200)."""

    async def probe(self, http: HttpGetter) -> bool:
        """True when the engine can serve; raise ``ValueError`` with the engine's reason when it cannot."""
        ...


@runtime_checkable
class ListsModels(Protocol):
    """An adapter that reads the engine's served model ids."""

    async def list_models(self, http: HttpGetter) -> list[str]:
        """The served model ids; ``ValueError`` on a non-200 or a malformed answer."""
        ...


@runtime_checkable
class PollsLoad(Protocol):
    """An adapter that reads the engine's load telemetry (stored with ``Fleet.update_load``)."""

    async def poll_load(self, http: HttpGetter) -> EngineLoad | None:
        """The engine's load now, or ``None`` while it has reported none."""
        ...


@runtime_checkable
class StreamsEvents(Protocol):
    """An adapter that feeds the engine's KV cache events into a `KvEventSink` until cancelled."""

    async def run_events(self, http: HttpGetter, sink: KvEventSink, *, task_status: Any = ...) -> None:
        """Follow the engine's events into ``sink``; handles its own reconnects, raises only on cancellation."""
        ...


@runtime_checkable
class Closes(Protocol):
    """An adapter holding resources (a pending call, a socket) to release when its backend goes away."""

    async def aclose(self) -> None:
        """Release them; called once when the backend is removed or the host stops."""
        ...


@attrs.define
class OpenAIAdapter:
    """Any OpenAI-compatible server: health on ``/health``, models on ``/v1/models``, no telemetry."""

    backend: Backend
    health_path: str = "/health"
    models_path: str = "/v1/models"

    @classmethod
    def create(cls, backend: Backend, **options: Any) -> OpenAIAdapter:
        """Factory registered for kind ``openai``; options override the paths."""
        return cls(backend, **options)

    async def probe(self, http: HttpGetter) -> bool:
        """Healthy when ``health_path`` answers 200."""
        return (await http.get(self.health_path)).status == 200

    async def list_models(self, http: HttpGetter) -> list[str]:
        """The ids listed at ``models_path``; ``ValueError`` on a non-200 or a malformed body."""
        reply = await http.get(self.models_path)
        if reply.status != 200:
            raise ValueError(f"{self.models_path} answered {reply.status}, expected 200.")
        return parse_model_list(reply.json())
