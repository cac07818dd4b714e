"""The capacity-tight case on two real vLLM servers: placement by KV footprint against hashing.

Two servers with ``--num-gpu-blocks-override 100`` (100 blocks of 128 tokens each), eight ~2,300-token
system prompts (more than hash placement can balance over two engines: this workload's hashing puts five
or more on one) and 48 streamed chats at concurrency 2 (`tests.e2e.vllm.capacity`), sent through
``kvroute serve`` once per strategy with both prefix caches reset in between. The hit rate is the
engines' own ``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``.

The servers are this module's own (the other tests' servers keep the default KV size); they stop when
the module's tests are done. Results go to ``$KVROUTE_E2E_CAPACITY_RESULTS`` (JSON) when it is set.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvroute import Backend, Fleet, Router, RouteRequest
from kvroute.testing import assign
from tests.e2e.vllm.capacity import capacity_workload, run_case
from tests.e2e.vllm.servers import SERVED_MODEL_NAME, VllmServer, post_json, start_vllm_servers

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.environ.get("KVROUTE_VLLM_PYTHON"), reason="KVROUTE_VLLM_PYTHON is not set"),
]

BLOCKS = 100
#: About 2,300 tokens of the tiny model's tokenizer per system prompt, and ~290 per question.
PROMPT_WORDS = 1200
QUESTION_WORDS = 150


@pytest.fixture(scope="module")
def tight_servers(
    vllm_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmServer]]:
    """Two vLLM servers with 100 KV blocks each, stopped when this module is done."""
    with start_vllm_servers(
        vllm_python,
        tiny_model,
        2,
        log_dir=tmp_path_factory.mktemp("vllm-tight-logs"),
        extra_args=["--num-gpu-blocks-override", str(BLOCKS)],
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    ) as servers:
        yield servers


def _reset(servers: list[VllmServer]) -> None:
    for server in servers:
        request = urllib.request.Request(server.base_url + "/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200


def _chars_per_token(server: VllmServer, bodies: list[dict[str, Any]]) -> float:
    """The workload's characters per token under the engine's own tokenizer (bounded-cache's estimate)."""
    body = bodies[0]
    tokens = json.loads(
        post_json(server.base_url + "/tokenize", {"model": body["model"], "messages": body["messages"]})
    )
    return round(len(RouteRequest.from_openai(body).text) / tokens["count"], 2)


class TestCapacityTight:
    def test_placement_by_footprint_hits_more(self, tight_servers: list[VllmServer], tmp_path: Path) -> None:
        """The engines report more prefix-cache hits under bounded-cache than under hash placement (bounded-load
        with its share bound off) and random."""
        bodies = capacity_workload(SERVED_MODEL_NAME, prompt_words=PROMPT_WORDS, question_words=QUESTION_WORDS)
        prompts = {b["messages"][0]["content"]: RouteRequest.from_openai(b) for b in bodies}
        hashing = Router.create(Fleet([Backend("vllm-0"), Backend("vllm-1")]), "bounded-load")
        homes = Counter(assign(hashing.strategy, list(prompts.values()), hashing.fleet.candidates()))
        assert max(homes.values()) >= 5, homes  # the uneven case: hashing piles five or more prompts on one engine
        ratio = _chars_per_token(tight_servers[0], bodies)
        urls = [s.base_url for s in tight_servers]
        runs = {
            "random": ("random", {"seed": 7}),
            # Hash placement: bounded-load's share bound (on by default) also spreads these prompts by their
            # recent requests, which this test does not measure.
            "bounded-load": ("bounded-load", {"share_factor": "off"}),
            "bounded-cache": ("bounded-cache", {"chars_per_token": ratio}),
        }
        results: dict[str, Any] = {"chars_per_token": ratio, "kv_blocks_per_engine": BLOCKS}
        for name, (strategy, options) in runs.items():
            results[name] = run_case(urls, strategy, options, bodies, tmp_path, reset=lambda: _reset(tight_servers))
            if os.environ.get("KVROUTE_E2E_CAPACITY_RESULTS"):
                Path(os.environ["KVROUTE_E2E_CAPACITY_RESULTS"]).write_text(json.dumps(results, indent=2))
        summary = json.dumps(results, indent=1)
        for name in runs:
            assert sum(results[name]["requests_per_backend"].values()) == len(bodies), summary
        cache, load = results["bounded-cache"]["hit_rate"], results["bounded-load"]["hit_rate"]
        assert cache > load, summary
        assert cache > results["random"]["hit_rate"], summary
