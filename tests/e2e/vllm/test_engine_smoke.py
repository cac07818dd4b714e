"""Smoke tests of a real vLLM CPU build: the facts backend adapters rely on hold on a live engine."""

from __future__ import annotations

import json
import os
import random
import time

import pytest

from tests.e2e.vllm.servers import KV_TOPIC, VllmServer, get_text, metric_value, post_json, sse_events

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.environ.get("KVROUTE_VLLM_PYTHON"), reason="KVROUTE_VLLM_PYTHON is not set"),
]

BLOCK_SIZE = 128  # the CPU build's block size; test_block_size_is_128 pins it
HITS = "vllm:prefix_cache_hits_total"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _words(seed: int, count: int) -> str:
    """Seeded made-up words; each seed gives a prompt that no other test sends."""
    rng = random.Random(seed)
    return " ".join(
        "".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(1, 3)))
        for _ in range(count)
    )


def _cacheable(prompt_tokens: int) -> int:
    """Prompt tokens a repeat can take from the cache: full blocks, and never the very last token."""
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def _tokens(server: VllmServer, prompt: str) -> list[int]:
    body = {"model": server.model, "prompt": prompt}
    return json.loads(post_json(server.base_url + "/tokenize", body))["tokens"]


def _complete(server: VllmServer, prompt: str) -> dict:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    return json.loads(post_json(server.base_url + "/v1/completions", body))


def _chain(stored: list[dict], first_block: list[int]) -> list[dict]:
    """The BlockStored events that start at a root block holding ``first_block``, linked by parent hash."""
    roots = [e for e in stored if e["parent_block_hash"] is None and e["token_ids"][: len(first_block)] == first_block]
    chain = roots[:1]
    while chain:
        nxt = [e for e in stored if e["parent_block_hash"] == chain[-1]["block_hashes"][-1]]
        if not nxt:
            break
        chain.append(nxt[0])
    return chain


def _hits(server: VllmServer) -> float:
    return metric_value(get_text(server.base_url + "/metrics"), HITS, model_name=server.model)


class TestVllmEngine:
    def test_block_size_is_128(self, vllm_servers: list[VllmServer]) -> None:
        """The CPU build reports block_size 128 and prefix caching on in vllm:cache_config_info."""
        text = get_text(vllm_servers[0].base_url + "/metrics")
        info = metric_value(text, "vllm:cache_config_info", block_size="128", enable_prefix_caching="True")
        assert info == 1.0

    def test_repeated_prompt_raises_prefix_cache_hits(self, vllm_servers: list[VllmServer]) -> None:
        """A long prompt sent twice to one server adds its full blocks to that server's prefix-cache hits only."""
        first, other = vllm_servers
        prompt = _words(seed=1001, count=1200)
        cacheable = _cacheable(len(_tokens(first, prompt)))
        assert cacheable >= 8 * BLOCK_SIZE
        before, other_before = _hits(first), _hits(other)

        cold = _complete(first, prompt)
        warm = _complete(first, prompt)

        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == cacheable
        assert _hits(first) - before == cacheable
        assert _hits(other) == other_before

    def test_streamed_chat_usage_reports_cached_tokens(self, vllm_servers: list[VllmServer]) -> None:
        """With include_usage, a stream's last chunk has no choices and usage.prompt_tokens_details.cached_tokens."""
        server = vllm_servers[1]
        body = {
            "model": server.model,
            "messages": [{"role": "user", "content": _words(seed=1002, count=600)}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        usages = []
        for _ in range(2):
            raw = post_json(server.base_url + "/v1/chat/completions", body)
            assert raw.rstrip().endswith(b"data: [DONE]")
            *chunks, last = sse_events(raw)
            assert all(chunk["choices"] for chunk in chunks)
            assert last["choices"] == []
            usages.append(last["usage"])
        cold, warm = usages
        assert cold["prompt_tokens"] == warm["prompt_tokens"]
        assert cold["prompt_tokens_details"]["cached_tokens"] == 0
        assert warm["prompt_tokens_details"]["cached_tokens"] == _cacheable(warm["prompt_tokens"])

    def test_kv_events_carry_stored_blocks_and_replay(self, vllm_servers: list[VllmServer]) -> None:
        """A new prompt is published as [topic, seq, msgpack batch] BlockStored events holding its tokens block by
        block, chained by parent hash, and the replay socket returns the same batches then an end marker."""
        import msgpack
        import zmq

        server = vllm_servers[0]
        prompt = _words(seed=1003, count=400)
        tokens = _tokens(server, prompt)
        full_blocks = _cacheable(len(tokens)) // BLOCK_SIZE
        assert full_blocks >= 3

        ctx = zmq.Context()
        try:
            sub = ctx.socket(zmq.SUB)
            sub.connect(server.kv_events_endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, KV_TOPIC.encode())
            time.sleep(1.0)  # ZMQ slow joiner: the subscription must reach the publisher before it sends
            _complete(server, prompt)

            messages: dict[int, bytes] = {}
            seen: list[dict] = []
            chain: list[dict] = []
            deadline = time.monotonic() + 30
            while sum(len(e["block_hashes"]) for e in chain) < full_blocks and time.monotonic() < deadline:
                if not sub.poll(500):
                    continue
                frames = sub.recv_multipart()
                assert len(frames) == 3 and frames[0] == KV_TOPIC.encode() and len(frames[1]) == 8
                messages[int.from_bytes(frames[1], "big")] = frames[2]
                ts, events, dp_rank = msgpack.unpackb(frames[2], strict_map_key=False)
                assert isinstance(ts, float) and dp_rank == 0
                seen.extend(e for e in events if e["type"] == "BlockStored")
                chain = _chain(seen, tokens[:BLOCK_SIZE])
            sub.close(linger=0)

            assert chain, "no BlockStored event for the prompt's first block within 30 s"
            assert [t for e in chain for t in e["token_ids"]] == tokens[: full_blocks * BLOCK_SIZE]
            for event in chain:
                assert event["block_size"] == BLOCK_SIZE
                assert len(event["token_ids"]) == len(event["block_hashes"]) * BLOCK_SIZE
                assert all(0 <= h < 2**64 for h in event["block_hashes"])

            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(server.kv_replay_endpoint)
            first_seq = min(messages)
            dealer.send_multipart([b"", first_seq.to_bytes(8, "big")])
            replayed: dict[int, bytes] = {}
            while dealer.poll(10_000):
                empty, topic, seq_bytes, payload = dealer.recv_multipart()
                assert empty == b""
                if seq_bytes == END_SEQ:
                    assert (topic, payload) == (b"", b"")
                    break
                assert topic == KV_TOPIC.encode()
                replayed[int.from_bytes(seq_bytes, "big")] = payload
            else:
                pytest.fail("the replay socket sent no end marker within 10 s")
            dealer.close(linger=0)
            assert min(replayed) == first_seq
            assert {seq: replayed[seq] for seq in messages} == messages
        finally:
            ctx.destroy(linger=0)
