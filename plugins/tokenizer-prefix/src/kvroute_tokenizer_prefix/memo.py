"""The piece memo: block hashes of text pieces whose whole prefix was hashed before (see `PromptBlocks`)."""

from __future__ import annotations

from array import array
from collections import OrderedDict

__all__ = ["PieceMemo"]


class PieceMemo:
    """Hashed pieces by chain key: ``key -> (hashes of the blocks the piece completes, leftover bytes, ids in it)``.

    Least recently used first out, bounded by the block hashes it holds (8 bytes each, in
    arrays) and by its number of entries (about 150 bytes each). Not thread-safe: the strategy
    uses it under its lock.
    """

    __slots__ = ("_data", "blocks", "max_blocks", "max_entries")

    def __init__(self, max_blocks: int = 1 << 19, max_entries: int = 1 << 16) -> None:
        self._data: OrderedDict[int, tuple[array[int], bytes, int]] = OrderedDict()
        #: Block hashes held in all entries.
        self.blocks = 0
        self.max_blocks = max_blocks
        self.max_entries = max_entries

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: int) -> bool:
        return key in self._data

    def get(self, key: int) -> tuple[array[int], bytes, int] | None:
        """The entry of ``key`` (now the most recently used), or ``None``."""
        found = self._data.get(key)
        if found is not None:
            self._data.move_to_end(key)
        return found

    def put(self, key: int, hashes: array[int], tail: bytes, count: int) -> None:
        """Remember a piece (the oldest entries go when a bound is passed)."""
        data = self._data
        if key in data:
            return
        data[key] = (hashes, tail, count)
        self.blocks += len(hashes)
        while self.blocks > self.max_blocks or len(data) > self.max_entries:
            _, (old, _, _) = data.popitem(last=False)
            self.blocks -= len(old)

    def merge(self, other: PieceMemo) -> int:
        """Add ``other``'s entries (a prefetch's); returns how many were new."""
        added = 0
        for key, (hashes, tail, count) in other._data.items():
            if key not in self._data:
                self.put(key, hashes, tail, count)
                added += 1
        return added

    def clear(self) -> None:
        """Forget every entry."""
        self._data.clear()
        self.blocks = 0
