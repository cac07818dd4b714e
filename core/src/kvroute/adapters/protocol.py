"""What an adapter and its host agree on: the HTTP client, the KV event sink, the capability protocols.

See `kvroute.adapters` for the whole plugin API; this module holds only the protocols and the two
helpers that talk to a sink (`set_backend_exact`, `set_backend_capacity`).
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
    "PollsLoad",
    "Probes",
    "StreamsEvents",
    "kv_event_sink",
    "set_backend_capacity",
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

    def raise_for_status(self, path: str) -> HttpReply:
        """This reply when its status is 200; otherwise ``ValueError`` naming ``path`` and the status it got."""
        if self.status != 200:
            raise ValueError(f"{path} answered {self.status}, expected 200.")
        return self


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
    keeps the engine's hashes only to resolve later removals and parents. A sink may also have
    ``set_capacity(backend, blocks)`` (the engine's KV cache size; adapters call it through
    `set_backend_capacity`).
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


def set_backend_capacity(sink: KvEventSink, backend: str, blocks: int | None) -> bool:
    """``sink.set_capacity(backend, blocks)`` when the sink has that optional method and ``blocks`` is known.

    The capacity is the engine's KV cache size in blocks: a sink that bounds what it keeps per backend
    holds no more than the engine can. Returns whether the sink was told.
    """
    set_capacity = getattr(sink, "set_capacity", None)
    if not blocks or set_capacity is None:
        return False
    set_capacity(backend, blocks)
    return True


def kv_event_sink(strategy: object) -> KvEventSink | None:
    """The KV event sink a strategy offers: its ``kv_event_sink``, else its ``index``, if a `KvEventSink`."""
    for name in ("kv_event_sink", "index"):
        candidate = getattr(strategy, name, None)
        if candidate is not None and isinstance(candidate, KvEventSink):
            return candidate
    return None


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
