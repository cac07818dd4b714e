"""`HoldLog`: the holds a router made, waiting for its host to send them to the other replicas.

Router-replica sync (``kvroute serve --peer``): each started request may make or refresh holds
(`kvroute.strategy.Hold`: a key and the backend its requests now go to) in the strategy and in the
session table. The router appends them here under its lock; the host drains them every few tens of
milliseconds and sends them on. The log is bounded: when the host falls behind, the oldest holds
are dropped and counted, so the request path never waits and memory never grows. Nothing here does
I/O.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

import attrs

from kvroute.strategy import Hold

__all__ = ["HoldLog"]


@attrs.define
class HoldLog:
    """A bounded queue of (hold, time queued) pairs; ``dropped`` counts those pushed out by newer ones."""

    max_holds: int = 65536
    clock: Callable[[], float] = time.monotonic
    dropped: int = attrs.field(default=0, init=False)
    added: int = attrs.field(default=0, init=False)
    _queue: deque[tuple[Hold, float]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.max_holds < 1:
            raise ValueError(f"'max_holds' must be >= 1 (got {self.max_holds!r}).")
        self._queue = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, holds: Iterable[Hold]) -> None:
        """Queue ``holds`` (made now); past ``max_holds`` the oldest go first."""
        now = self.clock()
        queue = self._queue
        for hold in holds:
            if len(queue) >= self.max_holds:
                queue.popleft()
                self.dropped += 1
            queue.append((hold, now))
            self.added += 1

    def drain(self, limit: int | None = None) -> list[Hold]:
        """Take up to ``limit`` queued holds (all by default), oldest first, each aged by its time in the queue."""
        queue = self._queue
        count = len(queue) if limit is None else min(limit, len(queue))
        now = self.clock()
        out = []
        for _ in range(count):
            hold, queued = queue.popleft()
            out.append(Hold(hold.kind, hold.key, hold.backend_id, max(0.0, now - queued) + hold.age_s))
        return out
