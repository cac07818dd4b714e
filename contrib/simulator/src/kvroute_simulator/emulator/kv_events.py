"""The emulator's KV cache events: vLLM's ZMQ publisher, one per data-parallel rank.

Configured as vLLM's ``--kv-events-config`` (:class:`KvEventsConfig`, the same keys). Each rank
publishes on its own endpoint, as vLLM offsets them: the configured TCP port plus the rank (a
port of 0 gives every rank a free port). An endpoint with a wildcard host (``*``) is bound by
the emulator, on the address it serves HTTP on rather than on every interface (it is a test
tool); a concrete address is connected to (the subscriber binds it), as vLLM does. The replay
endpoint is always bound. ``GET /kv_event_sources`` reports what each rank bound
(:meth:`KvEventPublisher.sources`).

Messages are vLLM's: ``[topic, seq (8 bytes, big-endian), payload]``, the payload a msgpack
``[ts, [event, ...], data_parallel_rank]`` with events as maps tagged by ``"type"``, one batch per
engine step that changed a tier. ``BlockStored`` carries the blocks' hashes (unsigned 64-bit),
parent, tokens, block size and ``medium``; ``BlockRemoved`` the hashes and ``medium``. A block
the GPU evicts into the CPU tier gives ``BlockRemoved`` (GPU) then ``BlockStored`` (CPU, with its
tokens and parent, so that a subscriber can name it without having kept the GPU event); a CPU
hit copied back gives ``BlockRemoved`` (CPU) then, when its step ends, ``BlockStored`` (GPU).
The replay socket (a ROUTER) answers ``[b"", start seq]`` with every buffered batch from
``start`` on, ``[b"", topic, seq, payload]`` each, then the end marker (seq -1, empty payload).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import msgpack
import structlog
import zmq
import zmq.asyncio

from kvroute_simulator.engine import HOST, Engine, StoredRun

__all__ = ["KvEventPublisher", "KvEventsConfig", "parse_kv_events_config"]

log = structlog.get_logger(__name__)

_MASK = (1 << 64) - 1
_END = (-1).to_bytes(8, "big", signed=True)
_KEYS = ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm", "topic")


@attrs.frozen(kw_only=True)
class KvEventsConfig:
    """vLLM's ``--kv-events-config`` (the keys the emulator uses; others are refused)."""

    enable_kv_cache_events: bool = True
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""


def parse_kv_events_config(text: str) -> KvEventsConfig:
    """Parse ``--kv-events-config`` JSON; ``ValueError`` saying what was expected and what was got."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config must be a JSON object (got {text!r}: {exc}).") from None
    if not isinstance(data, dict):
        raise ValueError(f"--kv-events-config must be a JSON object (got {text!r}).")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"--kv-events-config: unknown key(s) {', '.join(unknown)} (expected some of: {', '.join(_KEYS)})."
        )
    if data.get("publisher", "zmq") not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: 'publisher' must be 'zmq' or 'null' (got {data['publisher']!r}).")
    for key in ("endpoint", "replay_endpoint"):
        value = data.get(key)
        if value is not None and (
            not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://"))
        ):
            raise ValueError(
                f"--kv-events-config: {key!r} must be a ZMQ endpoint such as 'tcp://*:5557' (got {value!r})."
            )
    for key in ("buffer_steps", "hwm"):
        value = data.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--kv-events-config: {key!r} must be a positive integer (got {value!r}).")
    if not isinstance(data.get("topic", ""), str) or not isinstance(data.get("enable_kv_cache_events", True), bool):
        raise ValueError("--kv-events-config: 'topic' must be a string and 'enable_kv_cache_events' true or false.")
    return KvEventsConfig(**data)


def _rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's per-rank endpoint: the TCP port plus the rank (a port of 0 stays 0; ``ipc``/``inproc``: a suffix)."""
    if rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{rank}"
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + rank}" if port.isdigit() and int(port) else endpoint


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _on_host(endpoint: str, host: str) -> str:
    """A wildcard TCP endpoint bound on ``host`` instead (the emulator serves loopback by default)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    _, _, port = endpoint.rpartition(":")
    shown = f"[{host}]" if ":" in host else host
    return f"tcp://{shown}:{port}"


def _stored(hashes: Sequence[int], parent: int | None, tokens: Sequence[int], size: int, medium: str) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [h & _MASK for h in hashes],
        "parent_block_hash": None if parent is None else parent & _MASK,
        "token_ids": list(tokens),
        "block_size": size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


@attrs.define
class _Known:
    """What a subscriber needs to name one block again: its parent and tokens, and its request's extra keys."""

    parent: int | None
    tokens: tuple[int, ...]
    lora: str | None
    salt: str | None
    first: bool


class _Rank:
    """One rank's publisher: sockets, sequence numbers, the replay buffer, the step's pending events."""

    def __init__(self, rank: int, config: KvEventsConfig, block_size: int) -> None:
        self.rank = rank
        self.config = config
        self.block_size = block_size
        self.seq = 0
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self.pending: list[dict[str, Any]] = []
        self.known: dict[int, _Known] = {}
        self.limbo: list[int] = []
        self.endpoint = ""
        self.replay_endpoint: str | None = None
        self.pub: zmq.Socket[bytes] | None = None
        self.router: zmq.asyncio.Socket | None = None
        self.engine: Engine | None = None

    def extra(self, run: StoredRun) -> tuple[str | None, str | None]:
        key = run.request.extra_key
        if key is None:
            return None, None
        lora, _, salt = key.partition("|")
        return (None if lora == "None" else lora), (None if salt == "None" else salt)

    def stored(self, run: StoredRun) -> None:
        lora, salt = self.extra(run)
        size = self.block_size
        event = _stored(run.hashes, run.parent, run.tokens, size, "GPU")
        first = run.parent is None
        if lora is not None:
            event["lora_name"] = lora
            event["lora_id"] = 1
        if first and (salt is not None or lora is not None):
            event["extra_keys"] = [[k for k in (lora, salt) if k is not None]] + [None] * (len(run.hashes) - 1)
        self.pending.append(event)
        parent = run.parent
        for i, h in enumerate(run.hashes):
            self.known[h] = _Known(parent, run.tokens[i * size : (i + 1) * size], lora, salt, first and i == 0)
            parent = h

    def removed(self, hashes: list[int], medium: str) -> None:
        self.pending.append({"type": "BlockRemoved", "block_hashes": [h & _MASK for h in hashes], "medium": medium})
        if medium == HOST:
            for h in hashes:
                self.known.pop(h, None)
        else:
            self.limbo.extend(hashes)  # forgotten at the end of the step unless offloaded meanwhile

    def offloaded(self, hashes: list[int]) -> None:
        # One event per chain of blocks (parent first), though the GPU evicts a sequence's tail first.
        known = self.known
        present = [h for h in hashes if h in known]
        child = {known[h].parent: h for h in present}
        held = set(present)
        runs: list[list[int]] = []
        for h in present:
            if known[h].parent in held:
                continue  # not the head of its chain
            run = [h]
            while run[-1] in child and len(run) < len(present):
                run.append(child[run[-1]])
            runs.append(run)
        for run in runs:
            head = self.known[run[0]]
            tokens = [t for r in run for t in self.known[r].tokens]
            event = _stored(run, head.parent, tokens, self.block_size, HOST)
            if head.lora is not None:
                event["lora_name"], event["lora_id"] = head.lora, 1
            if head.first and (head.salt is not None or head.lora is not None):
                keys = [k for k in (head.lora, head.salt) if k is not None]
                event["extra_keys"] = [keys] + [None] * (len(run) - 1)
            self.pending.append(event)

    def flush(self) -> None:
        engine = self.engine
        for h in self.limbo:
            if engine is None or not (engine.is_cached(h) or engine.is_cpu_cached(h)):
                self.known.pop(h, None)
        self.limbo.clear()
        if not self.pending:
            return
        payload = msgpack.packb([time.time(), self.pending, self.rank])
        self.pending = []
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if self.pub is not None:
            with contextlib.suppress(zmq.Again):
                self.pub.send_multipart([self.config.topic.encode(), seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)


class KvEventPublisher:
    """Publishes the KV events of every rank of an emulated engine (the engine's `KvEventListener`).

    ``start`` opens the sockets (inside the running event loop), ``close`` closes them; ``flush``
    publishes what the engine step just done changed, one batch per rank that changed.
    """

    def __init__(self, config: KvEventsConfig, block_size: int, ranks: int, host: str = "127.0.0.1") -> None:
        self.config = config
        self.host = host
        self.ranks = [_Rank(r, config, block_size) for r in range(ranks)]
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._actx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- the engine's listener ------------------------------------------------------------

    def blocks_stored(self, engine: Engine, run: StoredRun, now: float) -> None:
        self.ranks[engine.rank].stored(run)

    def blocks_removed(self, engine: Engine, hashes: list[int], medium: str, now: float) -> None:
        self.ranks[engine.rank].removed(hashes, medium)

    def blocks_offloaded(self, engine: Engine, hashes: list[int], now: float) -> None:
        self.ranks[engine.rank].offloaded(hashes)

    def attach(self, engines: Sequence[Engine]) -> None:
        """Know the ranks' engines (to tell a block the CPU tier took from one it dropped)."""
        for rank, engine in zip(self.ranks, engines, strict=True):
            rank.engine = engine

    def flush(self) -> None:
        """Publish each rank's events of the step just done (called by the real-time engine after each step)."""
        for rank in self.ranks:
            rank.flush()

    # -- sockets --------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind (or connect) every rank's publisher and bind its replay socket."""
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        config = self.config
        for rank in self.ranks:
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, config.hwm)
            configured = _rank_endpoint(config.endpoint, rank.rank)
            if _binds(configured):
                pub.bind(_on_host(configured, self.host))
                rank.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(configured)
                rank.endpoint = configured
            rank.pub = pub
            if config.replay_endpoint is not None:
                router = self._actx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.bind(_on_host(_rank_endpoint(config.replay_endpoint, rank.rank), self.host))
                rank.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
                rank.router = router
                self._tasks.append(asyncio.create_task(self._serve_replay(rank, router)))
            log.info("kv_events_publishing", rank=rank.rank, endpoint=rank.endpoint, replay=rank.replay_endpoint)

    async def _serve_replay(self, rank: _Rank, router: zmq.asyncio.Socket) -> None:
        topic = self.config.topic.encode()
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("kv_replay_bad_request", rank=rank.rank, frames=len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(rank.buffer):
                if seq >= start:
                    await router.send_multipart([identity, b"", topic, seq.to_bytes(8, "big"), payload])
            await router.send_multipart([identity, b"", topic, _END, b""])

    def close(self) -> None:
        """Close every socket (replay tasks are cancelled)."""
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        for rank in self.ranks:
            for sock in (rank.pub, rank.router):
                if sock is not None:
                    sock.close(linger=0)
            rank.pub = rank.router = None
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.term()
        self._ctx = self._actx = None

    def sources(self) -> list[Mapping[str, Any]]:
        """``GET /kv_event_sources``: each rank's publisher as a subscriber must use it."""
        return [
            {
                "data_parallel_rank": rank.rank,
                "endpoint": rank.endpoint,
                "replay_endpoint": rank.replay_endpoint,
                "topic": self.config.topic,
            }
            for rank in self.ranks
        ]

    def stats(self) -> list[dict[str, int]]:
        """Batches published per rank."""
        return [{"rank": r.rank, "batches": r.seq} for r in self.ranks]
