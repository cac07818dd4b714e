"""Helpers shared by every test directory (import as ``from tests.helpers import free_port``)."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from kvroute import Router, RouteRequest

__all__ = [
    "BLOCKER",
    "blocking_env",
    "chat",
    "conversation",
    "free_port",
    "free_ports",
    "help_commands",
    "installed",
    "run_kvroute",
    "words",
]


def free_port(host: str = "127.0.0.1") -> int:
    """A loopback port nothing listened on a moment ago (bound, then released)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free on ``host`` a moment ago (all held open together, so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


# -- running the `kvroute` command as a user would ------------------------------------------

#: A ``sitecustomize`` module that makes the modules in BLOCKED (and their submodules)
#: unimportable, as if their distributions were not installed.
BLOCKER = """
import sys

BLOCKED = {blocked!r}


class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
"""


def blocking_env(directory: Path, *, entry_points: Sequence[str], modules: Sequence[str]) -> dict[str, str]:
    """An environment in which the ``kvroute`` entry points ``entry_points`` are not loaded and ``modules``
    cannot be imported (a ``sitecustomize`` written into ``directory``)."""
    (directory / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(modules)))
    env = dict(os.environ)
    env["KVROUTE_BLOCK_PLUGINS"] = ",".join(entry_points)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), env.get("PYTHONPATH", "")]))
    return env


def run_kvroute(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run the ``kvroute`` console script installed next to this interpreter, as a user would."""
    script = shutil.which("kvroute", path=str(Path(sys.executable).parent))
    assert script is not None, f"no kvroute script next to {sys.executable}"
    return subprocess.run(
        [script, *args],
        capture_output=True,
        text=True,
        env=None if env is None else dict(env),
        timeout=timeout,
        check=False,
    )


def help_commands(help_text: str) -> dict[str, str]:
    """The ``Commands:`` section of a help text: name -> its help, wrapped lines joined."""
    rows: dict[str, str] = {}
    name = ""
    for line in help_text.partition("Commands:")[2].splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            name, _, text = line.strip().partition(" ")
            rows[name] = text.strip()
        elif line.strip() and name:
            rows[name] += " " + line.strip()
    return rows


def installed(distribution: str) -> bool:
    """Whether ``distribution`` is installed in this environment."""
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


class Clock:
    """A clock the test moves by hand (``clock.now += 1.0``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- chats for the key and placement tests -------------------------------------------------------


def words(rng: random.Random, chars: int) -> str:
    """About ``chars`` characters of distinct pseudo-words (seeded by ``rng``)."""
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(chars // 8))[:chars]


def chat(messages: list[dict[str, Any]]) -> RouteRequest:
    return RouteRequest.from_openai({"model": "m", "messages": messages})


def conversation(system: str | None, turns: list[tuple[str, str]]) -> list[RouteRequest]:
    """The requests of one conversation: turn N+1 is turn N, its answer and a new question."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system is not None else []
    requests = []
    for question, answer in turns:
        messages = [*messages, {"role": "user", "content": question}]
        requests.append(chat(messages))
        messages = [*messages, {"role": "assistant", "content": answer}]
    return requests


def agent_traffic(seed: int, sessions: int = 64) -> list[tuple[int, RouteRequest]]:
    """Agent-like chats: one 6,000-character preamble, ``sessions`` conversations of 2 to 20 turns, interleaved.

    Each turn resends the history (the preamble, the task, then answers and tool outputs); a
    conversation starts when an earlier one is under way, so turns of many conversations mix.
    """
    rng = random.Random(seed)
    preamble = words(rng, 6000)
    plans = []
    for number in range(sessions):
        task = f"task {number}: " + words(rng, 400)
        messages: list[dict[str, Any]] = [{"role": "system", "content": preamble}, {"role": "user", "content": task}]
        turns = []
        for _ in range(rng.randint(2, 20)):
            turns.append(chat(list(messages)))
            messages += [
                {"role": "assistant", "content": words(rng, 80)},
                {"role": "user", "content": "tool output: " + words(rng, 300)},
            ]
        plans.append(turns)
    # Interleave: at each step, continue a random open conversation, or open the next one.
    out: list[tuple[int, RouteRequest]] = []
    cursors = [0] * sessions
    opened = 1
    while True:
        open_ones = [s for s in range(opened) if cursors[s] < len(plans[s])]
        if not open_ones and opened == sessions:
            return out
        if opened < sessions and (not open_ones or rng.random() < 0.15):
            opened += 1
            continue
        s = rng.choice(open_ones)
        out.append((s, plans[s][cursors[s]]))
        cursors[s] += 1


def short_prompt_chats(seed: int, conversations: int = 160, under_way: int = 12) -> list[tuple[int, RouteRequest]]:
    """Chats under 16 system prompts of 1,000 characters (cheap to copy), 1-16 turns each (geometric, mean 4),
    about ``under_way`` under way at a time: ``(conversation, request)`` in sending order."""
    rng = random.Random(seed)
    systems = [words(rng, 1000) for _ in range(16)]
    plans = []
    for number in range(conversations):
        turns = 1
        while turns < 16 and rng.random() < 0.75:
            turns += 1
        questions = [f"question {number}: " + words(rng, 200)] + [words(rng, 150) for _ in range(turns - 1)]
        plans.append(conversation(rng.choice(systems), [(q, words(rng, 300)) for q in questions]))
    out: list[tuple[int, RouteRequest]] = []
    cursors, opened = [0] * conversations, 0
    while True:
        open_ones = [c for c in range(opened) if cursors[c] < len(plans[c])]
        if not open_ones and opened == conversations:
            return out
        if opened < conversations and len(open_ones) < under_way:
            opened += 1
            continue
        c = rng.choice(open_ones)
        out.append((c, plans[c][cursors[c]]))
        cursors[c] += 1


def route_chats(
    router: Router, traffic: Sequence[tuple[int, RouteRequest]]
) -> tuple[dict[str, int], dict[int, set[str]]]:
    """Route ``(conversation, request)`` pairs one at a time (each released before the next): the requests each
    backend took, and the backends each conversation's requests went to."""
    requests: dict[str, int] = {}
    backends: dict[int, set[str]] = {}
    for number, request in traffic:
        with router.route(request) as lease:
            requests[lease.backend.id] = requests.get(lease.backend.id, 0) + 1
            backends.setdefault(number, set()).add(lease.backend.id)
    return requests, backends
