"""A reference model of what each backend's KV cache holds, for checking capacity-aware placement.

A strategy that bounds cache footprints (``bounded-cache``) keeps its own model of which prefix
keys each backend holds; the state machine keeps this simple one next to it, fed by the same
starts, and checks the strategy's decisions against it (`kvroute.testing.Claims`: ``resident``,
``cache_factor``, ``cache_fill``). The rules, which a claiming strategy must follow exactly:

* a start of key ``k`` with footprint ``f`` tokens (``Decision.key``, ``Decision.detail["footprint"]``)
  on backend ``b`` makes ``k`` the most recently used key of ``b`` with footprint ``f``; then
  ``b``'s least recently used keys go while the footprints add up to more than ``b``'s KV
  capacity in tokens (``kv_blocks * block_size``; no limit when unknown);
* a backend that leaves the fleet forgets everything (it returns cold);
* a backend holding ``held`` tokens of capacity ``c`` has *cache room* for ``f`` more when
  ``held + f <= max(f, cache_factor * c * (total held + f) / total capacity)`` (totals over the
  candidates; capacities are the backends' weights when some candidate's KV size is unknown)
  and, when every capacity is known, ``held + f <= cache_fill * c``; computed exactly.

Nothing here needs Hypothesis.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from fractions import Fraction

import attrs

from kvroute.testing.measure import exact

__all__ = ["CacheModel", "cache_room"]


@attrs.define
class CacheModel:
    """Per backend, the keys routed there with their footprints, least recently used first."""

    _keys: dict[str, OrderedDict[int, int]] = attrs.field(factory=dict)

    def holders(self, key: int, backend_ids: Iterable[str]) -> set[str]:
        """Those of ``backend_ids`` that hold ``key``."""
        return {b for b in backend_ids if key in self._keys.get(b, {})}

    def held(self, backend_id: str) -> int:
        """The tokens ``backend_id`` holds."""
        return sum(self._keys.get(backend_id, {}).values())

    def record(self, backend_id: str, key: int, tokens: int, capacity: int | None) -> None:
        """A start of ``key`` on ``backend_id``; then LRU eviction down to ``capacity`` tokens (``None``: none)."""
        keys = self._keys.setdefault(backend_id, OrderedDict())
        keys.pop(key, None)
        keys[key] = tokens
        while capacity is not None and keys and sum(keys.values()) > capacity:
            keys.popitem(last=False)

    def keep_only(self, backend_ids: Iterable[str]) -> None:
        """Forget the backends not in ``backend_ids``."""
        keep = set(backend_ids)
        self._keys = {b: keys for b, keys in self._keys.items() if b in keep}


def cache_room(
    held: Mapping[str, int],
    capacities: Mapping[str, float],
    footprint: int,
    *,
    cache_factor: float | None,
    cache_fill: float | None,
    in_tokens: bool,
) -> set[str]:
    """The candidates (keys of ``held``) with cache room for ``footprint`` more tokens (see the module docs).

    ``capacities`` are KV tokens when ``in_tokens``, else weights (``cache_fill`` then does not apply).
    """
    total_held = sum(held.values())
    total_capacity = sum((exact(c) for c in capacities.values()), Fraction(0))
    room = set()
    for backend_id, tokens in held.items():
        after, capacity = tokens + footprint, exact(capacities[backend_id])
        if cache_factor is not None:
            share = exact(cache_factor) * capacity * (total_held + footprint) / total_capacity
            if after > footprint and after > share:
                continue
        if cache_fill is not None and in_tokens and after > exact(cache_fill) * capacity:
            continue
        room.add(backend_id)
    return room
