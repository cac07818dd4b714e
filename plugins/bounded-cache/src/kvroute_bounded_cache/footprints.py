"""Which prefixes each backend holds, as far as the router can tell: an LRU model of each engine's cache.

The router knows what it sent where, not what the engine kept. `Footprints` keeps, per backend,
the prefix keys routed there with each one's footprint in tokens, least recently used first.
Recording a key on a backend whose KV capacity is known drops its least recently used keys
while their total exceeds that capacity, as the engine's own LRU would have evicted them; with
no capacity known, a backend keeps at most ``max_keys`` keys. It also remembers where each key
went last (at most ``max_keys`` keys in all), after it aged out too: a key the model dropped early
(its footprint is only an estimate) may still be in that engine's cache. Nothing here is shared
between router replicas: each models the caches from its own requests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import attrs

__all__ = ["Footprints"]


@attrs.define
class Footprints:
    """Per backend: the keys it holds (with their footprints in tokens) and their total, LRU-aged."""

    max_keys: int = 65536
    _keys: dict[str, OrderedDict[int, int]] = attrs.field(factory=dict, init=False)
    _totals: dict[str, int] = attrs.field(factory=dict, init=False)
    _last: OrderedDict[int, str] = attrs.field(factory=OrderedDict, init=False)

    def holds(self, backend_id: str, key: int) -> bool:
        """Whether ``key`` was routed to ``backend_id`` and not aged out since."""
        keys = self._keys.get(backend_id)
        return keys is not None and key in keys

    def held(self, backend_id: str) -> int:
        """The tokens ``backend_id`` holds: the sum of its keys' footprints."""
        return self._totals.get(backend_id, 0)

    def last(self, key: int) -> str | None:
        """The backend ``key`` was last routed to (``None`` if never, or forgotten)."""
        return self._last.get(key)

    def keys(self, backend_id: str) -> tuple[int, ...]:
        """The keys ``backend_id`` holds, least recently used first."""
        return tuple(self._keys.get(backend_id, ()))

    def record(self, backend_id: str, key: int, tokens: int, capacity: int | None) -> None:
        """``key`` (``tokens`` long) was just routed to ``backend_id``: it is now the most recently used there.

        Then the least recently used keys go while the total exceeds ``capacity`` (tokens; ``None``:
        unknown, keep at most ``max_keys``). A prompt longer than the whole cache is not kept at all.
        """
        keys = self._keys.setdefault(backend_id, OrderedDict())
        total = self._totals.get(backend_id, 0) - keys.pop(key, 0) + tokens
        keys[key] = tokens
        while keys and (total > capacity if capacity is not None else len(keys) > self.max_keys):
            total -= keys.popitem(last=False)[1]
        self._totals[backend_id] = total
        self._last.pop(key, None)
        self._last[key] = backend_id
        if len(self._last) > self.max_keys:
            self._last.popitem(last=False)

    def keep_only(self, backend_ids: Iterable[str]) -> None:
        """Forget every backend not in ``backend_ids`` (it left the fleet; if it returns, it starts cold)."""
        keep = set(backend_ids)
        for backend_id in [b for b in self._keys if b not in keep]:
            del self._keys[backend_id]
            self._totals.pop(backend_id, None)
