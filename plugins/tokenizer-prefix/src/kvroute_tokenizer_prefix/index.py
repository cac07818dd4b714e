"""Which KV blocks each backend probably holds: a bounded index, and a short record of recent decisions.

`BlockIndex` keeps, per backend, an LRU set of the router's block hashes (see
`kvroute_tokenizer_prefix.blocks`) with a capacity in blocks, plus one map from block hash to
the set of backends holding it (a bit mask) for fast matching. Two ways feed it:

* approximate: the strategy records the blocks of every request it sends (``record``), in
  reverse order so that a prefix's first blocks are the most recent and its tail is evicted
  first, as engines evict;
* exact: a backend adapter translates the engine's KV events into ``blocks_stored`` (token
  ids + block size + parent, from which the router recomputes its own hashes),
  ``blocks_removed`` (the engine's hashes, mapped back) and ``all_cleared``. A backend marked
  exact (``set_exact``) no longer gets approximate records; the strategy keeps its own recent
  decisions in `RecentDecisions` instead, so that sibling requests co-locate before the
  engine reports their blocks.

Data-parallel ranks: a backend with ranks holds one cache per rank. Each rank is a *slot* of the
index (`BlockIndex.slot`: rank 0 is the backend's own name, rank R > 0 ``"<backend>#dp<R>"``),
with its own bit, LRU and engine hashes; exactness, removal and capacity stay the backend's.
Without data parallelism every backend is one slot, its own name: nothing changes.

Tiers: a block may also be held on a slower tier than the GPU (``CPU``, ``DISK``: an engine's
KV offloading, `kvroute.adapters.kv_events.tier_of`). Such blocks are kept per slot and tier in
their own LRU (bounded like the GPU's) and masks (`BlockIndex.tier_holders`, and `BlockIndex.tiered`
for any slower tier); `holders` stays the GPU's. A block the engine moves from GPU to CPU
(removed on GPU, stored on CPU under the same engine hash, with or without its token ids) moves
tier: engine hashes removed from the GPU are remembered a while (`GHOSTS`) for a store that
names them only by hash.

Memory: about 190 bytes per (backend, block) entry on 64-bit CPython (measured in
``benchmarks/bench_tokenizer_prefix.py``), so the default capacity of 32,768 blocks per backend
costs about 6 MB per backend. Every method is thread-safe (one lock).
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

from kvroute.adapters.kv_events import GPU
from kvroute.logs import get_logger
from kvroute_tokenizer_prefix.blocks import block_hashes, root_hash

__all__ = ["DEFAULT_CAPACITY_BLOCKS", "GHOSTS", "GPU", "BlockIndex", "RecentDecisions"]

log = get_logger(__name__)

#: Engine hashes removed from the GPU remembered per slot, for a slower tier's store naming blocks by hash only.
GHOSTS = 4096
#: Between a backend's name and a rank in a slot name.
_RANK_SEP = "#dp"

#: Blocks remembered per backend unless ``capacity_blocks`` or `BlockIndex.set_capacity` says otherwise.
DEFAULT_CAPACITY_BLOCKS = 32_768


class BlockIndex:
    """A bounded per-backend LRU of block hashes with a hash -> holders map; thread-safe."""

    def __init__(self, block_size: int, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        if block_size < 1:
            raise ValueError(f"'block_size' must be >= 1 (got {block_size}).")
        if capacity_blocks < 1:
            raise ValueError(f"'capacity_blocks' must be >= 1 (got {capacity_blocks}).")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.lock = threading.RLock()
        #: hash -> bit mask of the backends holding it (bits from ``bit``).
        self.holders: dict[int, int] = {}
        self._bits: dict[str, int] = {}
        self._free: list[int] = []
        self._next_bit = 0
        self._lru: dict[str, OrderedDict[int, int | None]] = {}
        self._engine: dict[str, dict[int, int]] = {}
        self._capacity: dict[str, int] = {}
        self._exact: set[str] = set()
        #: backend -> why it is not exact (as the adapter said), while it is not.
        self._reasons: dict[str, str | None] = {}
        #: Events whose parent block was unknown (lost or evicted): their blocks were skipped.
        self.orphan_events = 0
        self.evictions = 0
        #: slot name -> its backend, for the ranks above 0 (`slot`); backend -> its slots above rank 0.
        self._owner: dict[str, str] = {}
        self._slots: dict[str, set[str]] = {}
        #: tier -> hash -> bit mask of the slots holding it on that (slower) tier.
        self.tier_holders: dict[str, dict[int, int]] = {}
        #: hash -> bit mask of the slots holding it on any slower tier.
        self.tiered: dict[int, int] = {}
        self._tier_lru: dict[tuple[str, str], OrderedDict[int, int | None]] = {}
        self._ghosts: dict[str, OrderedDict[int, int]] = {}
        #: Tier stores naming a block by engine hash alone that no earlier event named: skipped.
        self.unresolved_tier_blocks = 0

    # -- backends ------------------------------------------------------------------------

    def bit(self, backend: str) -> int:
        """The bit that stands for ``backend`` in holder masks (assigned on first use)."""
        found = self._bits.get(backend)
        if found is not None:
            return found
        with self.lock:
            found = self._bits.get(backend)
            if found is None:
                if self._free:
                    found = self._free.pop()
                else:
                    found = 1 << self._next_bit
                    self._next_bit += 1
                self._bits[backend] = found
            return found

    def backend_of(self, bit: int) -> str | None:
        """The backend a bit stands for, if any."""
        for name, b in self._bits.items():
            if b == bit:
                return name
        return None

    def slot(self, backend: str, rank: int | None = None) -> str:
        """The index's name for data-parallel ``rank`` of ``backend`` (the backend's own for ``None`` and 0)."""
        if not rank:
            return backend
        name = f"{backend}{_RANK_SEP}{rank}"
        if name not in self._owner:
            with self.lock:
                self._owner[name] = backend
                self._slots.setdefault(backend, set()).add(name)
        return name

    def owner(self, slot: str) -> str:
        """The backend a slot belongs to (a backend's own name is its rank-0 slot)."""
        return self._owner.get(slot, slot)

    def slots_of(self, backend: str) -> list[str]:
        """Every slot the index knows for ``backend``: its own name, then its ranks above 0 seen so far."""
        return [backend, *sorted(self._slots.get(backend, ()))]

    def remove_backend(self, backend: str) -> None:
        """Forget a backend (every rank) and everything it held; its bits are reused later."""
        with self.lock:
            for slot in self.slots_of(backend):
                self._drop_all(slot)
                bit = self._bits.pop(slot, None)
                self._lru.pop(slot, None)
                self._engine.pop(slot, None)
                self._ghosts.pop(slot, None)
                self._owner.pop(slot, None)
                if bit is not None:
                    self._free.append(bit)
            self._slots.pop(backend, None)
            self._capacity.pop(backend, None)
            self._exact.discard(backend)
            self._reasons.pop(backend, None)

    def set_capacity(self, backend: str, blocks: int) -> None:
        """Blocks remembered for ``backend`` (e.g. the engine's ``num_gpu_blocks``); evicts beyond it."""
        if blocks < 1:
            raise ValueError(f"'blocks' must be >= 1 (got {blocks}).")
        with self.lock:
            self._capacity[backend] = blocks
            for slot in self.slots_of(backend):
                lru = self._lru.get(slot)
                if lru is not None:
                    self._evict(slot, lru, self.bit(slot))

    def capacity(self, backend: str) -> int:
        """Blocks remembered for ``backend`` (or a slot of it: each rank and tier remembers as many)."""
        return self._capacity.get(self._owner.get(backend, backend), self.capacity_blocks)

    def set_exact(self, backend: str, exact: bool = True, *, reason: str | None = None) -> None:
        """Mark a backend as fed by KV events; switching to exact forgets its approximate records.

        ``reason`` says why a backend stops being exact (``"lost_batches"``, ``"unknown_kind"``...);
        `inexact_reason` returns it until the backend is exact again.
        """
        with self.lock:
            if exact and backend not in self._exact:
                for slot in self.slots_of(backend):
                    self._drop_all(slot)
                self._exact.add(backend)
            elif not exact:
                self._exact.discard(backend)
            self._reasons[backend] = None if exact else reason

    def inexact_reason(self, backend: str) -> str | None:
        """Why ``backend`` is not exact, as its adapter last said (``None`` when exact or not said)."""
        return self._reasons.get(backend)

    def is_exact(self, backend: str) -> bool:
        """Whether ``backend``'s (or the slot's backend's) blocks come from KV events."""
        return self._owner.get(backend, backend) in self._exact

    @property
    def exact_backends(self) -> frozenset[str] | set[str]:
        """The backends whose blocks come from KV events (read only)."""
        return self._exact

    # -- reading -------------------------------------------------------------------------

    def blocks(self, backend: str) -> int:
        """How many blocks ``backend`` holds in the index."""
        lru = self._lru.get(backend)
        return len(lru) if lru is not None else 0

    def __len__(self) -> int:
        """Distinct block hashes held by any backend."""
        return len(self.holders)

    def holds(self, backend: str, block_hash: int) -> bool:
        """Whether ``backend`` holds ``block_hash``."""
        bit = self._bits.get(backend)
        return bit is not None and bool(self.holders.get(block_hash, 0) & bit)

    def match(self, hashes: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        """For each backend, how many leading blocks of ``hashes`` it holds."""
        with self.lock:
            bits = {self.bit(b): b for b in backends}
            alive = sum(bits)
            out = dict.fromkeys(bits.values(), 0)
            get = self.holders.get
            for i, h in enumerate(hashes):
                now = alive & get(h, 0)
                if now != alive:
                    for bit, name in bits.items():
                        if alive & bit and not now & bit:
                            out[name] = i
                    alive = now
                    if not alive:
                        break
            else:
                for bit, name in bits.items():
                    if alive & bit:
                        out[name] = len(hashes)
            return out

    # -- writing -------------------------------------------------------------------------

    def _lru_of(self, backend: str) -> OrderedDict[int, int | None]:
        lru = self._lru.get(backend)
        if lru is None:
            lru = self._lru[backend] = OrderedDict()
        return lru

    def _evict(self, backend: str, lru: OrderedDict[int, int | None], bit: int, tier: str = GPU) -> None:
        cap = self.capacity(backend)
        holders = self.holders if tier == GPU else self.tier_holders[tier]
        engine = self._engine.get(backend)
        while len(lru) > cap:
            h, engine_hash = lru.popitem(last=False)
            self._unhold(holders, h, bit)
            if tier != GPU:
                self._retier(h)
            if engine is not None and engine_hash is not None and not self._held_anywhere(backend, h):
                engine.pop(engine_hash, None)
            self.evictions += 1

    def _held_anywhere(self, slot: str, h: int) -> bool:
        """Whether ``slot`` holds ``h`` on some tier (GPU or slower)."""
        lru = self._lru.get(slot)
        if lru is not None and h in lru:
            return True
        bit = self._bits.get(slot)
        return bit is not None and bool(self.tiered.get(h, 0) & bit)

    def _retier(self, h: int) -> None:
        """Recompute ``tiered[h]`` from the tiers' masks."""
        mask = 0
        for masks in self.tier_holders.values():
            mask |= masks.get(h, 0)
        if mask:
            self.tiered[h] = mask
        else:
            self.tiered.pop(h, None)

    @staticmethod
    def _unhold(holders: dict[int, int], h: int, bit: int) -> None:
        mask = holders.get(h, 0) & ~bit
        if mask:
            holders[h] = mask
        else:
            holders.pop(h, None)

    def _drop_all(self, backend: str) -> None:
        bit = self._bits.get(backend)
        if bit is None:
            return
        for (slot, tier), tier_lru in list(self._tier_lru.items()):
            if slot == backend:
                masks = self.tier_holders[tier]
                for h in tier_lru:
                    self._unhold(masks, h, bit)
                    self._retier(h)
                del self._tier_lru[slot, tier]
        lru = self._lru.get(backend)
        if lru is not None:
            for h in lru:
                self._unhold(self.holders, h, bit)
            lru.clear()
        self._engine.pop(backend, None)
        self._ghosts.pop(backend, None)

    def record(self, backend: str, hashes: Sequence[int]) -> None:
        """Approximate update: ``backend`` was sent a prompt with these blocks (first block most recent).

        ``hashes`` must be a prompt's hashes from its first block on. Every block is then more
        recent than the blocks after it in any prompt, so eviction takes tails first and an
        approximate backend's blocks stay *prefix-closed*: holding a block means holding
        every block before it (the strategy's matching relies on it).
        """
        with self.lock:
            bit = self.bit(backend)
            lru = self._lru_of(backend)
            holders = self.holders
            new = [h for h in hashes if h not in lru]
            if new:
                get = holders.get
                for h in new:
                    holders[h] = get(h, 0) | bit
                lru.update(dict.fromkeys(new))
            # Moving every block to the end in reverse order leaves the first block the most recent.
            deque(map(lru.move_to_end, reversed(hashes)), maxlen=0)
            self._evict(backend, lru, bit)

    def blocks_stored(
        self,
        backend: str,
        token_ids: Sequence[int] | array[int],
        *,
        block_size: int,
        parent_engine_hash: int | None = None,
        engine_hashes: Sequence[int] | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
        parent: int | None = None,
        rank: int | None = None,
        medium: str | None = None,
    ) -> list[int]:
        """Exact update from a "blocks stored" event; returns the router hashes stored.

        ``token_ids`` is the flat list of the stored blocks' tokens (full blocks only count).
        The chain continues from ``parent_engine_hash`` (mapped to the router's hash through
        earlier events), or from ``parent`` (a router hash), or starts at the root of ``lora``
        and ``cache_salt``. ``engine_hashes``, one per full block, lets later
        ``blocks_removed`` events name the blocks. A parent that is unknown (its event was lost
        or it was evicted here) makes the event unusable: it is counted in ``orphan_events``.

        ``rank``: the engine's data-parallel rank (its slot, `slot`). ``medium``: the tier the
        blocks are on (``None`` or ``"GPU"``: the GPU; ``"CPU"``, ``"DISK"``...: a slower tier). A
        slower tier's store with no token ids names blocks by ``engine_hashes`` alone: each is
        the block an earlier event of this slot named so (on any tier); unknown ones are skipped
        (``unresolved_tier_blocks``).
        """
        if block_size != self.block_size:
            raise ValueError(
                f"KV event for backend {backend!r} has block_size {block_size}, but the index hashes "
                f"blocks of {self.block_size} tokens; set the strategy's 'block_size' to the engine's."
            )
        tier = medium or GPU
        slot = self.slot(backend, rank)
        with self.lock:
            engine_map = self._engine.get(slot, {})
            if tier != GPU and not token_ids and engine_hashes:
                return self._tier_by_hash(slot, tier, engine_hashes)
            if parent is None and parent_engine_hash is not None:
                parent = engine_map.get(parent_engine_hash)
                if parent is None:
                    parent = self._ghosts.get(slot, {}).get(parent_engine_hash)
                if parent is None:
                    self.orphan_events += 1
                    log.debug("kv_event_orphan", backend=slot, parent=parent_engine_hash)
                    return []
            hashes = block_hashes(
                token_ids, block_size, parent=parent if parent is not None else root_hash(lora, cache_salt)
            )
            if engine_hashes is not None and len(engine_hashes) != len(hashes):
                raise ValueError(
                    f"KV event for backend {backend!r} names {len(engine_hashes)} block hashes for "
                    f"{len(hashes)} full blocks of {block_size} tokens ({len(token_ids)} token ids)."
                )
            bit = self.bit(slot)
            if tier == GPU:
                lru = self._lru_of(slot)
                holders = self.holders
            else:
                lru = self._tier_lru.setdefault((slot, tier), OrderedDict())
                holders = self.tier_holders.setdefault(tier, {})
            engine = self._engine.setdefault(slot, {}) if engine_hashes is not None else None
            for i, h in enumerate(hashes):
                engine_hash = engine_hashes[i] if engine_hashes is not None else None
                if h in lru:
                    lru.move_to_end(h)
                    if engine_hash is not None:
                        lru[h] = engine_hash
                else:
                    lru[h] = engine_hash
                    holders[h] = holders.get(h, 0) | bit
                    if tier != GPU:
                        self.tiered[h] = self.tiered.get(h, 0) | bit
                if engine is not None and engine_hash is not None:
                    engine[engine_hash] = h
            self._evict(slot, lru, bit, tier)
            return hashes

    def _tier_by_hash(self, slot: str, tier: str, engine_hashes: Sequence[int]) -> list[int]:
        """A slower tier's store naming blocks by engine hash only (an offload): each known block moves in."""
        engine = self._engine.setdefault(slot, {})
        ghosts = self._ghosts.get(slot, {})
        bit = self.bit(slot)
        lru = self._tier_lru.setdefault((slot, tier), OrderedDict())
        holders = self.tier_holders.setdefault(tier, {})
        stored = []
        for engine_hash in engine_hashes:
            h = engine.get(engine_hash)
            if h is None:
                h = ghosts.get(engine_hash)
            if h is None:
                self.unresolved_tier_blocks += 1
                continue
            engine[engine_hash] = h
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = engine_hash
                holders[h] = holders.get(h, 0) | bit
                self.tiered[h] = self.tiered.get(h, 0) | bit
            stored.append(h)
        self._evict(slot, lru, bit, tier)
        return stored

    def blocks_removed(
        self,
        backend: str,
        engine_hashes: Iterable[int] = (),
        *,
        hashes: Iterable[int] = (),
        rank: int | None = None,
        medium: str | None = None,
    ) -> int:
        """Exact update from a "blocks removed" event (engine hashes, or router ``hashes``); returns blocks removed.

        ``rank`` and ``medium`` as in `blocks_stored`: the blocks leave that slot's tier only.
        """
        removed = 0
        tier = medium or GPU
        slot = self.slot(backend, rank)
        with self.lock:
            lru = self._lru.get(slot) if tier == GPU else self._tier_lru.get((slot, tier))
            bit = self._bits.get(slot)
            if lru is None or bit is None:
                return 0
            engine = self._engine.get(slot, {})
            holders = self.holders if tier == GPU else self.tier_holders[tier]
            ghosts = self._ghosts.setdefault(slot, OrderedDict()) if tier == GPU else None
            engine_hashes_list = list(engine_hashes)
            targets = []
            for e in engine_hashes_list:
                h = engine.get(e)
                targets.append(h)
                if h is not None and ghosts is not None:
                    ghosts[e] = h
                    ghosts.move_to_end(e)
            if ghosts is not None:
                while len(ghosts) > GHOSTS:
                    ghosts.popitem(last=False)
            for h in [*targets, *hashes]:
                if h is not None and h in lru:
                    lru.pop(h)
                    self._unhold(holders, h, bit)
                    if tier != GPU:
                        self._retier(h)
                    removed += 1
            for e, h in zip(engine_hashes_list, targets, strict=True):
                if h is not None and not self._held_anywhere(slot, h):
                    engine.pop(e, None)
        return removed

    def all_cleared(self, backend: str, rank: int | None = None) -> None:
        """Exact update from an "all blocks cleared" event (or an engine restart): every rank, or ``rank``'s."""
        with self.lock:
            for slot in self.slots_of(backend) if rank is None else [self.slot(backend, rank)]:
                self._drop_all(slot)

    def tier_of_block(self, slot: str, h: int) -> str | None:
        """The fastest tier ``slot`` holds block ``h`` on (`GPU` first), ``None`` when it holds it nowhere."""
        bit = self._bits.get(slot)
        if bit is None:
            return None
        if self.holders.get(h, 0) & bit:
            return GPU
        if self.tiered.get(h, 0) & bit:
            for tier, masks in self.tier_holders.items():
                if masks.get(h, 0) & bit:
                    return tier
        return None

    def tier_blocks(self, backend: str) -> dict[str, int]:
        """Blocks ``backend`` (all its ranks) holds per tier, the GPU's included."""
        out: dict[str, int] = {}
        for slot in self.slots_of(backend):
            out[GPU] = out.get(GPU, 0) + self.blocks(slot)
            for (name, tier), lru in self._tier_lru.items():
                if name == slot:
                    out[tier] = out.get(tier, 0) + len(lru)
        return out

    def clear(self) -> None:
        """Forget every block of every backend."""
        with self.lock:
            for backend in {*self._lru, *(slot for slot, _ in self._tier_lru)}:
                self._drop_all(backend)

    def reset(self, block_size: int) -> None:
        """Forget everything and hash blocks of ``block_size`` from now on (the engine's changed)."""
        if block_size < 1:
            raise ValueError(f"'block_size' must be >= 1 (got {block_size}).")
        with self.lock:
            self.clear()
            self.block_size = block_size


class RecentDecisions:
    """Blocks the router itself just sent to exact-mode backends, until the request ends or ``ttl_s`` passes.

    A backend fed by KV events only learns about a prompt's blocks once the engine has
    prefilled it; sibling requests sent in between (a burst, ``n`` samples, a fan-out) would
    scatter. This record makes them match the backend their first sibling went to.

    A request that finished (`finish`) is kept ``grace_s`` seconds more, unless the engine's
    events already cover its blocks: an engine publishes its events at the end of a step, and a
    short request's answer can reach the router before they do, so a sibling sent right after it
    would otherwise find nothing. Memory is bounded by ``max_entries`` (oldest dropped first).
    """

    def __init__(
        self,
        ttl_s: float = 30.0,
        max_entries: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
        grace_s: float = 0.0,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.grace_s = grace_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, int, Sequence[int]]] = OrderedDict()
        #: Finished requests kept for ``grace_s``: (until, request id, the entry kept).
        self._finished: deque[tuple[float, str, tuple[float, int, Sequence[int]]]] = deque()
        #: Finished requests kept for the grace, and those dropped at once because the engine had reported them.
        self.kept_after_finish = 0
        self.covered_at_finish = 0
        self._counts: dict[tuple[int, int], int] = {}
        #: hash -> bit mask of backends a recent decision sent it to.
        self.holders: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, bit: int, hashes: Sequence[int]) -> None:
        """Remember that ``hashes`` were just sent to the backend of ``bit``."""
        self.discard(request_id)
        self.expire()
        self._entries[request_id] = (self._clock() + self.ttl_s, bit, hashes)
        counts, holders = self._counts, self.holders
        for h in hashes:
            key = (h, bit)
            n = counts.get(key, 0)
            counts[key] = n + 1
            if not n:
                holders[h] = holders.get(h, 0) | bit
        while len(self._entries) > self.max_entries:
            self.discard(next(iter(self._entries)))

    def extend(self, request_id: str, hashes: Sequence[int]) -> bool:
        """Add blocks to a remembered request (its prompt was hashed further); False if it is gone."""
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        expires, bit, old = entry
        self._entries[request_id] = (expires, bit, (*old, *hashes))
        counts, holders = self._counts, self.holders
        for h in hashes:
            key = (h, bit)
            n = counts.get(key, 0)
            counts[key] = n + 1
            if not n:
                holders[h] = holders.get(h, 0) | bit
        return True

    def discard(self, request_id: str) -> None:
        """Forget a request (it finished, or the engine has reported its blocks)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        _, bit, hashes = entry
        counts, holders = self._counts, self.holders
        for h in hashes:
            key = (h, bit)
            n = counts.get(key, 0) - 1
            if n > 0:
                counts[key] = n
                continue
            counts.pop(key, None)
            mask = holders.get(h, 0) & ~bit
            if mask:
                holders[h] = mask
            else:
                holders.pop(h, None)

    def finish(self, request_id: str, covered: Callable[[int, Sequence[int]], bool] | None = None) -> None:
        """The request ended: forget it now if ``covered(bit, hashes)`` (the engine reported them) or without a
        grace, else in ``grace_s`` seconds."""
        entry = self._entries.get(request_id)
        if entry is None:
            return
        if self.grace_s <= 0 or (covered is not None and covered(entry[1], entry[2])):
            self.covered_at_finish += self.grace_s > 0
            self.discard(request_id)
            return
        self.kept_after_finish += 1
        self._finished.append((self._clock() + self.grace_s, request_id, entry))

    def expire(self) -> None:
        """Drop entries older than ``ttl_s``, and finished ones past their grace."""
        now = self._clock()
        finished = self._finished
        while finished and finished[0][0] <= now:
            _, request_id, entry = finished.popleft()
            if self._entries.get(request_id) is entry:
                self.discard(request_id)
        while self._entries:
            request_id, (expires, _, _) = next(iter(self._entries.items()))
            if expires > now:
                break
            self.discard(request_id)

    def drop_bit(self, bit: int) -> None:
        """Forget every entry of one backend (it left the fleet)."""
        for request_id in [r for r, (_, b, _) in self._entries.items() if b == bit]:
            self.discard(request_id)
