"""Stable 64-bit hashing shared by strategies and the simulator.

Python's ``hash()`` is salted per process, so two router replicas would disagree;
these functions give the same value in every process, on every machine.
"""

from __future__ import annotations

import xxhash

__all__ = ["hash64", "hash_parts"]


def hash64(data: bytes | str, seed: int = 0) -> int:
    """Return the xxh3 64-bit hash of ``data`` (strings are UTF-8 encoded)."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    return xxhash.xxh3_64_intdigest(data, seed)


def hash_parts(*parts: str | bytes | int | None, seed: int = 0) -> int:
    """Hash several fields into one 64-bit value.

    Each part is written with its type and length, so ``("ab", "c")`` and ``("a", "bc")``
    differ, and ``None``, ``""`` and ``0`` all differ.
    """
    h = xxhash.xxh3_64(seed=seed)
    for part in parts:
        if part is None:
            h.update(b"N;")
            continue
        if isinstance(part, bool | int):
            tag, raw = b"I", str(int(part)).encode()
        elif isinstance(part, str):
            tag, raw = b"S", part.encode("utf-8", "surrogatepass")
        else:
            tag, raw = b"B", bytes(part)
        h.update(b"%s%d:" % (tag, len(raw)))
        h.update(raw)
    return h.intdigest()
