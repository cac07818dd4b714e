"""`Shares`: each backend's share of the recent requests, and where each recent key went.

Hashing places keys like balls into bins: with a few dozen conversations per backend, and
conversations of 5 to 30 turns, the busiest backend gets 1.2-1.8 times a fair share of the
requests, and an in-flight cap (bounded-load's ``min_capacity``) never binds at those loads.
Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam) fixes the balls-into-bins
spread by walking a key's preference order past full backends; here "full" is measured on the
requests of the recent past, not on the requests in flight:

* a backend has *share room* when its count among the last ``window`` started requests, plus one,
  is at most ``ceil(factor * weight * (window length + 1) / total weight)`` (totals over the
  candidates), the MTZ cap on a sliding window of requests;
* a key is *held* by the backend its last request went to (an LRU table of ``max_keys`` keys):
  a conversation's later turns follow it there, whatever the share, because that backend holds
  its history;
* a hold ends when the key's home is a backend that joined after the key was held (`joined`): the
  key then moves to the new backend, as consistent hashing moves it, so a scale-out takes about its
  share of the existing keys and moves no key between old backends.

A strategy places a key nobody holds on the first backend of its order with share room, so keys
spread from the first request and a backend that took long conversations takes fewer new ones.
Every router replica computes the same order; replicas that see similar traffic see similar
shares and agree except near the cap. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable

import attrs

__all__ = ["Shares", "auto_window"]

#: Requests in the window per member when ``window`` is 0 (automatic), and the least window.
WINDOW_PER_MEMBER = 64
MIN_WINDOW = 256
_EPSILON = 1e-9


def auto_window(members: int) -> int:
    """The automatic window for ``members`` backends: 64 requests each, at least 256."""
    return max(MIN_WINDOW, WINDOW_PER_MEMBER * members)


@attrs.define
class Shares:
    """A sliding window of started requests per backend, and the backend that holds each recent key."""

    factor: float = 1.2
    #: Requests in the window; 0 sizes it with the fleet (`auto_window`).
    window: int = 0
    max_keys: int = 65536
    _recent: deque[str] = attrs.field(factory=deque, init=False)
    _counts: Counter[str] = attrs.field(factory=Counter, init=False)
    #: key -> (its holder, the join generation when it was recorded).
    _held: OrderedDict[int, tuple[str, int]] = attrs.field(factory=OrderedDict, init=False)
    _size: int = attrs.field(default=MIN_WINDOW, init=False)
    _generation: int = attrs.field(default=0, init=False)
    #: backend id -> the join generation it (last) joined at.
    _joined: dict[str, int] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"'factor' must be >= 1.0 (got {self.factor!r}).")
        if self.window < 0 or self.max_keys < 1:
            raise ValueError(f"'window' must be >= 0 and 'max_keys' >= 1 (got {self.window!r}, {self.max_keys!r}).")
        self._size = self.window or MIN_WINDOW

    def resize(self, members: int) -> None:
        """Size an automatic window for a fleet of ``members`` backends (a fixed ``window`` stays)."""
        if self.window:
            return
        self._size = auto_window(members)
        while len(self._recent) > self._size:
            self._drop()

    @property
    def size(self) -> int:
        """The window's length limit in requests."""
        return self._size

    def __len__(self) -> int:
        return len(self._recent)

    def count(self, backend_id: str) -> int:
        """Requests among the recent ones that went to ``backend_id``."""
        return self._counts.get(backend_id, 0)

    def has_room(self, backend_id: str, weight: float, total_weight: float, slack: float = 1.0) -> bool:
        """Whether one more request keeps ``backend_id`` within ``factor`` times its weight share of the window.

        ``slack`` multiplies the factor (a looser test for moving a held key than for placing a new one).
        """
        cap = math.ceil(self.factor * slack * weight * (len(self._recent) + 1) / total_weight - _EPSILON)
        return self._counts.get(backend_id, 0) + 1 <= max(1, cap)

    def joined(self, backend_ids: Iterable[str]) -> None:
        """``backend_ids`` joined the fleet now: keys held before, whose home one of them is, stop being held."""
        self._generation += 1
        for backend_id in backend_ids:
            self._joined[backend_id] = self._generation

    def holder(self, key: int, home_id: str | None = None) -> str | None:
        """The backend ``key``'s last request went to, if the table still has it.

        ``None`` as well when ``home_id`` (the key's home now) joined after the key was held.
        """
        entry = self._held.get(key)
        if entry is None:
            return None
        backend_id, generation = entry
        if home_id is not None and self._joined.get(home_id, 0) > generation:
            return None
        return backend_id

    def record(self, backend_id: str, keys: tuple[int | None, ...]) -> None:
        """Count one started request on ``backend_id`` and make it the holder of ``keys`` (``None`` ones skipped)."""
        recent = self._recent
        if len(recent) >= self._size:
            self._drop()
        recent.append(backend_id)
        self._counts[backend_id] += 1
        held = self._held
        for key in keys:
            if key is None:
                continue
            if key in held:
                held.move_to_end(key)
            elif len(held) >= self.max_keys:
                held.popitem(last=False)
            held[key] = (backend_id, self._generation)

    def _drop(self) -> None:
        gone = self._recent.popleft()
        left = self._counts[gone] - 1
        if left:
            self._counts[gone] = left
        else:
            del self._counts[gone]

    def stats(self) -> dict[str, object]:
        """The window and the table, for ``explain`` and tests."""
        return {"window": len(self._recent), "size": self._size, "held_keys": len(self._held), "factor": self.factor}

    # -- router-replica sync (kvroute.strategy.Holds): new methods, kept at the end of the class ----------

    def adopt(self, key: int, backend_id: str) -> bool:
        """Make ``backend_id`` the holder of ``key`` for another replica's request, unless ``key`` is held here.

        A key this replica holds keeps its holder (its own requests are the ones it saw); the adopted
        hold counts no request in the window (the request ran elsewhere) and is the most recent entry
        of the table.
        """
        held = self._held
        if key in held:
            return False
        if len(held) >= self.max_keys:
            held.popitem(last=False)
        held[key] = (backend_id, self._generation)
        return True
