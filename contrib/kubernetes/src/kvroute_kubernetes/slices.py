"""From EndpointSlices to backends: endpoint conditions, ports, ids, and kvroute's labels and annotations.

Pure functions over the client's typed models (`V1EndpointSlice`, `V1Endpoint`, ...): no I/O, so
the mapping is tested without a server. `SliceState` holds what a watch has seen, one entry per
slice name, and turns it into the sorted tuple a `kvroute.discovery.Snapshot` carries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import attrs
import structlog

from kvroute.discovery import DiscoveredBackend
from kvroute_kubernetes.target import KubernetesTarget

__all__ = [
    "ANNOTATION_KIND",
    "ANNOTATION_MODELS",
    "ANNOTATION_WEIGHT",
    "Defaults",
    "SliceState",
    "endpoint_state",
    "slice_backends",
]

log = structlog.get_logger(__name__)

#: Keys read from an EndpointSlice's annotations, then its labels (annotations win). The
#: EndpointSlice controller copies a Service's *labels* onto its slices (not its annotations).
ANNOTATION_KIND = "kvroute.io/kind"
ANNOTATION_WEIGHT = "kvroute.io/weight"
ANNOTATION_MODELS = "kvroute.io/models"

_ADDRESS_TYPES = ("IPv4", "IPv6")


@attrs.frozen
class Defaults:
    """What a backend gets when its slice says nothing: the provider's ``kind``, ``models`` and ``scheme``."""

    kind: str = "openai"
    models: frozenset[str] = attrs.field(factory=frozenset, converter=frozenset)
    scheme: str = "http"


def endpoint_state(conditions: Any) -> str | None:
    """``"ready"``, ``"draining"`` or None (absent) for an endpoint's `V1EndpointConditions` (or None).

    The API's rules: a nil ``ready`` means ready; a nil ``serving`` means the same as ``ready``; a
    nil ``terminating`` means not terminating. A terminating endpoint that still serves is
    draining (finish in-flight requests, take no new ones); one that no longer serves is gone; a
    non-terminating one is present exactly when ready.
    """
    ready = True if conditions is None or conditions.ready is None else bool(conditions.ready)
    serving = ready if conditions is None or conditions.serving is None else bool(conditions.serving)
    terminating = conditions is not None and bool(conditions.terminating)
    if terminating:
        return "draining" if serving else None
    return "ready" if ready else None


def _metadata_value(meta: Any, key: str) -> str | None:
    for source in (meta.annotations, meta.labels):
        if source and source.get(key) is not None:
            return str(source[key]).strip()
    return None


def _backend_settings(slice_: Any, defaults: Defaults) -> tuple[str, float, frozenset[str]]:
    """Kind, weight and models for every endpoint of a slice; a bad value is logged and the default kept."""
    meta = slice_.metadata
    kind = _metadata_value(meta, ANNOTATION_KIND) or defaults.kind
    weight = 1.0
    raw_weight = _metadata_value(meta, ANNOTATION_WEIGHT)
    if raw_weight:
        try:
            weight = float(raw_weight)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            log.warning(
                "kubernetes_bad_weight",
                slice=meta.name,
                key=ANNOTATION_WEIGHT,
                expected="a positive number such as '2' or '0.5'",
                got=raw_weight,
            )
            weight = 1.0
    raw_models = _metadata_value(meta, ANNOTATION_MODELS)
    models = frozenset(m.strip() for m in raw_models.split(",") if m.strip()) if raw_models else defaults.models
    return kind, weight, models


def _host_port(address: str, port: int, address_type: str) -> str:
    return f"[{address}]:{port}" if address_type == "IPv6" else f"{address}:{port}"


def slice_backends(slice_: Any, target: KubernetesTarget, defaults: Defaults) -> list[DiscoveredBackend]:
    """The backends one `V1EndpointSlice` contributes (unsorted; may repeat an id another slice has)."""
    meta = slice_.metadata
    if slice_.address_type not in _ADDRESS_TYPES:
        return []  # FQDN slices are deprecated and name no address to dial.
    port = target.port_in(slice_.ports)
    if port is None:
        if slice_.endpoints:
            listed = [f"{p.name or '(unnamed)'}={p.port}" for p in slice_.ports or ()]
            log.warning(
                "kubernetes_port_missing",
                slice=meta.name,
                expected=str(target.port),
                got=", ".join(listed) or "no ports",
            )
        return []
    kind, weight, models = _backend_settings(slice_, defaults)
    out: list[DiscoveredBackend] = []
    for endpoint in slice_.endpoints or ():
        state = endpoint_state(endpoint.conditions)
        if state is None or not endpoint.addresses:
            continue
        # Addresses of one endpoint are fungible (the API says a client may use the first).
        host_port = _host_port(endpoint.addresses[0], port, slice_.address_type)
        ref = endpoint.target_ref
        labels = {"kubernetes.io/service-name": target.service, "kubernetes.io/namespace": target.namespace}
        if endpoint.zone:
            labels["topology.kubernetes.io/zone"] = endpoint.zone
        if endpoint.node_name:
            labels["kubernetes.io/hostname"] = endpoint.node_name
        out.append(
            DiscoveredBackend(
                id=ref.name if ref is not None and ref.name else host_port,
                url=f"{defaults.scheme}://{host_port}",
                kind=kind,
                weight=weight,
                models=models,
                labels=labels,
                draining=state == "draining",
            )
        )
    return out


def _preference(backend: DiscoveredBackend) -> tuple[bool, bool, str]:
    # Serving beats draining; IPv4 beats IPv6 (dual-stack Services have one slice per family);
    # then the URL, so every replica picks the same one.
    return (backend.draining, "[" in backend.url, backend.url)


@attrs.define
class SliceState:
    """What a list-then-watch has seen: each EndpointSlice's backends, by slice name."""

    target: KubernetesTarget
    defaults: Defaults = attrs.field(factory=Defaults)
    _by_slice: dict[str, list[DiscoveredBackend]] = attrs.field(factory=dict, init=False)

    def replace(self, slices: Iterable[Any]) -> None:
        """Forget everything and take the slices of a (re)list."""
        self._by_slice = {s.metadata.name: slice_backends(s, self.target, self.defaults) for s in slices}

    def apply(self, event_type: str, slice_: Any) -> None:
        """ADDED and MODIFIED set a slice's backends; DELETED drops them."""
        if event_type == "DELETED":
            self._by_slice.pop(slice_.metadata.name, None)
        elif event_type in ("ADDED", "MODIFIED"):
            self._by_slice[slice_.metadata.name] = slice_backends(slice_, self.target, self.defaults)
        else:
            raise ValueError(f"event type must be ADDED, MODIFIED or DELETED (got {event_type!r}).")

    @property
    def slice_names(self) -> list[str]:
        return sorted(self._by_slice)

    def backends(self) -> tuple[DiscoveredBackend, ...]:
        """Every endpoint once, sorted by id; an id seen twice (dual stack, a slice split) keeps its best entry."""
        best: dict[str, DiscoveredBackend] = {}
        for name in sorted(self._by_slice):
            for backend in self._by_slice[name]:
                held = best.get(backend.id)
                if held is None or _preference(backend) < _preference(held):
                    best[backend.id] = backend
        return tuple(best[i] for i in sorted(best))
