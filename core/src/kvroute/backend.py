"""Backends: a frozen identity (`Backend`) and the live state the router keeps for it."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from types import MappingProxyType

import attrs
from attrs import validators as v

from kvroute.validators import expect

__all__ = ["Backend", "BackendState", "EngineLoad", "RankLoad"]


_positive = expect("> 0", v.gt(0), error=ValueError)
_size = expect("an integer from 1 to 65536", v.instance_of(int), v.ge(1), v.le(1 << 16), error=ValueError)
_non_empty = expect("a non-empty string", v.instance_of(str), v.min_len(1), error=ValueError)


def _frozen_mapping(value: Mapping[str, str] | None) -> Mapping[str, str]:
    return MappingProxyType(dict(value or {}))


def _models(value: Iterable[str] | str | None) -> frozenset[str]:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        return frozenset({value})
    return frozenset(value)


@attrs.frozen
class Backend:
    """Who a backend is: id, base URL, engine kind, capacity weight, served models, labels.

    ``models`` are the declared ones; empty means "serves whatever it is asked for". What the
    engine itself reports serving is live state (`BackendState.served_models`) and wins once known.
    ``weight`` is relative capacity: a backend of weight 2 should take twice the share.
    ``data_parallel_size`` is how many data-parallel ranks (separate KV caches behind the one URL,
    as a vLLM server started with ``--data-parallel-size N`` holds) the configuration declares;
    an engine may report more (`BackendState.data_parallel_size`).
    """

    id: str = attrs.field(validator=_non_empty)
    url: str = ""
    kind: str = "openai"
    weight: float = attrs.field(default=1.0, converter=float, validator=_positive)
    models: frozenset[str] = attrs.field(factory=frozenset, converter=_models)
    labels: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_mapping, hash=False)
    data_parallel_size: int = attrs.field(default=1, validator=_size)

    def serves(self, model: str | None) -> bool:
        """Whether the declared models allow ``model`` (``None`` matches everything)."""
        return model is None or not self.models or model in self.models


@attrs.frozen
class RankLoad:
    """What an engine reported about one of its data-parallel ranks (vLLM's ``engine`` label); ``None``: not said."""

    rank: int
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None

    @property
    def requests(self) -> int:
        """Requests on this rank: running plus waiting (what is known of them)."""
        return (self.running or 0) + (self.waiting or 0)


@attrs.frozen
class EngineLoad:
    """The latest load an adapter read from the engine itself; every field is optional.

    ``observed_at`` is a ``time.monotonic()`` reading. Counters are cumulative as the engine
    reports them (``prefix_cache_hits`` / ``prefix_cache_queries`` in tokens). ``kv_blocks`` is
    the KV cache's size in blocks of ``block_size`` tokens (vLLM's ``num_gpu_blocks``,
    TensorRT-LLM's ``maxNumBlocks``): what running requests and cached prefixes share.
    """

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    block_size: int | None = None
    kv_blocks: int | None = None
    observed_at: float = attrs.field(factory=time.monotonic)
    #: Data-parallel ranks the engine reports (its ``/kv_event_sources`` entries, its metrics' engines).
    data_parallel_size: int | None = None
    #: Per-rank load, in rank order, when the engine reports it per rank.
    ranks: tuple[RankLoad, ...] = ()

    @property
    def kv_tokens(self) -> int | None:
        """The KV cache's size in tokens (``kv_blocks * block_size``), ``None`` unless both are known."""
        if self.kv_blocks is None or not self.block_size:
            return None
        return self.kv_blocks * self.block_size

    def age(self, now: float | None = None) -> float:
        """Seconds since the engine was read."""
        return (time.monotonic() if now is None else now) - self.observed_at


@attrs.define
class BackendState:
    """A backend plus what the router knows about it right now.

    Strategies read these objects (``in_flight``, ``weight``, ``load``, ``serves``) but never
    write them; the `Fleet` and the `Router` do, under the fleet's lock.
    """

    backend: Backend
    in_flight: int = 0
    healthy: bool = True
    draining: bool = False
    load: EngineLoad | None = None
    #: Seconds after which ``load`` counts as stale (``fresh_load`` returns ``None``).
    load_max_age: float = 10.0
    #: The models the engine reported serving (`Fleet.set_served_models`, from the host's
    #: discovery); ``None`` until it has, and meanwhile the declared ``backend.models`` count.
    served_models: frozenset[str] | None = None

    @property
    def id(self) -> str:
        return self.backend.id

    @property
    def weight(self) -> float:
        return self.backend.weight

    @property
    def models(self) -> frozenset[str]:
        """The models routing filters on: the reported ones once known, else the declared ones (empty: any)."""
        return self.backend.models if self.served_models is None else self.served_models

    def serves(self, model: str | None) -> bool:
        """Whether this backend may be asked for ``model`` (``None`` matches everything; see `models`)."""
        if model is None:
            return True
        models = self.backend.models if self.served_models is None else self.served_models
        return not models or model in models

    @property
    def routable(self) -> bool:
        """Healthy and not draining: may take new requests."""
        return self.healthy and not self.draining

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks behind this backend: the configured count, or more when the engine reported more."""
        configured = self.backend.data_parallel_size
        reported = self.load.data_parallel_size if self.load is not None else None
        return max(configured, reported or 1)

    def fresh_load(self, now: float | None = None) -> EngineLoad | None:
        """The engine-reported load if it is younger than ``load_max_age``, else ``None``."""
        if self.load is None or self.load.age(now) > self.load_max_age:
            return None
        return self.load

    def load_is_stale(self, now: float | None = None) -> bool:
        """True when the adapter reported a load once but it is now too old to trust."""
        return self.load is not None and self.fresh_load(now) is None
