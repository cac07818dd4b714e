"""`HotGroups`: which group keys open more than one backend's share of the recent conversations.

With ``key=messages`` a request is placed by its *group* key (its system prompt, see
`kvroute.keys.message_cuts`), so every conversation under one system prompt shares one home.
That is right while there are more groups than backends, and wrong when one group is a large
part of the traffic (one chat application, one shared system prompt): its home would take it
all. A group that opened more than ``1 / members`` of the last ``window`` conversations is
*hot*, and its requests are placed by their conversation key instead, which spreads them and
still keeps each conversation on one backend.

The strategy counts conversations (first turns), not requests: a few long conversations
early on would otherwise make their group look hot, and each switch moves conversations off
their cache. A hot group stays hot until its share falls under half of the threshold
(hysteresis), so a group near it does not move its conversations back and forth; and nothing
is judged on fewer than `MIN_EVIDENCE` conversations of the group. Every router replica learns
from the requests it routes, so replicas behind one load balancer reach the same verdicts
except briefly near the threshold.
"""

from __future__ import annotations

from collections import Counter, deque

import attrs

__all__ = ["MIN_EVIDENCE", "HotGroups"]

#: Conversations of one group seen in the window before it can be called hot.
MIN_EVIDENCE = 16


@attrs.define
class HotGroups:
    """A sliding window over the group keys of started conversations, and the set of hot groups."""

    window: int = 1024
    _recent: deque[int] = attrs.field(init=False)
    _counts: Counter[int] = attrs.field(factory=Counter, init=False)
    _hot: set[int] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"'window' must be a positive integer (got {self.window!r}).")
        self._recent = deque(maxlen=self.window)

    def is_hot(self, group: int) -> bool:
        """Whether requests of ``group`` are placed by their conversation key."""
        return group in self._hot

    @property
    def hot(self) -> frozenset[int]:
        """The groups hot now."""
        return frozenset(self._hot)

    def observe(self, group: int, members: int) -> None:
        """Count one started conversation of ``group`` on a fleet of ``members`` backends."""
        if len(self._recent) == self.window:
            dropped = self._recent[0]
            self._counts[dropped] -= 1
            if not self._counts[dropped]:
                del self._counts[dropped]
            self._recent.popleft()
            self._judge(dropped, members)
        self._recent.append(group)
        self._counts[group] += 1
        self._judge(group, members)

    def _judge(self, group: int, members: int) -> None:
        count, seen = self._counts.get(group, 0), len(self._recent)
        if group in self._hot:
            if not count or count * 2 * members < seen:
                self._hot.discard(group)
        elif members > 1 and count >= MIN_EVIDENCE and count * members > seen:
            self._hot.add(group)
