"""`Strangers`: whether other routers place the same conversations as this one, told from its own traffic.

Router replicas that do not talk (no ``kvroute serve --peer``) see each a part of every
conversation's turns. A conversation this router never saw before normally arrives with its first
turn; one that arrives with a history (a later turn, `kvroute.keys.opens_conversation` is false)
had its earlier turns placed by some other router, or by this one before a restart or before its
binding expired. Over the new conversations of the recent past:

* with one router, nearly every new conversation arrives with its first turn;
* with ``N`` routers spreading requests at random, a multi-turn conversation reaches a given router
  first with its first turn only about once in ``N`` times.

When more than `ON` of the last ``window`` new conversations (and `MIN_EVIDENCE` at least) came
with a history, `Strangers.on` says so, until the share falls under `OFF` (hysteresis: a share
near the threshold does not flip the verdict back and forth). `kvroute.sessions.Sessions` then
places conversations as it places session ids: by a pure function of the request (the home of the
conversation key), so every router sends a conversation's turns to the same backend without
talking to the others. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from collections import deque

import attrs

__all__ = ["MIN_EVIDENCE", "OFF", "ON", "Strangers"]

#: New conversations seen in the window before a verdict. Small, because every conversation placed before the
#: verdict may split between replicas and move once after it (a single router that sees one stray later turn
#: early switches until 16 conversations with a first turn dilute it, which costs it nothing but balance).
MIN_EVIDENCE = 2
#: The share of new conversations arriving with a history above which other routers are assumed.
ON = 1 / 8
#: The share under which the verdict is withdrawn.
OFF = 1 / 16


@attrs.define
class Strangers:
    """A sliding window over this router's new conversations: which of them arrived with a history."""

    window: int = 256
    _recent: deque[bool] = attrs.field(init=False)
    _foreign: int = attrs.field(default=0, init=False)
    _on: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"'window' must be a positive integer (got {self.window!r}).")
        self._recent = deque()

    @property
    def on(self) -> bool:
        """Whether other routers (or an earlier life of this one) placed a good part of the recent conversations."""
        return self._on

    @property
    def seen(self) -> int:
        """New conversations in the window."""
        return len(self._recent)

    @property
    def foreign(self) -> int:
        """New conversations in the window that arrived with a history."""
        return self._foreign

    def observe(self, history: bool) -> None:
        """Count one conversation this router had no binding for; ``history``: it arrived with a later turn."""
        recent = self._recent
        if len(recent) >= self.window:
            self._foreign -= recent.popleft()
        recent.append(history)
        self._foreign += history
        seen, foreign = len(recent), self._foreign
        if self._on:
            self._on = foreign >= OFF * seen
        else:
            self._on = seen >= MIN_EVIDENCE and foreign > ON * seen
