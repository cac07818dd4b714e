"""Shared settings for the vLLM adapter tests: async tests run on asyncio (pyzmq's asyncio sockets)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    """The proxy's event loop: asyncio."""
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The e2e tiny model's tokenizer files (byte-identical to what build_tiny_model.py writes), built without torch."""
    from tests.e2e.vllm.build_tiny_model import build_tokenizer

    out = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(out, 0, 4096)
    return str(out)
