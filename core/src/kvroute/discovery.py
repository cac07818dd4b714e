"""Discovery: where a host learns which backends exist, from DNS, Kubernetes, a watched file...

A discovery *kind* (``file``, ``dns``, ``kubernetes``...) is registered through the
``kvroute_register_discovery`` hook with a factory ``factory(**options)`` returning a
`DiscoveryProvider`. A provider runs as one long task in the host's task group and tells the
host, through a `DiscoverySink`, the *whole* set of backends it currently sees (a `Snapshot`),
each time that set may have changed, or that it could not look (``failed``).

The host (``kvroute serve``'s backend set) turns snapshots into fleet changes through the same
path as its admin API: new ids are added, ids gone from every provider are drained and removed
when idle, changed weights, models or kinds are applied. It never empties the fleet on a
failure or an empty answer: it keeps the last good set, marks it stale, and says so. Replicas that
see the same answer build the same membership, because a backend's id is derived from what the
provider sees (``address:port`` for DNS, the pod name for Kubernetes), never from arrival order.

Providers do no routing and hold no fleet state; they only look and report.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

from kvroute.backend import Backend

__all__ = ["DiscoveredBackend", "DiscoveryProvider", "DiscoverySink", "Snapshot"]


def _frozen_options(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return dict(value or {})


def _models(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


def _backends(value: Iterable[DiscoveredBackend]) -> tuple[DiscoveredBackend, ...]:
    return tuple(value)


@attrs.frozen
class DiscoveredBackend:
    """One backend as a provider sees it.

    ``id`` must be stable for the same endpoint across lookups and replicas (``10.0.0.5:8000``,
    a pod name), so that a returning endpoint gets its keys back. ``draining`` asks the host to
    stop sending new requests while in-flight ones finish (a Kubernetes endpoint that is
    terminating but still serving). ``options`` are the backend kind's adapter options.
    """

    id: str = attrs.field(validator=attrs.validators.min_len(1))
    url: str = attrs.field(validator=attrs.validators.min_len(1))
    kind: str = "openai"
    weight: float = attrs.field(default=1.0, converter=float, validator=attrs.validators.gt(0))
    models: frozenset[str] = attrs.field(factory=frozenset, converter=_models)
    labels: Mapping[str, str] = attrs.field(factory=dict, hash=False)
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_options, hash=False)
    draining: bool = False

    def to_backend(self) -> Backend:
        """The fleet member this endpoint becomes."""
        return Backend(self.id, self.url, self.kind, self.weight, self.models, self.labels)


@attrs.frozen
class Snapshot:
    """Everything one provider sees right now; ``source`` names the provider (``dns:vllm.svc:8000``)."""

    source: str
    backends: tuple[DiscoveredBackend, ...] = attrs.field(converter=_backends)

    def __attrs_post_init__(self) -> None:
        ids = [b.id for b in self.backends]
        if len(ids) != len(set(ids)):
            dupes = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"snapshot from {self.source!r} names backend ids more than once: {', '.join(dupes)}.")


@runtime_checkable
class DiscoverySink(Protocol):
    """What a provider reports to; implemented by the host."""

    def publish(self, snapshot: Snapshot) -> None:
        """The provider now sees exactly ``snapshot.backends`` (possibly none: the host decides what that means)."""
        ...

    def failed(self, source: str, reason: str) -> None:
        """The provider could not look (timeout, SERVFAIL, NXDOMAIN, API outage): keep the last good set."""
        ...


@runtime_checkable
class DiscoveryProvider(Protocol):
    """A source of backends, run by the host until cancelled."""

    #: Names the provider in logs, metrics and snapshots (``dns:vllm.default.svc:8000``).
    source: str

    async def run(self, sink: DiscoverySink, *, task_status: Any = ...) -> None:
        """Look, publish, wait, repeat until cancelled; report failures to ``sink`` and keep going.

        Call ``task_status.started()`` after the first lookup (published or failed), so a
        host can wait for a first answer before serving. Never raise except on cancellation.
        """
        ...
