"""Applying an engine's KV cache events to a `KvEventSink`: what every engine's event feed shares.

An engine adapter subclasses `KvEventFeed` for its event format and keeps only what differs: how
items arrive and are ordered (sequence numbers and replays, event ids, polls), and what each event
means for the index (`KvEventFeed._apply`). The base holds the rest:

* **Exactness.** A feed is *complete* while nothing it was given could have been skipped or lost
  since the backend's blocks were last cleared. `KvEventFeed.lose` records a loss by reason
  (``stats.inexact_reasons``), logs ``kv_index_inexact`` when the feed stops being complete (with
  ``backend``, ``rank`` when the feed has one, ``reason`` and the context given), and updates the
  backend's `ExactFlag`. `KvEventFeed.engine_cleared` (the engine dropped its cache, and the sink
  with it) and `KvEventFeed.resync` (the adapter clears the sink to trust the events again) make it
  complete again, logged as ``kv_index_exact`` and counted in ``stats.resyncs``.
* **The exact flag.** `ExactFlag` tells the sink ``set_exact(backend, value)``, with the reason
  when the sink takes one (`set_backend_exact`), only when the value changes. It is true while every
  feed of the backend (one per engine rank) is subscribed and complete.
* **Block sizes.** While the sink hashes blocks of another size than the engine's (a strategy that
  has not learned the engine's block size yet), items are held in order (`KvEventFeed.offer`) and
  applied by `KvEventFeed.resume` once the sizes agree. Past ``max_held`` the oldest are dropped: a
  loss, ``held_<unit>_dropped``.
* **Ranks.** `rank_key` keeps the engine hashes of data-parallel ranks apart in the sink. A sink
  whose methods take a ``rank`` keyword (`accepts`; the tokenizer-prefix index does) is given the
  rank too, and keeps each rank's blocks apart (one cache per rank, as the engine has).
* **Tiers.** Engines that offload KV blocks to slower memory report where a block is (vLLM's
  ``medium``). `tier_of` reads an engine's medium as a tier, `GPU`, `CPU` or `DISK` (``None``
  for one it does not know); a sink whose methods take a ``medium`` keyword is given the tier.

An adapter's event task keeps itself alive with `kvroute.loops.KeepAlive` (re-exported by `kvroute.adapters`).
"""

from __future__ import annotations

import abc
import inspect
import time
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

import attrs

from kvroute.adapters.protocol import KvEventSink, set_backend_exact
from kvroute.logs import get_logger

__all__ = [
    "CPU",
    "DISK",
    "GPU",
    "RANKS",
    "TIERS",
    "ExactFlag",
    "FeedStats",
    "KvEventFeed",
    "accepts",
    "rank_key",
    "tier_of",
]

log = get_logger(__name__)

#: Data-parallel ranks `rank_key` tells apart.
RANKS = 1 << 16

ItemT = TypeVar("ItemT")

#: KV cache tiers, fastest first: the accelerator's memory, host memory, local disk (or remote storage).
GPU = "GPU"
CPU = "CPU"
DISK = "DISK"
TIERS = (GPU, CPU, DISK)
#: Engines' names for where a block is (lower case), as vLLM's ``medium`` and offloading connectors spell them.
_MEDIA = {
    "gpu": GPU,
    "cuda": GPU,
    "cpu": CPU,
    "host": CPU,
    "cpu_pinned": CPU,
    "localcpubackend": CPU,
    "disk": DISK,
    "localdiskbackend": DISK,
    "ssd": DISK,
    "nvme": DISK,
    "gds": DISK,
}


def tier_of(medium: str | None) -> str | None:
    """The tier of an engine's ``medium`` (case-insensitive; absent means `GPU`), ``None`` for a medium not known."""
    if medium is None:
        return GPU
    return _MEDIA.get(medium.strip().lower()) if isinstance(medium, str) else None


def accepts(method: object, keyword: str) -> bool:
    """Whether ``method`` takes the keyword argument ``keyword`` (named, or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(method).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return keyword in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def rank_key(engine_hash: int, rank: int) -> int:
    """The sink's key for an engine hash seen on data-parallel ``rank``: distinct for every (hash, rank) pair.

    Any integer hash (negative or wider than 64 bits included) maps to ``engine_hash * RANKS + rank``;
    ``ValueError`` for a rank outside ``0 .. RANKS - 1``.
    """
    if not 0 <= rank < RANKS:
        raise ValueError(f"expected a data-parallel rank from 0 to {RANKS - 1}, got {rank!r}.")
    return engine_hash * RANKS + rank


@attrs.define
class FeedStats:
    """Counters every event feed keeps (an engine's feed adds its own in a subclass)."""

    #: Blocks the sink stored or removed for this feed.
    blocks_stored: int = 0
    blocks_removed: int = 0
    #: Times the backend's blocks were cleared because the engine's were (a cache reset, a restart).
    cleared: int = 0
    #: Items held for a block-size mismatch, and held items dropped past ``max_held``.
    held: int = 0
    dropped_held: int = 0
    #: Events not applied (left out on purpose or lost), stores continuing an unknown block, stores the sink refused.
    skipped_events: int = 0
    orphan_events: int = 0
    rejected_events: int = 0
    #: Times the feed stopped being complete (each logged as ``kv_index_inexact``), and every loss by reason.
    inexact: int = 0
    inexact_reasons: dict[str, int] = attrs.field(factory=dict)
    #: Times it was complete again after a loss (each logged as ``kv_index_exact``).
    resyncs: int = 0


class ExactFlag:
    """Whether one backend's index may be called exact, from the state of all its feeds (one per rank).

    Exact means: every feed is subscribed and none has lost anything since its last clear. The value
    goes to the sink (``set_exact``, with the reason when the sink takes one) only when it changes;
    ``reported`` is the value last given (``None``: nothing given yet; pass ``False`` for a sink that
    holds the backend as inexact already and need not be told so).

    Switching a sink back to exact makes it forget the backend's blocks (the tokenizer-prefix index
    drops its approximate records), so every other feed is asked to rebuild (``needs_resync``).
    """

    def __init__(self, backend: str, sink: KvEventSink, *, reported: bool | None = None) -> None:
        self.backend = backend
        self.sink = sink
        #: The value last given to the sink (``None``: not yet).
        self.reported = reported
        self._feeds: list[KvEventFeed[Any]] = []
        self._subscribed: dict[int, bool] = {}

    def add(self, feed: KvEventFeed[Any], *, subscribed: bool = False) -> None:
        """Count ``feed`` as one of the backend's feeds."""
        self._feeds.append(feed)
        self._subscribed[id(feed)] = subscribed

    @property
    def value(self) -> bool:
        """Every feed subscribed and complete (and at least one feed)."""
        return bool(self._feeds) and all(self._subscribed[id(f)] and f.lost_reason is None for f in self._feeds)

    def reason(self) -> str | None:
        """Why the backend is not exact: ``not_subscribed`` or the first feed's loss (``None`` when exact)."""
        for feed in self._feeds:
            if not self._subscribed[id(feed)]:
                return "not_subscribed"
            if feed.lost_reason is not None:
                return feed.lost_reason
        return None

    def subscribed(self, feed: KvEventFeed[Any], yes: bool) -> None:
        """``feed``'s subscription started (``True``) or ended."""
        self._subscribed[id(feed)] = yes
        self.update(feed)

    def close(self) -> None:
        """No feed runs any more: the backend goes back to the strategy's own records."""
        for feed in self._feeds:
            self._subscribed[id(feed)] = False
        self.update(None)

    def update(self, cause: KvEventFeed[Any] | None) -> None:
        """Give the sink the current value if it changed (``cause``: the feed whose state changed)."""
        value = self.value
        if value == self.reported:
            return
        self.reported = value
        set_backend_exact(self.sink, self.backend, value, reason=None if value else self.reason())
        if value:
            for feed in self._feeds:
                if feed is not cause:
                    feed.needs_resync = True


class KvEventFeed(abc.ABC, Generic[ItemT]):
    """One stream of an engine's KV events (items of type ``ItemT``), applied to ``sink`` for ``backend``.

    Subclasses receive items in their own way, pass each one to `offer` (which holds it while the
    block sizes differ), and implement `_fits` and `_apply`. ``rank``: the engine rank this stream
    carries (``None`` when one stream carries every rank). A feed given no ``exact_flag`` makes its own
    and counts as subscribed; one given a flag is exact only after `subscribe`. ``clock`` times
    `inexact_for`.
    """

    #: What one held item is, in the reason ``held_<unit>_dropped``.
    unit: ClassVar[str] = "events"
    #: Where the feed's log lines go: a subclass sets its own module's logger.
    logger: ClassVar[Any] = log

    def __init__(
        self,
        backend: str,
        sink: KvEventSink,
        *,
        rank: int | None = None,
        max_held: int = 10_000,
        exact_flag: ExactFlag | None = None,
        stats: FeedStats | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.sink = sink
        self.rank = rank
        self.max_held = max_held
        self.clock = clock
        self.stats = stats if stats is not None else FeedStats()
        #: Why the index may miss this stream's blocks (``None``: nothing lost since the last clear).
        self.lost_reason: str | None = None
        #: Set when the sink forgot this backend's blocks: rebuild them (replay) if the engine allows.
        self.needs_resync = False
        #: The backend's exactness; a feed given none makes its own and counts as subscribed.
        self.exact_flag = exact_flag if exact_flag is not None else ExactFlag(backend, sink)
        self.exact_flag.add(self, subscribed=exact_flag is None)
        self._held: deque[ItemT] = deque()
        self._warned: set[str] = set()
        self._lost_at: float | None = None

    # -- exactness -----------------------------------------------------------------------

    @property
    def exact(self) -> bool:
        """Whether the sink was last told that this backend is exact."""
        return self.exact_flag.reported is True

    @property
    def inexact_for(self) -> float | None:
        """Seconds since the last loss, while the feed is not complete (``None``: complete)."""
        return None if self._lost_at is None else self.clock() - self._lost_at

    def subscribe(self) -> None:
        """The stream is followed from now on: the backend may be called exact (once all its feeds are)."""
        self.exact_flag.subscribed(self, True)

    def unsubscribe(self) -> None:
        """The stream is no longer followed: the backend goes back to the strategy's own records."""
        self.exact_flag.subscribed(self, False)

    def _where(self) -> dict[str, Any]:
        """What names this feed in its log lines: the backend, and the rank when the feed has one."""
        return {"backend": self.backend} if self.rank is None else {"backend": self.backend, "rank": self.rank}

    def lose(self, reason: str, **context: Any) -> None:
        """Something this stream carried may be missing from the index: record it, the backend is not exact."""
        self.stats.inexact_reasons[reason] = self.stats.inexact_reasons.get(reason, 0) + 1
        self._lost_at = self.clock()
        if self.lost_reason is None:
            self.lost_reason = reason
            self.stats.inexact += 1
            self.logger.warning("kv_index_inexact", **self._where(), reason=reason, **context)
            self.exact_flag.update(self)

    def engine_cleared(self, reason: str) -> None:
        """The engine dropped every cached block (``reason``: how we know): so does the sink, and the feed is
        complete. A feed of one rank clears that rank's blocks only, in a sink that keeps ranks apart."""
        if self.rank is not None and accepts(self.sink.all_cleared, "rank"):
            self.sink.all_cleared(self.backend, rank=self.rank)  # type: ignore[call-arg]
        else:
            self.sink.all_cleared(self.backend)
        self.stats.cleared += 1
        self._complete(reason)

    def resync(self, reason: str = "resync") -> None:
        """Clear the backend's blocks in the sink and trust the events again (no stale block can remain)."""
        self.sink.all_cleared(self.backend)
        self._complete(reason)

    def _complete(self, reason: str) -> None:
        self._lost_at = None
        if self.lost_reason is None:
            return
        self.stats.resyncs += 1
        self.logger.info("kv_index_exact", **self._where(), reason=reason, after=self.lost_reason)
        self.lost_reason = None
        self.exact_flag.update(self)

    # -- block sizes -----------------------------------------------------------------------

    @property
    def holding(self) -> int:
        """Items waiting for the sink's block size to equal the engine's."""
        return len(self._held)

    @abc.abstractmethod
    def _fits(self, item: ItemT) -> bool:
        """Whether ``item`` can be applied with the sink's block size (items storing no block always can)."""

    @abc.abstractmethod
    def _apply(self, item: ItemT) -> None:
        """Apply ``item`` to the sink, in order."""

    def _engine_block_size(self, item: ItemT) -> int | None:
        """The engine's block size as ``item`` shows it (for log lines; ``None``: it does not say)."""
        return None

    def offer(self, item: ItemT) -> None:
        """Apply ``item``, or hold it (in order, behind any held one) while the block sizes differ."""
        if self._held or not self._fits(item):
            self._hold(item)
        else:
            self._apply(item)

    def _hold(self, item: ItemT) -> None:
        if not self._held:
            self.logger.info(
                "kv_events_held",
                **self._where(),
                engine_block_size=self._engine_block_size(item),
                router_block_size=self.sink.block_size,
            )
        self._held.append(item)
        self.stats.held += 1
        while len(self._held) > self.max_held:
            dropped = self._held.popleft()
            self.stats.dropped_held += 1
            self._warn_once(
                "held_overflow",
                "kv_events_block_size_mismatch",
                router_block_size=self.sink.block_size,
                engine_block_size=self._engine_block_size(dropped),
                hint="the strategy hashes blocks of another size than the engine: leave its block_size unset or set it "
                "to the engine's; events are being dropped",
            )
            self.lose(f"held_{self.unit}_dropped", held=len(self._held))

    def resume(self) -> int:
        """Apply held items now that the block sizes agree; returns how many were applied."""
        applied = 0
        while self._held and self._fits(self._held[0]):
            self._apply(self._held.popleft())
            applied += 1
        return applied

    def _drop_held(self) -> None:
        """Forget held items (the stream restarts; they will not be applied)."""
        self._held.clear()

    # -- reporting -------------------------------------------------------------------------

    def _warn_once(self, key: str, event: str, *, level: str = "warning", **context: Any) -> None:
        """Log ``event`` the first time ``key`` comes up in this feed only."""
        if key not in self._warned:
            self._warned.add(key)
            getattr(self.logger, level)(event, **self._where(), **context)

    def report(self) -> dict[str, Any]:
        """The counters, as an adapter's ``stats()`` exports them: `FeedStats`, ``holding``, ``exact``,
        ``lost_reason``."""
        return {
            **attrs.asdict(self.stats),
            "holding": self.holding,
            "exact": self.exact,
            "lost_reason": self.lost_reason,
        }
