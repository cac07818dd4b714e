"""What a real vLLM CPU server started with ``--data-parallel-size 2`` shows a router (issue 23, data-parallel ranks).

One server, two engine ranks behind one URL, each bound to its own core
(``VLLM_CPU_OMP_THREADS_BIND=0|1``). Pinned from the engine's own answers:

* ``GET /kv_event_sources`` lists both ranks (``"0"``, ``"1"``), each with its own KV events and replay
  endpoints;
* ``/metrics`` has one series per rank (label ``engine``) for the prefix-cache counters;
* ``X-data-parallel-rank`` picks the rank: the same prompt is cold on rank 0, cold again on rank 1,
  then cached on each (two separate caches), and each rank's ``vllm:prefix_cache_hits_total`` holds
  exactly its own hit;
* each rank's replay socket returns event batches whose payload names that rank (the third item).
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.vllm.servers import VllmServer, get_text, metric_value, start_vllm_servers
from tests.e2e.vllm.test_routing_e2e import BLOCK, HITS, _words

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.environ.get("KVROUTE_VLLM_PYTHON"), reason="KVROUTE_VLLM_PYTHON is not set"),
]

RANKS = 2


@pytest.fixture(scope="module")
def dp_server(vllm_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One vLLM server with two data-parallel ranks (one core each), stopped when this module is done."""
    with start_vllm_servers(
        vllm_python,
        tiny_model,
        1,
        log_dir=tmp_path_factory.mktemp("vllm-dp-logs"),
        extra_args=["--data-parallel-size", str(RANKS)],
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(RANKS))},
        startup_timeout_s=480,
    ) as servers:
        yield servers[0]


def _complete(server: VllmServer, prompt: str, rank: int) -> dict[str, Any]:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 1}
    request = urllib.request.Request(
        server.base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-data-parallel-rank": str(rank)},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return dict(json.loads(response.read()))


def _replayed_ranks(endpoint: str) -> tuple[int, set[int]]:
    """(batches, data-parallel ranks named in their payloads) that a replay socket returns from seq 0."""
    import msgpack
    import zmq

    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    try:
        socket.connect(endpoint)
        socket.send_multipart([b"", (0).to_bytes(8, "big")])
        batches, ranks = 0, set()
        while True:
            assert socket.poll(10_000), f"no reply from {endpoint} within 10 s"
            frames = socket.recv_multipart()
            if frames[-1] == b"":  # the end marker: seq -1, empty payload
                return batches, ranks
            batches += 1
            ranks.add(msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)[2])
    finally:
        socket.close(linger=0)
        context.term()


class TestDataParallelServer:
    def test_ranks_have_their_own_caches_counters_and_events(self, dp_server: VllmServer) -> None:
        """X-data-parallel-rank picks one of two caches; /metrics, /kv_event_sources and the events are per rank."""
        sources = json.loads(get_text(dp_server.base_url + "/kv_event_sources"))
        assert sorted(sources) == [str(r) for r in range(RANKS)], sources
        assert len({s["endpoint"] for s in sources.values()}) == RANKS, sources
        prompt = _words(77, 1200)
        answers = [_complete(dp_server, prompt, rank) for rank in (0, 1, 0, 1)]
        cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
        tokens = answers[0]["usage"]["prompt_tokens"]
        hit = (tokens - 1) // BLOCK * BLOCK
        assert cached == [0, 0, hit, hit], cached
        text = get_text(dp_server.base_url + "/metrics")
        for rank in range(RANKS):
            assert metric_value(text, HITS, engine=str(rank), model_name=dp_server.model) == hit
            port = sources[str(rank)]["replay_endpoint"].rsplit(":", 1)[1]
            batches, ranks = _replayed_ranks(f"tcp://127.0.0.1:{port}")
            assert batches >= 1 and ranks == {rank}, (rank, batches, ranks)
