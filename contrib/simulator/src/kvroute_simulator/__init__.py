"""The fleet simulator behind ``kvroute simulate``: engine model, workloads, driver.

Pure Python, virtual time, deterministic for a seed. See docs/simulation.md.
"""

from __future__ import annotations

from kvroute_simulator.engine import (
    DEFAULT_CAPACITY_BLOCKS,
    H100_X8,
    LLAMA_3_1_70B,
    CostModel,
    Engine,
    EngineConfig,
    EngineRequest,
    EngineSequence,
    EngineStats,
    HardwareSpec,
    ModelSpec,
    Rejection,
    StepResult,
    ideal_hit_tokens,
    kv_capacity_blocks,
)
from kvroute_simulator.tokens import TokenSeq, Vocabulary, vocabulary
from kvroute_simulator.workloads import (
    WORKLOADS,
    Arrival,
    HotPrefix,
    LongPrefix,
    MultiTurn,
    Rag,
    Trace,
    TraceFormatError,
    Workload,
    make_workload,
)

__all__ = [
    "DEFAULT_CAPACITY_BLOCKS",
    "H100_X8",
    "LLAMA_3_1_70B",
    "WORKLOADS",
    "Arrival",
    "CostModel",
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "EngineSequence",
    "EngineStats",
    "HardwareSpec",
    "HotPrefix",
    "LongPrefix",
    "ModelSpec",
    "MultiTurn",
    "Rag",
    "Rejection",
    "StepResult",
    "TokenSeq",
    "Trace",
    "TraceFormatError",
    "Vocabulary",
    "Workload",
    "ideal_hit_tokens",
    "kv_capacity_blocks",
    "make_workload",
    "vocabulary",
]
