"""The engine emulator behind ``kvroute emulate``: a fake vLLM server for tests and benchmarks."""

from __future__ import annotations

from kvroute_simulator.emulator.app import EmulatorApp, EmulatorConfig, Faults, tokenize_chat, tokenize_text
from kvroute_simulator.emulator.realtime import RealTimeEngine

__all__ = ["EmulatorApp", "EmulatorConfig", "Faults", "RealTimeEngine", "tokenize_chat", "tokenize_text"]
