"""TensorRT-LLM's V1 block hash (``hash_algo`` ``v1_block_key``): what the engine keys a KV block on.

The C++ ``BlockKeyHasher`` (and its Python mirror ``hash_v1_block_key`` in
``tensorrt_llm/runtime/kv_cache_hash.py``, which the engine's tests compare with the C++ one)
hashes, per block:

* a seed ``len(tokens) ^ (parent_hash * 0xBF58476D1CE4E5B9)`` (``parent_hash`` 0 for the first block);
* the request's cache salt id, first block only;
* each token id (32-bit mix), and each ``token_extra_id`` when the request carries extra ids;
* multimodal extra keys, then the LoRA task id, on every block.

The hash is deterministic (no process seed), so the adapter recomputes it for plain text tokens
and compares it with the event's ``block_hash``: a mismatch means the engine keyed the block on
something the event does not show (V1 serializers never send ``lora_id``), and the block cannot
be matched by a request hashed from tokens alone. The router still builds its own hashes from
token ids (`kvroute_tokenizer_prefix.blocks`); this one is only a check.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["v1_block_hash"]

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_PARENT_MUL = 0xBF58476D1CE4E5B9
_MIX32_MUL = 0x45D9F3B
_MIX64_MUL1 = 0xBF58476D1CE4E5B9
_MIX64_MUL2 = 0x94D049BB133111EB
_GOLDEN = 0x9E3779B9


def _fold(seed: int, term: int) -> int:
    """``seed ^= term + (seed << 6) + (seed >> 2)`` in 64-bit arithmetic."""
    return seed ^ ((term + ((seed << 6) & _U64) + (seed >> 2)) & _U64)


def _mix_token(token: int, seed: int) -> int:
    a = token & _U32
    a = (((a >> 16) ^ a) * _MIX32_MUL) & _U32
    a = (((a >> 16) ^ a) * _MIX32_MUL) & _U32
    a = (a >> 16) ^ a
    # The engine adds the constant in 32-bit arithmetic before widening.
    return _fold(seed, (a + _GOLDEN) & _U32)


def _mix_u64(value: int, seed: int) -> int:
    v = value & _U64
    v = ((v ^ (v >> 30)) * _MIX64_MUL1) & _U64
    v = ((v ^ (v >> 27)) * _MIX64_MUL2) & _U64
    v ^= v >> 31
    return _fold(seed, v + _GOLDEN)


def v1_block_hash(
    token_ids: Iterable[int],
    parent_hash: int = 0,
    *,
    lora_task_id: int | None = None,
    cache_salt_id: int | None = None,
) -> int:
    """The engine's ``v1_block_key`` hash of one block of text tokens after ``parent_hash``.

    ``cache_salt_id`` counts on the first block only (``parent_hash`` 0), ``lora_task_id`` on
    every block, as in the engine. Returns an unsigned 64-bit integer.
    """
    tokens = list(token_ids)
    seed = (len(tokens) ^ ((parent_hash * _PARENT_MUL) & _U64)) & _U64
    if parent_hash == 0 and cache_salt_id is not None:
        seed = _mix_u64(cache_salt_id, seed)
    for token in tokens:
        seed = _mix_token(token, seed)
    if lora_task_id is not None:
        seed = _mix_u64(lora_task_id, seed)
    return seed
