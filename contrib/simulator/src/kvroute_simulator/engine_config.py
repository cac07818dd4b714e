"""What sizes and times one engine: model and hardware specs, scheduler and cache settings, step costs.

:func:`kv_capacity_blocks` turns a model and its accelerators into a number of KV blocks;
:class:`EngineConfig` holds vLLM's scheduler and cache settings and the rules every engine
(and the hit-rate bound) applies to a request's blocks; :class:`CostModel` gives a step's
duration. See docs/simulation.md for the calibration.
"""

from __future__ import annotations

import attrs

from kvroute.validators import (
    INTEGER,
    expect,
    flag,
    non_negative_number,
    positive_integer,
    positive_number,
    positive_share,
)
from kvroute_simulator.sequences import EngineRequest

__all__ = [
    "DEFAULT_CAPACITY_BLOCKS",
    "H100_X8",
    "LLAMA_3_1_70B",
    "CostModel",
    "EngineConfig",
    "HardwareSpec",
    "ModelSpec",
    "Rejection",
    "kv_capacity_blocks",
]

GB = 10**9

_non_negative_integer = expect("an integer >= 0", *INTEGER, attrs.validators.ge(0))


@attrs.frozen
class ModelSpec:
    """The model dimensions that size the KV cache."""

    name: str
    num_layers: int = attrs.field(validator=positive_integer)
    num_kv_heads: int = attrs.field(validator=positive_integer)
    head_dim: int = attrs.field(validator=positive_integer)
    weight_bytes: int = attrs.field(validator=positive_integer)
    dtype_bytes: int = attrs.field(default=2, validator=positive_integer)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token: layers x KV heads x head dim x 2 (K, V) x dtype bytes."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes


@attrs.frozen
class HardwareSpec:
    """The accelerators of one instance and the share of their memory the engine may use."""

    num_gpus: int = attrs.field(default=8, validator=positive_integer)
    gpu_memory_bytes: int = attrs.field(default=80 * GB, validator=positive_integer)
    #: The share of GPU memory the engine may use, as vLLM's ``gpu_memory_utilization``: in (0, 1].
    memory_utilization: float = attrs.field(default=0.9, validator=positive_share)


#: Llama-3.1-70B: 80 layers, 8 KV heads (GQA) of dim 128; ~70.6 B parameters = ~141 GB in fp16/bf16.
LLAMA_3_1_70B = ModelSpec(
    "meta-llama/Llama-3.1-70B-Instruct", num_layers=80, num_kv_heads=8, head_dim=128, weight_bytes=140 * GB
)
#: One p5.48xlarge-like instance: 8 x H100 80 GB, vLLM's default gpu_memory_utilization 0.9.
H100_X8 = HardwareSpec()


def kv_capacity_blocks(model: ModelSpec = LLAMA_3_1_70B, hardware: HardwareSpec = H100_X8, block_size: int = 16) -> int:
    """Return how many KV blocks fit: (GPUs x memory x utilization - weights) / (bytes per token x block size)."""
    budget = hardware.num_gpus * hardware.gpu_memory_bytes * hardware.memory_utilization - model.weight_bytes
    if budget <= 0:
        raise ValueError(f"the weights ({model.weight_bytes} B) do not fit in the usable memory of {hardware!r}.")
    return int(budget // (model.kv_bytes_per_token * block_size))


#: 8 x 80 GB x 0.9 - 140 GB = 436 GB; / 327,680 B per token = 1,330,566 tokens = 83,160 blocks of 16.
DEFAULT_CAPACITY_BLOCKS = kv_capacity_blocks()


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Scheduler and cache settings of one engine (vLLM's names and defaults)."""

    block_size: int = attrs.field(default=16, validator=positive_integer)
    capacity_blocks: int = attrs.field(default=DEFAULT_CAPACITY_BLOCKS, validator=positive_integer)
    max_num_batched_tokens: int = attrs.field(default=8192, validator=positive_integer)
    max_num_seqs: int = attrs.field(default=256, validator=positive_integer)
    max_model_len: int = attrs.field(default=131_072, validator=positive_integer)
    enable_prefix_caching: bool = attrs.field(default=True, validator=flag)
    #: Blocks of the CPU tier that takes the blocks the GPU pool evicts (0: no CPU tier), see `HostTier`.
    cpu_capacity_blocks: int = attrs.field(default=0, validator=_non_negative_integer)
    #: Data-parallel ranks of the instance (vLLM's ``--data-parallel-size``): full engine copies, each with
    #: ``capacity_blocks`` of its own (see `DataParallelEngine`).
    data_parallel_size: int = attrs.field(default=1, validator=positive_integer)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the KV cache holds."""
        return self.capacity_blocks * self.block_size

    def rejection(self, request: EngineRequest) -> Rejection | None:
        """Return why an engine with these settings refuses ``request`` (None when it accepts it).

        vLLM answers such a request with HTTP 400 and goes on serving the others.
        """
        total = len(request.prompt) + request.output_len
        if total > self.max_model_len:
            return Rejection(
                f"prompt + output longer than max_model_len={self.max_model_len:,} tokens",
                f"request {request.request_id!r}: prompt + output must be at most max_model_len="
                f"{self.max_model_len} tokens (got {total}).",
            )
        blocks = -(-total // self.block_size)
        if blocks > self.capacity_blocks:
            return Rejection(
                f"more KV blocks than the whole cache (capacity_blocks={self.capacity_blocks:,})",
                f"request {request.request_id!r}: needs {blocks} KV blocks, more than the "
                f"cache's capacity_blocks={self.capacity_blocks}.",
            )
        return None

    def block_hashes(self, request: EngineRequest) -> list[int]:
        """Return the hashes by which the engine finds ``request``'s blocks (none without prefix caching)."""
        return request.block_hashes(self.block_size) if self.enable_prefix_caching else []

    def lookup_limit(self, num_hashes: int, num_tokens: int) -> int:
        """Return how many leading blocks a lookup may reuse: hashed full blocks, leaving >= 1 token to compute."""
        return min(num_hashes, (num_tokens - 1) // self.block_size)

    def stored_blocks(self, num_hashes: int, num_computed: int) -> int:
        """Return how many leading blocks are findable by hash once ``num_computed`` tokens are computed."""
        return min(num_hashes, num_computed // self.block_size)


@attrs.frozen
class Rejection:
    """Why an engine refuses a request at submit: ``reason`` names the limit, ``message`` the request and its size."""

    reason: str
    message: str


@attrs.frozen(kw_only=True)
class CostModel:
    """Step duration of Llama-3.1-70B on 8 x H100 (tensor parallel 8), in milliseconds.

    A step costs a base, plus per prefill chunk of ``n`` new tokens over ``c`` tokens
    already in the KV cache ``prefill_per_token_ms * n + attention_ms * n * (c + (n + 1) / 2)``
    (each new token attends over everything before it, so a cold prompt of L tokens costs
    ``prefill_base_ms + 0.040 L + 5.6e-7 L (L + 1)``), plus per decoding sequence with
    context ``t`` ``decode_per_seq_ms + kv_read_ms_per_token * t``. The base is
    ``decode_base_ms`` when the step decodes anything, ``prefill_base_ms`` otherwise.
    """

    prefill_base_ms: float = attrs.field(default=9.8, validator=non_negative_number)
    prefill_per_token_ms: float = attrs.field(default=0.040, validator=non_negative_number)
    attention_ms: float = attrs.field(default=1.12e-6, validator=non_negative_number)
    decode_base_ms: float = attrs.field(default=15.0, validator=non_negative_number)
    decode_per_seq_ms: float = attrs.field(default=0.040, validator=non_negative_number)
    kv_read_ms_per_token: float = attrs.field(default=2.0e-5, validator=non_negative_number)
    #: Llama-3.1-70B in bf16: 80 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 327,680 B.
    kv_bytes_per_token: int = attrs.field(default=327_680, validator=positive_integer)
    #: 8 GPUs x ~25 GB/s of effective PCIe host-to-device bandwidth each (tensor parallel: each loads its shard).
    cpu_reload_gb_per_s: float = attrs.field(default=200.0, validator=positive_number)

    def prefill_ms(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Return the cost of one prefill chunk, without the step base."""
        n = new_tokens
        return self.prefill_per_token_ms * n + self.attention_ms * n * (cached_tokens + (n + 1) / 2)

    def decode_ms(self, context_tokens: int) -> float:
        """Return the cost of decoding one token for one sequence, without the step base."""
        return self.decode_per_seq_ms + self.kv_read_ms_per_token * context_tokens

    def reload_ms(self, tokens: int) -> float:
        """Return the time to copy ``tokens`` tokens of KV from the CPU tier back to the GPUs."""
        return tokens * self.kv_bytes_per_token / (self.cpu_reload_gb_per_s * 1e6)

    def cold_prefill_ms(self, tokens: int) -> float:
        """Return the duration of a prefill-only step computing one cold prompt of ``tokens``."""
        return self.prefill_base_ms + self.prefill_ms(tokens)
