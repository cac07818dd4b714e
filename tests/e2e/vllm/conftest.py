"""Fixtures that run real vLLM (CPU build) servers; every test here is skipped unless KVROUTE_VLLM_PYTHON is set.

KVROUTE_VLLM_PYTHON   the vLLM virtualenv's python (setup_vllm_env.sh prints it)
KVROUTE_TINY_MODEL    optional: where to build (or find) the tiny model; a temporary directory otherwise
KVROUTE_VLLM_LOG_DIR  optional: where the servers' logs go; a temporary directory otherwise
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.vllm.servers import VllmServer, ensure_tiny_model, start_vllm_servers


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The interpreter of the vLLM virtualenv, or a skip when none is configured."""
    python = os.environ.get("KVROUTE_VLLM_PYTHON")
    if not python:
        pytest.skip("KVROUTE_VLLM_PYTHON is not set (run `tox -e e2e-vllm`)")
    return python


@pytest.fixture(scope="session")
def tiny_model(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the tiny random Llama and its tokenizer, built once per session."""
    given = os.environ.get("KVROUTE_TINY_MODEL")
    out = Path(given) if given else tmp_path_factory.mktemp("tiny-model") / "model"
    return ensure_tiny_model(vllm_python, out)


@pytest.fixture(scope="session")
def vllm_servers(
    vllm_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmServer]]:
    """Two vLLM servers on loopback, one core each, stopped when the session ends."""
    given = os.environ.get("KVROUTE_VLLM_LOG_DIR")
    logs = Path(given) if given else tmp_path_factory.mktemp("vllm-logs")
    # Dev mode adds POST /reset_prefix_cache, which the routing tests use between strategies.
    with start_vllm_servers(
        vllm_python, tiny_model, 2, log_dir=logs, extra_env={"VLLM_SERVER_DEV_MODE": "1"}
    ) as servers:
        yield servers
