"""`Shares`: each backend's share of the recent requests and of the distinct recent keys, and where each key went.

Hashing places keys like balls into bins: with a few dozen conversations per backend, and
conversations of 5 to 30 turns, the busiest backend gets 1.2-1.8 times a fair share of the
requests, and an in-flight cap (bounded-load's ``min_capacity``) never binds at those loads.
Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam) fixes the balls-into-bins
spread by walking a key's preference order past full backends; here "full" is measured on the
requests of the recent past, not on the requests in flight:

* a backend has *share room* when its count among the last ``window`` started requests, plus one,
  is at most ``ceil(factor * weight * (window length + 1) / total weight)`` (totals over the
  candidates), the MTZ cap on a sliding window of requests; a backend is *starved* (`is_starved`)
  when its count is under ``1 / factor`` of its share of a full window (bounded-cache sends a short
  key's new conversation there first);
* a key is *held* by the backend its last request went to (an LRU table of ``max_keys`` keys):
  a conversation's later turns follow it there, whatever the share, because that backend holds
  its history;
* a key is *live* on a backend while one of the last ``window`` requests placed it there, and counts
  once however many did: with ``key_factor``, a backend has *key room* for a key not live there when its
  live keys plus one are at most ``ceil(key_factor * weight * (live keys + 1) / total weight)``. What
  fills a cache is distinct prompts, not requests, so this spreads the prompts evenly over the caches
  whatever the backends are called (issue 24); `is_hot` says when one key alone is over a backend's share;
* a conversation is *active* on the backend its last request went to until ``ACTIVE_GAPS`` (3) mean
  gaps between a conversation's consecutive requests pass without another (`converse`): a new key's
  choices compare active conversations first, since a backend's conversations still under way are the
  requests it will get, and a request count of the past does not see a session that has just started
  (15 agent sessions of 5-30 turns per backend at 64 backends: busiest 1.45x a fair share on recent
  requests, 1.12x on active conversations over four choices); `has_conversation_room` caps a backend's
  active conversations as ``factor`` caps its requests;
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
#: Recent requests a key must have placed before `Shares.is_hot` can call it hot (a key's first requests
#: are too few to tell a popular key from a lucky one).
HOT_EVIDENCE = 2
#: A conversation stays active for this many mean gaps between a conversation's requests (`Shares.converse`).
ACTIVE_GAPS = 3.0
#: Gaps the mean gap is averaged over (an exponential moving average).
GAP_MEMORY = 256


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
    #: The cap on each backend's distinct live keys, as ``factor`` is on its requests; ``None``: no cap.
    key_factor: float | None = None
    _recent: deque[tuple[str, int | None]] = attrs.field(factory=deque, init=False)
    #: placed key -> requests among the recent ones that it placed.
    _placed: Counter[int] = attrs.field(factory=Counter, init=False)
    _counts: Counter[str] = attrs.field(factory=Counter, init=False)
    #: key -> (its holder, the join generation when it was recorded).
    _held: OrderedDict[int, tuple[str, int]] = attrs.field(factory=OrderedDict, init=False)
    _size: int = attrs.field(default=MIN_WINDOW, init=False)
    _generation: int = attrs.field(default=0, init=False)
    #: backend id -> the join generation it (last) joined at.
    _joined: dict[str, int] = attrs.field(factory=dict, init=False)
    #: (backend id, placed key) -> the number of the last request that placed the key there, oldest first.
    _live: OrderedDict[tuple[str, int], int] = attrs.field(factory=OrderedDict, init=False)
    #: backend id -> its distinct live keys.
    _keyed: Counter[str] = attrs.field(factory=Counter, init=False)
    #: Requests recorded so far.
    _seq: int = attrs.field(default=0, init=False)
    #: Active conversations (`converse`): conversation -> [backend id, number of its last request, its requests].
    _active: OrderedDict[int, tuple[str, int, int]] = attrs.field(factory=OrderedDict, init=False)
    #: backend id -> its active conversations.
    _active_count: Counter[str] = attrs.field(factory=Counter, init=False)
    #: conversation -> the number of its last request (LRU, ``max_keys``): the gaps, past the active ones too.
    _seen: OrderedDict[int, int] = attrs.field(factory=OrderedDict, init=False)
    #: The mean gap, in requests, between a conversation's consecutive requests (moving average).
    _gap: float = attrs.field(default=0.0, init=False)

    def __attrs_post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"'factor' must be >= 1.0 (got {self.factor!r}).")
        if self.key_factor is not None and not self.key_factor >= 1.0:
            raise ValueError(f"'key_factor' must be >= 1.0 (got {self.key_factor!r}).")
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
        self._expire()

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

    def is_starved(self, backend_id: str, weight: float, total_weight: float) -> bool:
        """Whether ``backend_id`` took under ``1 / factor`` times its weight share of a full window: the lower twin
        of `has_room` (never before the window is full, when the counts are too few to tell)."""
        if len(self._recent) < self._size:
            return False
        return self._counts.get(backend_id, 0) * self.factor * total_weight < weight * len(self._recent)

    def placed(self, key: int) -> int:
        """Requests among the recent ones that were placed by ``key``."""
        return self._placed.get(key, 0)

    def is_hot(self, key: int, members: int) -> bool:
        """Whether ``key`` placed over one in ``members`` of the recent requests, and `HOT_EVIDENCE` of them at least.

        A key that hot cannot stay on one backend within its share, whatever else goes there.
        """
        placed = self._placed.get(key, 0)
        return placed >= HOT_EVIDENCE and placed * members > len(self._recent)

    def keys_on(self, backend_id: str) -> int:
        """Distinct keys placed on ``backend_id`` by one of the recent requests (a key counts once)."""
        return self._keyed.get(backend_id, 0)

    @property
    def live_keys(self) -> int:
        """Distinct (backend, key) pairs placed by the recent requests: the sum of `keys_on`."""
        return len(self._live)

    def has_key_room(self, backend_id: str, weight: float, total_weight: float, key: int | None = None) -> bool:
        """Whether placing ``key`` keeps ``backend_id`` within ``key_factor`` times its weight share of the live keys.

        A key already live there adds nothing, and so has room; always room without ``key_factor``.
        """
        if self.key_factor is None or (key is not None and (backend_id, key) in self._live):
            return True
        cap = math.ceil(self.key_factor * weight * (len(self._live) + 1) / total_weight - _EPSILON)
        return self._keyed.get(backend_id, 0) + 1 <= max(1, cap)

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

    def record(self, backend_id: str, keys: tuple[int | None, ...], placed: int | None = None) -> None:
        """Count one started request on ``backend_id`` and make it the holder of ``keys`` (``None`` ones skipped).

        ``placed`` is the key the request was placed by: it is live on ``backend_id`` until ``size``
        requests have started without placing it there again.
        """
        self._seq += 1
        if placed is not None:
            live = self._live
            pair = (backend_id, placed)
            if live.pop(pair, None) is None:
                self._keyed[backend_id] += 1
            live[pair] = self._seq
        if self._live:
            self._expire()
        recent = self._recent
        if len(recent) >= self._size:
            self._drop()
        recent.append((backend_id, placed))
        self._counts[backend_id] += 1
        if placed is not None:
            self._placed[placed] += 1
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
        gone, placed = self._recent.popleft()
        left = self._counts[gone] - 1
        if left:
            self._counts[gone] = left
        else:
            del self._counts[gone]
        if placed is not None:
            left = self._placed[placed] - 1
            if left:
                self._placed[placed] = left
            else:
                del self._placed[placed]

    def _expire(self) -> None:
        """Forget the live keys whose last request is ``size`` or more requests ago."""
        live, oldest = self._live, self._seq - self._size
        while live:
            pair, seq = next(iter(live.items()))
            if seq > oldest:
                return
            del live[pair]
            left = self._keyed[pair[0]] - 1
            if left:
                self._keyed[pair[0]] = left
            else:
                del self._keyed[pair[0]]

    def stats(self) -> dict[str, object]:
        """The window and the table, for ``explain`` and tests."""
        return {
            "window": len(self._recent),
            "size": self._size,
            "held_keys": len(self._held),
            "factor": self.factor,
            "live_keys": len(self._live),
            "key_factor": self.key_factor,
            "active_conversations": len(self._active),
        }

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

    # -- active conversations (`converse`): new methods, kept at the end of the class --------------------

    def converse(self, backend_id: str, conversation: int | None) -> None:
        """Count one request of ``conversation`` on ``backend_id`` (call after `record`): it is *active* there until
        `ACTIVE_GAPS` times the mean gap between a conversation's requests pass without another."""
        if conversation is None:
            return
        active, seq = self._active, self._seq
        seen = self._seen
        last = seen.pop(conversation, None)
        if last is not None:
            gap = seq - last
            self._gap = gap if not self._gap else self._gap + (gap - self._gap) / GAP_MEMORY
        elif len(seen) >= self.max_keys:
            seen.popitem(last=False)
        seen[conversation] = seq
        entry = active.pop(conversation, None)
        if entry is None:
            self._active_count[backend_id] += 1
            entry = (backend_id, seq, 1)
        else:
            was, _, turns = entry
            if was != backend_id:
                self._inactive(was)
                self._active_count[backend_id] += 1
            entry = (backend_id, seq, turns + 1)
        active[conversation] = entry
        if len(active) > self.max_keys:
            self._inactive(active.popitem(last=False)[1][0])
        self._quiet()

    def has_conversation_room(self, backend_id: str, weight: float, total_weight: float) -> bool:
        """Whether one more active conversation keeps ``backend_id`` within ``factor`` times its weight share of the
        active conversations; always, before any conversation has had a second request (`converse`)."""
        if not self._gap:
            return True
        self._quiet()
        cap = math.ceil(self.factor * weight * (len(self._active) + 1) / total_weight - _EPSILON)
        return self._active_count.get(backend_id, 0) + 1 <= max(1, cap)

    def active_on(self, backend_id: str) -> int:
        """Active conversations on ``backend_id`` (`converse`)."""
        self._quiet()
        return self._active_count.get(backend_id, 0)

    @property
    def active(self) -> int:
        """Active conversations on every backend: the sum of `active_on`."""
        return len(self._active)

    @property
    def horizon(self) -> int:
        """Requests after its last one that a conversation stays active: `ACTIVE_GAPS` mean gaps, at most ``size``."""
        if not self._gap:
            return self._size
        return max(1, min(self._size, math.ceil(ACTIVE_GAPS * self._gap)))

    def load(self, backend_id: str, weight: float, conversations: bool = False) -> tuple[float, float]:
        """What a new key's choices compare (least first): ``backend_id``'s active conversations (with
        ``conversations``; else 0), then its recent requests, each per unit of ``weight``."""
        active = self.active_on(backend_id) / weight if conversations else 0.0
        return active, self._counts.get(backend_id, 0) / weight

    def _quiet(self) -> None:
        """Forget the conversations whose last request is `horizon` or more requests ago."""
        active, oldest = self._active, self._seq - self.horizon
        while active:
            backend_id, last, _ = next(iter(active.values()))
            if last > oldest:
                return
            active.popitem(last=False)
            self._inactive(backend_id)

    def _inactive(self, backend_id: str) -> None:
        left = self._active_count[backend_id] - 1
        if left:
            self._active_count[backend_id] = left
        else:
            del self._active_count[backend_id]
