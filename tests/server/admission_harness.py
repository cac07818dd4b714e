"""Shared by the admission tests (tests/server/test_admission.py) and the browser's Admission card test: prompts whose
predicted prefill is known, and a long request that keeps an emulated engine busy."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from kvroute_server import ServerThread
from tests.server.harness import chat_body, http

PROMPT_CHARS = 2000
OBJECTIVE_MS = 1500
#: Output tokens of the occupying request: about 15 ms each on an emulator at time scale 1.
SHORT, LONG = 60, 250


def prompt(tag: str) -> str:
    """A distinct prompt of `PROMPT_CHARS` characters (distinct: the predictor's cache view finds nothing shared)."""
    return (f"{tag} " * PROMPT_CHARS)[:PROMPT_CHARS]


class Occupier:
    """A long non-streamed request without objectives, in a thread, that keeps the engine busy."""

    def __init__(self, proxy: ServerThread, max_tokens: int) -> None:
        self.proxy = proxy
        self.result: tuple[int, dict[str, str], bytes] | None = None
        body = chat_body(prompt("occupy"), max_tokens=max_tokens)
        self.thread = threading.Thread(target=self._run, args=(body,))

    def _run(self, body: dict[str, Any]) -> None:
        self.result = http("POST", self.proxy.url + "/v1/chat/completions", body)

    def __enter__(self) -> Occupier:
        self.thread.start()
        wait_for(lambda: in_flight(self.proxy) >= 1, "the occupying request in flight")
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(timeout=30)
        assert self.result is not None and self.result[0] == 200, self.result


def in_flight(proxy: ServerThread) -> float:
    return float(json.loads(http("GET", proxy.url + "/status.json")[2])["totals"]["in_flight"])


def wait_for(predicate: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)
