"""Regenerate tests/e2e/vllm/fixtures/ from a live vLLM (CPU build) server.

Usage: python capture_fixtures.py --python VLLM_VENV_PYTHON [--model DIR] [--out DIR]

Runs under any interpreter that has httpx, pyzmq and msgpack (not the vLLM venv, which lacks msgpack).
Starts one server with a deliberately small KV cache (72 blocks of 128 tokens) and VLLM_SERVER_DEV_MODE=1,
then drives a fixed script of requests so that every kind of KV event appears:
  1. GET /metrics while idle                                     -> metrics_idle.txt
  2. POST /tokenize with prompt and with messages                -> tokenize.json
  3. a ~3.4k-token chat prompt streamed twice (cold, then cached) -> chat_stream_cold.sse, chat_stream_cached.sse
  4. three distinct ~2.6k-token completions at once; /metrics sampled while they run -> metrics_busy.txt
     (they overflow the 72-block cache, so the engine evicts blocks: BlockRemoved)
  5. GET /metrics afterwards                                     -> metrics_after.txt
  6. POST /reset_prefix_cache and one tiny request               -> AllBlocksCleared
  7. a DEALER replay from seq 0                                  -> kv_replay.json
Every ZMQ message received on the SUB socket goes to kv_events.json. Token ids and block hashes are
reproducible for a given tiny-model seed and vLLM version (timestamps are not).
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgpack
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import servers

END_SEQ = (-1).to_bytes(8, "big", signed=True)
NUM_BLOCKS = 72  # 9216 tokens: enough for one 8192-token request, small enough to evict


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    syllable = lambda: rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou")  # noqa: E731
    return " ".join("".join(syllable() for _ in range(rng.randint(1, 3))) for _ in range(n))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _decode(payload: bytes) -> object:
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


class Subscriber:
    """Collects every multipart message the engine publishes, from a background thread."""

    def __init__(self, endpoint: str, topic: bytes) -> None:
        self.messages: list[list[bytes]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(endpoint, topic), daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def _run(self, endpoint: str, topic: bytes) -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.connect(endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    self.messages.append(sock.recv_multipart())
        finally:
            sock.close(linger=0)

    def wait_for(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.messages) < count and time.monotonic() < deadline:
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _stream(client: httpx.Client, body: dict) -> tuple[bytes, float]:
    """POST a streaming request; return the raw SSE body and the seconds to the first data event."""
    t0 = time.perf_counter()
    first = None
    raw = bytearray()
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for chunk in resp.iter_raw():
            if first is None and b"data: " in chunk:
                first = time.perf_counter() - t0
            raw += chunk
    return bytes(raw), first if first is not None else float("nan")


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise LookupError(name)


def capture(python: str, model: Path, out: Path, log_dir: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with servers.start_vllm_servers(
        python,
        model,
        1,
        log_dir=log_dir,
        extra_args=["--num-gpu-blocks-override", str(NUM_BLOCKS)],
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    ) as (server,):
        print(f"server up in {server.started_in_s:.1f} s: {server.base_url}")
        client = httpx.Client(base_url=server.base_url, timeout=120)
        sub = Subscriber(server.kv_events_endpoint, servers.KV_TOPIC.encode())
        time.sleep(1.0)  # ZMQ slow joiner: let the subscription reach the publisher

        (out / "metrics_idle.txt").write_text(client.get("/metrics").text)

        name = server.model
        chat_prompt = _words(1, 1750)
        tokenize_cases = [
            {"model": name, "prompt": "Hello world, bakumi tosa."},
            {"model": name, "prompt": "Hello world, bakumi tosa.", "add_special_tokens": False},
            {"model": name, "prompt": "Hello world", "return_token_strs": True},
            {"model": name, "messages": [{"role": "user", "content": "Hello world"}]},
            {"model": name, "messages": [{"role": "user", "content": "Hello world"}], "add_generation_prompt": False},
            {
                "model": name,
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hello world"}]},
                ],
            },
        ]
        tokenize = [{"request": req, "response": client.post("/tokenize", json=req).json()} for req in tokenize_cases]
        chat_tokens = client.post(
            "/tokenize", json={"model": name, "messages": [{"role": "user", "content": chat_prompt}]}
        ).json()
        tokenize.append(
            {
                "request": {
                    "model": name,
                    "messages": [{"role": "user", "content": "<chat_prompt in kv_events.json>"}],
                },
                "response": chat_tokens,
            }
        )
        (out / "tokenize.json").write_text(json.dumps(tokenize, indent=1) + "\n")

        body = {
            "model": name,
            "messages": [{"role": "user", "content": chat_prompt}],
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for label in ("cold", "cached"):
            raw, ttft = _stream(client, body)
            (out / f"chat_stream_{label}.sse").write_bytes(raw)
            print(f"chat {label}: {chat_tokens['count']} prompt tokens, first chunk after {ttft * 1000:.0f} ms")

        # Three distinct long prompts at once: one runs (chunked prefill of 2048 tokens a step), others wait.
        prompts = [_words(100 + i, 1400) for i in range(3)]
        busy = ""
        with ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(
                    client.post,
                    "/v1/completions",
                    json={"model": name, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True},
                )
                for p in prompts
            ]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all(f.done() for f in futures):
                text = client.get("/metrics").text
                if _metric(text, "vllm:num_requests_running") >= 1 and _metric(text, "vllm:num_requests_waiting") >= 1:
                    busy = text
                    break
                if not busy and _metric(text, "vllm:num_requests_running") >= 1:
                    busy = text  # keep the best so far
                time.sleep(0.02)
            for f in futures:
                f.result().raise_for_status()
        if busy:
            (out / "metrics_busy.txt").write_text(busy)
        else:
            print("warning: never saw a running request in /metrics; metrics_busy.txt not written")
        (out / "metrics_after.txt").write_text(client.get("/metrics").text)

        before_reset = len(sub.messages)
        client.post("/reset_prefix_cache").raise_for_status()
        time.sleep(1.0)
        print(f"messages within 1 s of /reset_prefix_cache on an idle engine: {len(sub.messages) - before_reset}")
        client.post("/v1/completions", json={"model": name, "prompt": "hello", "max_tokens": 2}).raise_for_status()
        sub.wait_for(before_reset + 1, 10)
        time.sleep(0.5)
        sub.close()

        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(server.kv_replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replay: list[list[bytes]] = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            replay.append(frames)
            if len(frames) >= 3 and frames[2] == END_SEQ:
                break
        dealer.close(linger=0)
        version = client.get("/version").json()["version"]
        client.close()

    meta = {
        "vllm_version": version,
        "block_size": 128,
        "num_gpu_blocks_override": NUM_BLOCKS,
        "topic": servers.KV_TOPIC,
        "note": "Captured by capture_fixtures.py; see docs/e2e-vllm.md for the layout.",
    }
    events = {
        **meta,
        "chat_prompt": chat_prompt,
        "chat_prompt_token_ids": chat_tokens["tokens"],
        "messages": [
            {
                "frames_b64": [_b64(f) for f in frames],
                "seq": int.from_bytes(frames[1], "big"),
                "decoded_payload": _decode(frames[2]),
            }
            for frames in sub.messages
        ],
    }
    (out / "kv_events.json").write_text(json.dumps(events, indent=1) + "\n")
    replay_doc = {
        **meta,
        "request_frames_b64": [_b64(b""), _b64((0).to_bytes(8, "big"))],
        "reply_messages_b64": [[_b64(f) for f in frames] for frames in replay],
    }
    (out / "kv_replay.json").write_text(json.dumps(replay_doc, indent=1) + "\n")
    kinds: dict[str, int] = {}
    for frames in sub.messages:
        for event in _decode(frames[2])[1]:
            kinds[event["type"]] = kinds.get(event["type"], 0) + 1
    print(f"captured {len(sub.messages)} KV event messages {kinds}, {len(replay)} replay messages -> {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, help="the vLLM virtualenv's python")
    parser.add_argument("--model", type=Path, help="tiny model directory (built into a temp dir if omitted)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "fixtures")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvroute-capture-") as tmp:
        model = args.model or servers.ensure_tiny_model(args.python, Path(tmp) / "model")
        capture(args.python, model, args.out, Path(tmp) / "logs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
