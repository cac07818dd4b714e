"""What an emulator serves and how its engine is sized, the faults it injects, and what it saw."""

from __future__ import annotations

from typing import Any

import attrs

from kvroute_simulator.emulator.kv_events import KvEventsConfig
from kvroute_simulator.engine import CostModel, DataParallelEngine, Engine, EngineConfig, KvEventListener, make_engine

__all__ = ["EmulatorConfig", "EmulatorStats", "Faults"]


@attrs.frozen(kw_only=True)
class EmulatorConfig:
    """What the emulated server serves and how its engine is sized (vLLM's flag names)."""

    model: str = "emulated"
    block_size: int = 16
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    enable_prefix_caching: bool = True
    time_scale: float = 1.0
    default_max_tokens: int = 16
    prompt_tokens_details: bool = True
    #: Data-parallel ranks behind the one URL (vLLM's ``--data-parallel-size``): each a full engine copy.
    data_parallel_size: int = 1
    #: CPU tier capacity in blocks per rank (0: none), and what a CPU hit costs to copy back.
    num_cpu_blocks: int = 0
    kv_bytes_per_token: int = CostModel().kv_bytes_per_token
    cpu_reload_gbps: float = CostModel().cpu_reload_gb_per_s
    #: vLLM's ``--kv-events-config`` (None: no KV events, as vLLM without it).
    kv_events: KvEventsConfig | None = None
    #: The address HTTP is served on: a wildcard KV events endpoint is bound there.
    host: str = "127.0.0.1"

    def engine(self, listener: KvEventListener | None = None) -> Engine | DataParallelEngine:
        """A fresh engine model with these settings (the simulator's cost model, with this KV size and bandwidth)."""
        sizes: dict[str, Any] = {}
        if self.num_gpu_blocks is not None:
            sizes["capacity_blocks"] = self.num_gpu_blocks
        config = EngineConfig(
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            cpu_capacity_blocks=self.num_cpu_blocks,
            data_parallel_size=self.data_parallel_size,
            **sizes,
        )
        cost = CostModel(kv_bytes_per_token=self.kv_bytes_per_token, cpu_reload_gb_per_s=self.cpu_reload_gbps)
        return make_engine(config, cost, name=self.model, listener=listener, coalesce_decodes=False)


@attrs.define
class Faults:
    """Failures to inject, changeable at runtime through ``POST /emulator/faults``.

    Counts are "how many of the next requests"; ``-1`` means every request until changed.
    """

    error_next: int = 0
    error_status: int = 500
    die_next: int = 0
    die_after_events: int = 1
    delay_s: float = 0.0
    health_status: int = 200

    def take(self, name: str) -> bool:
        value: int = getattr(self, name)
        if value == 0:
            return False
        if value > 0:
            setattr(self, name, value - 1)
        return True


@attrs.define
class EmulatorStats:
    """What the emulator saw (for tests): requests, disconnects, requests aborted in the engine, faults fired."""

    requests: int = 0
    completed: int = 0
    client_disconnects: int = 0
    aborted: int = 0
    errors_injected: int = 0
    deaths_injected: int = 0
    #: Generation requests each data-parallel rank took.
    rank_requests: list[int] = attrs.field(factory=lambda: [0])
