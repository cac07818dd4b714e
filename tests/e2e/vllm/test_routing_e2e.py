"""Routing through ``kvroute serve`` to two real vLLM servers, and the vllm adapter against the live engines.

What is asserted, from the engines' own ``/metrics`` and answers:

* the adapter's telemetry equals what the engine's ``/metrics`` says (independent parser);
* KV events reach the router's exact index, and the index agrees with the engine: for every
  prompt, the blocks the index says a server holds are the tokens that server then reports
  as cached;
* ``kvroute check-parity`` passes against both engines;
* on the same shared-prefix workload (documents asked several questions each, sent through
  the proxy one after another), prefix-aware routing (bounded-load and tokenizer-prefix)
  makes the engines report more prefix-cache hits than random routing.

The hit counts of each strategy are written to ``$KVROUTE_E2E_RESULTS`` (JSON) when it is set.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.vllm.proxy import start_proxy
from tests.e2e.vllm.servers import (
    SERVED_MODEL_NAME,
    VllmServer,
    get_text,
    metric_value,
    post_json,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.environ.get("KVROUTE_VLLM_PYTHON"), reason="KVROUTE_VLLM_PYTHON is not set"),
]

BLOCK = 128
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
DOCUMENTS = 8
QUESTIONS = 4
RESULTS: dict[str, Any] = {}


def _words(seed: int, count: int) -> str:
    rng = random.Random(seed)
    return " ".join(
        "".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(1, 3)))
        for _ in range(count)
    )


def _workload(seed: int) -> list[dict[str, Any]]:
    """Chat requests: each document (~1,900 tokens, as the system message) asked QUESTIONS questions, interleaved."""
    documents = [_words(seed * 100 + d, 1000) + "." for d in range(DOCUMENTS)]
    return [
        {
            "model": SERVED_MODEL_NAME,
            "messages": [
                {"role": "system", "content": documents[d]},
                {"role": "user", "content": f"Question {q}: {_words(seed * 1000 + d * 10 + q, 12)}?"},
            ],
            "max_tokens": 1,
            "temperature": 0,
        }
        for q in range(QUESTIONS)
        for d in range(DOCUMENTS)
    ]


def _engine_counter(server: VllmServer, name: str) -> float:
    return metric_value(get_text(server.base_url + "/metrics"), name, model_name=server.model)


def _reset_caches(servers: list[VllmServer]) -> None:
    for server in servers:
        req = urllib.request.Request(server.base_url + "/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200


def _post(url: str, body: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read()), resp.headers.get("x-kvroute-backend")


def _run_strategy(
    servers: list[VllmServer], strategy: str, options: Mapping[str, Any], workdir: Path
) -> dict[str, Any]:
    """Reset both caches, send the workload through a fresh proxy, return the engines' hit deltas."""
    _reset_caches(servers)
    before = [(_engine_counter(s, HITS), _engine_counter(s, QUERIES)) for s in servers]
    cached = 0
    placement: dict[str, int] = {}
    proxy_events: list[dict[str, Any]] = []
    started = time.monotonic()
    with start_proxy([s.base_url for s in servers], strategy, options, workdir) as proxy:
        for body in _workload(seed=3):
            answer, backend = _post(proxy.url + "/v1/chat/completions", body)
            cached += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            placement[str(backend)] = placement.get(str(backend), 0) + 1
        proxy_events = proxy.events()
    time.sleep(0.5)  # the engines' stat loggers publish a step's counters right after it
    after = [(_engine_counter(s, HITS), _engine_counter(s, QUERIES)) for s in servers]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    result = {
        "strategy": strategy,
        "engine_hit_tokens": hits,
        "engine_query_tokens": queries,
        "hit_rate": round(hits / queries, 4) if queries else None,
        "usage_cached_tokens": cached,
        "requests_per_backend": placement,
        "seconds": round(time.monotonic() - started, 1),
        "proxy_log_events": sorted({e.get("event", "") for e in proxy_events if e.get("event") != "request"}),
    }
    RESULTS[strategy] = result
    if os.environ.get("KVROUTE_E2E_RESULTS"):
        Path(os.environ["KVROUTE_E2E_RESULTS"]).write_text(json.dumps(RESULTS, indent=2))
    return result


def _ideal_hits(tokenizer_dir: Path) -> int:
    """Hit tokens if every question after a document's first lands where the document is cached."""
    from kvroute_tokenizer_prefix import load_tokenizer

    from kvroute.request import RouteRequest

    tok = load_tokenizer(str(tokenizer_dir))
    total = 0
    bodies = _workload(seed=3)
    for d in range(DOCUMENTS):
        ids = [
            tok.encode_text(tok.render(RouteRequest.from_openai(bodies[q * DOCUMENTS + d]))) for q in range(QUESTIONS)
        ]
        common = next((i for i, col in enumerate(zip(*ids, strict=False)) if len(set(col)) > 1), min(map(len, ids)))
        total += (QUESTIONS - 1) * (common // BLOCK * BLOCK)
    return total


class _Http:
    """A minimal `kvroute.adapters.HttpClient` over aiohttp for the in-process adapter tests."""

    def __init__(self, session: Any, base: str) -> None:
        self.session = session
        self.base = base

    async def get(self, path: str) -> Any:
        from kvroute.adapters import HttpReply

        async with self.session.get(self.base + path) as r:
            return HttpReply(r.status, await r.read())

    async def post(self, path: str, body: object) -> Any:
        from kvroute.adapters import HttpReply

        async with self.session.post(self.base + path, json=body) as r:
            return HttpReply(r.status, await r.read())


@pytest.mark.anyio
class TestVllmAdapterLive:
    async def test_telemetry_matches_the_engine(self, vllm_servers: list[VllmServer]) -> None:
        """After traffic, the adapter's load equals the engine's own /metrics read by an independent parser."""
        import aiohttp
        from kvroute_vllm import VllmAdapter

        from kvroute import Backend

        server = vllm_servers[1]
        for body in _workload(seed=9)[:3]:
            post_json(server.base_url + "/v1/chat/completions", body)
        adapter = VllmAdapter.create(Backend(id="s1", url=server.base_url, kind="vllm"))
        async with aiohttp.ClientSession() as session:
            http = _Http(session, server.base_url)
            assert await adapter.probe(http) is True
            assert await adapter.list_models(http) == [server.model]
            load = await adapter.poll_load(http)
        text = get_text(server.base_url + "/metrics")
        labels = {"model_name": server.model}
        assert load.prefix_cache_queries == metric_value(text, QUERIES, **labels) > 0
        assert load.prefix_cache_hits == metric_value(text, HITS, **labels)
        assert load.running == metric_value(text, "vllm:num_requests_running", **labels) == 0
        assert load.waiting == metric_value(text, "vllm:num_requests_waiting", **labels) == 0
        assert load.kv_usage == metric_value(text, "vllm:kv_cache_usage_perc", **labels)
        assert load.block_size == BLOCK and metric_value(text, "vllm:cache_config_info", block_size=str(BLOCK)) == 1.0
        assert adapter.metrics is not None and adapter.metrics.num_gpu_blocks == int(
            next(
                p.split('"')[1]
                for p in text.split("vllm:cache_config_info{", 1)[1].split(",")
                if p.startswith("num_gpu_blocks=")
            )
        )

    async def test_kv_events_make_the_index_agree_with_the_engine(
        self, vllm_servers: list[VllmServer], tiny_model: Path
    ) -> None:
        """Events feed the exact index; for each prompt, the blocks it says the engine holds are what the engine then
        serves from cache."""
        import aiohttp
        import anyio
        from kvroute_tokenizer_prefix import BlockIndex, block_hashes, load_tokenizer
        from kvroute_vllm import VllmAdapter

        from kvroute import Backend

        server = vllm_servers[0]
        tok = load_tokenizer(str(tiny_model))
        base = _words(4242, 900)
        prompts = [base + " " + _words(4300 + i, 150 * (i + 1)) for i in range(3)] + [_words(4400, 700)]
        index = BlockIndex(BLOCK)
        adapter = VllmAdapter.create(Backend(id="s0", url=server.base_url, kind="vllm"))
        async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:
            http = _Http(session, server.base_url)
            await adapter.poll_load(http)
            await tg.start(adapter.run_events, http, index)
            with anyio.fail_after(60):
                while not (adapter.subscribers and adapter.subscribers[0].connected):  # noqa: ASYNC110 - adapter state
                    await anyio.sleep(0.05)
            expected_blocks = []
            for prompt in prompts:
                ids = tok.encode_text(prompt, add_special_tokens=True)
                hashes = block_hashes(ids, BLOCK)
                await anyio.to_thread.run_sync(
                    lambda p=prompt: post_json(
                        server.base_url + "/v1/completions", {"model": server.model, "prompt": p, "max_tokens": 1}
                    )
                )
                with anyio.fail_after(30):  # events are published with the engine step; wait until the index has them
                    while index.match(hashes, ["s0"])["s0"] < len(hashes):  # noqa: ASYNC110 - index state
                        await anyio.sleep(0.05)
                expected_blocks.append((prompt, ids, hashes))
            assert index.is_exact("s0")
            for prompt, ids, hashes in expected_blocks:
                held = index.match(hashes, ["s0"])["s0"]
                answer = json.loads(
                    await anyio.to_thread.run_sync(
                        lambda p=prompt: post_json(
                            server.base_url + "/v1/completions", {"model": server.model, "prompt": p, "max_tokens": 1}
                        )
                    )
                )
                cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached == min(held, (len(ids) - 1) // BLOCK) * BLOCK, (
                    f"index says {held} blocks, engine served {cached} tokens"
                )
            stats = adapter.stats()["kv_events"][0]
            tg.cancel_scope.cancel()
        assert stats["decode_errors"] == 0 and stats["lost_batches"] == 0 and stats["rejected_events"] == 0
        assert stats["orphan_events"] == 0 and stats["blocks_stored"] >= sum(len(h) for _, _, h in expected_blocks[1:])


class TestCheckParityLive:
    def test_check_parity_passes_on_both_engines(self, vllm_servers: list[VllmServer], tiny_model: Path) -> None:
        """kvroute check-parity: the router's tokenizer and chat template match both engines; block size 128."""
        args = [sys.executable, "-m", "kvroute", "check-parity", "--tokenizer", str(tiny_model)]
        for server in vllm_servers:
            args += ["--backend", server.base_url]
        done = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.count("PASS: 10/10 samples identical") == 2
        assert done.stdout.count("engine block size: 128 tokens (vllm adapter)") == 2


class TestRoutingThroughProxy:
    def test_prefix_aware_routing_beats_random(
        self, vllm_servers: list[VllmServer], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        """Same shared-prefix workload through kvroute serve: bounded-load and tokenizer-prefix hit more than random."""
        workdir = tmp_path_factory.mktemp("proxy")
        ideal = _ideal_hits(tiny_model)
        random_run = _run_strategy(vllm_servers, "random", {"seed": 7}, workdir)
        bounded = _run_strategy(vllm_servers, "bounded-load", {"prefix_length": 1024}, workdir)
        prefix = _run_strategy(vllm_servers, "tokenizer-prefix", {"tokenizer": str(tiny_model)}, workdir)
        RESULTS["ideal_hit_tokens"] = ideal
        if os.environ.get("KVROUTE_E2E_RESULTS"):
            Path(os.environ["KVROUTE_E2E_RESULTS"]).write_text(json.dumps(RESULTS, indent=2))
        summary = json.dumps(RESULTS, indent=1)
        for run in (random_run, bounded, prefix):
            assert run["usage_cached_tokens"] == run["engine_hit_tokens"], summary  # the engines' two reports agree
            assert sum(run["requests_per_backend"].values()) == DOCUMENTS * QUESTIONS, summary
        assert bounded["engine_hit_tokens"] > random_run["engine_hit_tokens"], summary
        assert prefix["engine_hit_tokens"] > random_run["engine_hit_tokens"], summary
        assert bounded["engine_hit_tokens"] == prefix["engine_hit_tokens"] == ideal, summary
        assert set(prefix["requests_per_backend"]) == set(bounded["requests_per_backend"]) == {"vllm-0", "vllm-1"}, (
            summary
        )


class TestProxyWiring:
    def test_proxy_follows_kv_events_and_checks_parity(self) -> None:
        """In the tokenizer-prefix run, the proxy subscribed to both engines' KV events and found their tokens
        identical."""
        run = RESULTS.get("tokenizer-prefix")
        if run is None:
            pytest.skip("the routing test did not run")
        events = set(run["proxy_log_events"])
        assert {"kv_events_subscribed", "tokenizer_parity_ok"} <= events, sorted(events)
        assert not {"tokenizer_parity_mismatch", "kv_events_failed", "background_loop_failed"} & events, sorted(events)
