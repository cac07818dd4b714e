"""Test doubles for the vLLM adapter: captured engine bytes, an in-memory HTTP client, a ZMQ publisher
with vLLM's framing and replay socket, and a sink that records what the adapter tells the index."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgpack
import zmq
import zmq.asyncio
from kvroute_tokenizer_prefix import BlockIndex, block_hashes

from kvroute.adapters import HttpReply

FIXTURES = Path(__file__).resolve().parents[2] / "e2e" / "vllm" / "fixtures"
#: Bytes of vLLM's own publisher code, per release (see fixtures/capture_publisher.py).
PUBLISHER_FIXTURES = Path(__file__).resolve().parent / "fixtures"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def publisher_capture(name: str) -> dict[str, Any]:
    """A capture of vLLM's publisher, e.g. ``"0.33.0"`` or ``"0.33.0-map-batch"``, with its frames decoded from
    base64."""
    data = json.loads((PUBLISHER_FIXTURES / f"publisher-{name}.json").read_text(encoding="utf-8"))
    for scenario in data["scenarios"].values():
        scenario["live"] = [[base64.b64decode(f) for f in m] for m in scenario["live"]]
        scenario["replay_request"] = [base64.b64decode(f) for f in scenario["replay_request"]]
        scenario["replay_reply"] = [[base64.b64decode(f) for f in m] for m in scenario["replay_reply"]]
    return data


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def kv_events() -> dict[str, Any]:
    """The captured KV event stream of a real vLLM 0.32 server (see docs/e2e-vllm.md)."""
    return json.loads(fixture_text("kv_events.json"))


def captured_messages() -> list[list[bytes]]:
    """The 11 captured messages as their raw ZMQ frames ``[topic, seq, payload]``."""
    return [[base64.b64decode(f) for f in m["frames_b64"]] for m in kv_events()["messages"]]


def captured_payloads() -> list[bytes]:
    return [frames[2] for frames in captured_messages()]


def as_positional(payload: bytes) -> bytes:
    """Re-encode a captured payload in vLLM's older layout: events as positional arrays, batch without rank."""
    ts, events, _rank = msgpack.unpackb(payload, strict_map_key=False)
    order = {
        "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
        "BlockRemoved": ("block_hashes", "medium"),
        "AllBlocksCleared": (),
    }
    arrays = [[e["type"], *(e.get(k) for k in order[e["type"]])] for e in events]
    return msgpack.packb([ts, arrays])


class FakeHttp:
    """An `HttpClient` answering from a table ``{(method, path): reply or callable}``; records every call."""

    def __init__(
        self, routes: Mapping[tuple[str, str], HttpReply | Callable[[object], HttpReply]] | None = None
    ) -> None:
        self.routes: dict[tuple[str, str], Any] = dict(routes or {})
        self.calls: list[tuple[str, str, object]] = []

    def set(self, method: str, path: str, reply: HttpReply | Callable[[object], HttpReply]) -> None:
        self.routes[(method, path)] = reply

    async def _answer(self, method: str, path: str, body: object) -> HttpReply:
        self.calls.append((method, path, body))
        await anyio.lowlevel.checkpoint()
        found = self.routes.get((method, path))
        if found is None:
            return HttpReply(404, b'{"detail":"Not Found"}')
        if isinstance(found, Exception):
            raise found
        return found(body) if callable(found) else found

    async def get(self, path: str) -> HttpReply:
        return await self._answer("GET", path, None)

    async def post(self, path: str, body: object) -> HttpReply:
        return await self._answer("POST", path, body)


def json_reply(data: object, status: int = 200) -> HttpReply:
    return HttpReply(status, json.dumps(data).encode())


class RecordingSink:
    """A `KvEventSink` that forwards to a real `BlockIndex` and records each call by name."""

    def __init__(self, block_size: int = 128) -> None:
        self.index = BlockIndex(block_size)
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.exact: dict[str, bool] = {}
        self.reasons: dict[str, str | None] = {}
        self.capacity: dict[str, int] = {}

    @property
    def block_size(self) -> int:
        return self.index.block_size

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def set_exact(self, backend: str, exact: bool = True, *, reason: str | None = None) -> None:
        self.calls.append(("set_exact", (backend, exact), {"reason": reason}))
        self.exact[backend] = exact
        self.reasons[backend] = reason
        self.index.set_exact(backend, exact)

    def blocks_stored(self, backend: str, token_ids: Sequence[int], **kw: Any) -> list[int]:
        self.calls.append(("blocks_stored", (backend, tuple(token_ids)), kw))
        return self.index.blocks_stored(backend, token_ids, **kw)

    def blocks_removed(self, backend: str, engine_hashes: Iterable[int] = ()) -> int:
        hashes = list(engine_hashes)
        self.calls.append(("blocks_removed", (backend, tuple(hashes)), {}))
        return self.index.blocks_removed(backend, hashes)

    def all_cleared(self, backend: str) -> None:
        self.calls.append(("all_cleared", (backend,), {}))
        self.index.all_cleared(backend)

    def set_capacity(self, backend: str, blocks: int) -> None:
        self.capacity[backend] = blocks
        self.index.set_capacity(backend, blocks)


def model_router_hashes(payloads: Iterable[bytes], block_size: int = 128) -> set[int]:
    """An independent model of what the engine holds after ``payloads``, in the router's hashes.

    Follows engine hashes through parents to each block's full token prefix and hashes that
    prefix with the router's function, so it shares no code with the feed under test.
    """
    tokens_of: dict[int, tuple[int, ...]] = {}
    alive: set[int] = set()
    for payload in payloads:
        _ts, events, *_ = msgpack.unpackb(payload, strict_map_key=False)
        for e in events:
            if e["type"] == "BlockStored":
                prefix = tokens_of[e["parent_block_hash"]] if e["parent_block_hash"] is not None else ()
                for i, h in enumerate(e["block_hashes"]):
                    prefix = prefix + tuple(e["token_ids"][i * block_size : (i + 1) * block_size])
                    tokens_of[h] = prefix
                    alive.add(h)
            elif e["type"] == "BlockRemoved":
                alive.difference_update(e["block_hashes"])
            elif e["type"] == "AllBlocksCleared":
                alive.clear()
    return {block_hashes(tokens_of[h], block_size)[-1] for h in alive}


class FakeVllmPublisher:
    """vLLM's KV event publisher on loopback: a PUB socket and a ROUTER replay socket with a buffer.

    ``store`` buffers a batch without sending it (as if the live message were lost); ``send``
    puts a buffered batch on the wire; the replay socket answers like vLLM's.
    """

    def __init__(
        self,
        topic: bytes = b"kv",
        *,
        replay: bool = True,
        connect_to: str | None = None,
        ignore_replays: int = 0,
        replay_topic: bool = True,
        bind: str = "tcp://127.0.0.1:*",
    ) -> None:
        self.topic = topic
        self.ignore_replays = ignore_replays
        #: Replies carry the topic frame (vLLM 0.26+); ``False``: ``[b"", seq, payload]`` as earlier releases.
        self.replay_topic = replay_topic
        self.bind = bind
        self.with_replay = replay
        self.connect_to = connect_to
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        self.endpoint = ""
        self.replay_endpoint: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._tg: Any = None

    async def __aenter__(self) -> FakeVllmPublisher:
        self._ctx = ctx = zmq.asyncio.Context()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if self.connect_to is None:
            self.pub.bind(self.bind)
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.pub.connect(self.connect_to)
            self.endpoint = self.connect_to
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        if self.with_replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._tg.start_soon(self._serve_replay)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        assert self._ctx is not None
        self._ctx.destroy(linger=0)

    def store(self, payload: bytes, seq: int | None = None) -> int:
        seq = len(self.buffer) if seq is None else seq
        self.buffer.append((seq, payload))
        return seq

    async def send(self, seq: int) -> None:
        payload = dict(self.buffer)[seq]
        await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    async def send_until(self, seq: int, done: Callable[[], bool], limit_s: float = 10.0) -> None:
        """Send ``seq`` again and again until ``done()`` (a subscriber may not have joined yet)."""
        with anyio.fail_after(limit_s):
            while not done():
                await self.send(seq)
                await anyio.sleep(0.02)

    async def _serve_replay(self) -> None:
        while True:
            client, _empty, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            if self.ignore_replays:
                self.ignore_replays -= 1  # as if the engine were not up yet
                continue
            head = [client, b"", self.topic] if self.replay_topic else [client, b""]
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart(
                [client, b"", b"", END_SEQ, b""] if self.replay_topic else [client, b"", END_SEQ, b""]
            )


async def wait_for(condition: Callable[[], bool], limit_s: float = 10.0) -> None:
    """Poll ``condition`` until true (bounded): the state it reads has no event to wait on."""
    with anyio.fail_after(limit_s):
        while not condition():  # noqa: ASYNC110 - polling state owned by the code under test
            await anyio.sleep(0.01)
