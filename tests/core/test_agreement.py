"""Router replicas that do not talk agree where a conversation without a session id lives (`Sessions.agree`)."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from typing import Any

import pytest

from kvroute import Backend, Fleet, Router, RouteRequest, Sessions
from kvroute.agreement import MIN_EVIDENCE, Strangers
from kvroute.keys import opens_conversation
from tests.helpers import Clock, chat

PREAMBLE = "You are a coding agent with tools read_file, write_file and run_tests. " * 200


def replica(agree: str = "auto", shared: bool = False) -> Router:
    """A router as ``kvroute serve`` builds it without peers: bounded-load and sessions."""
    fleet = Fleet()
    for i in range(7):
        fleet.add(Backend(f"b{i}", f"http://10.0.0.{i}:8000"))
    return Router.create(fleet, "bounded-load", sessions=Sessions(agree=agree, shared=shared, clock=Clock()))


def run(routers: list[Router], conversations: int = 56, turns: int = 6) -> dict[int, list[str]]:
    """Staggered conversations under one long preamble, each turn sent to a replica picked at random (seeded).

    Returns each conversation's backends, turn by turn.
    """
    rng = random.Random(0)
    steps = sorted((c // 2 + 3 * t, c, t) for c in range(conversations) for t in range(turns))
    histories: dict[int, list[dict[str, Any]]] = {}
    path: dict[int, list[str]] = {}
    for _, c, t in steps:
        messages = histories.setdefault(
            c,
            [
                {"role": "system", "content": PREAMBLE},
                {"role": "user", "content": f"task {c} " + "x" * rng.randrange(300, 900)},
            ],
        )
        router = routers[rng.randrange(len(routers))]
        with router.route(chat(messages)) as lease:
            path.setdefault(c, []).append(lease.backend.id)
        messages += [{"role": "assistant", "content": f"done {c}.{t}"}, {"role": "user", "content": "out " * 40}]
    return path


def changes(path: dict[int, list[str]]) -> int:
    """Turns that went to another backend than the turn before them."""
    return sum(a != b for p in path.values() for a, b in itertools.pairwise(p))


class TestStrangers:
    def test_turns_on_past_an_eighth_with_history_and_off_under_a_sixteenth(self) -> None:
        """The verdict needs `MIN_EVIDENCE` conversations, goes on above 1/8 arriving with a history, off below 1/16."""
        assert MIN_EVIDENCE == 2
        strangers = Strangers(window=64)
        strangers.observe(True)
        assert not strangers.on  # 1 of 1: too little evidence
        strangers.observe(False)
        assert strangers.on  # 1 of 2
        for _ in range(14):
            strangers.observe(False)
        assert strangers.on  # 1 of 16: under 1/8 but not under 1/16
        strangers.observe(False)
        assert not strangers.on  # 1 of 17
        assert (strangers.seen, strangers.foreign) == (17, 1)
        for _ in range(2):
            strangers.observe(True)
        assert strangers.on  # 3 of 19

    def test_window_forgets_the_oldest(self) -> None:
        """Only the last ``window`` conversations count."""
        strangers = Strangers(window=8)
        for _ in range(8):
            strangers.observe(True)
        assert strangers.on
        for _ in range(8):
            strangers.observe(False)
        assert (strangers.seen, strangers.foreign, strangers.on) == (8, 0, False)

    def test_rejects_an_empty_window(self) -> None:
        with pytest.raises(ValueError, match="'window' must be a positive integer"):
            Strangers(window=0)


class TestOpensConversation:
    def test_first_turns_and_later_turns(self) -> None:
        """A chat opens its conversation until an answer follows its first user message."""
        first = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        assert opens_conversation(chat(first))
        assert not opens_conversation(
            chat([*first, {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}])
        )
        completion = RouteRequest.from_openai({"model": "m", "prompt": "p"}, endpoint="completions")
        assert opens_conversation(completion)


class TestAgreement:
    def test_unsynced_replicas_keep_each_conversation_on_one_backend(self) -> None:
        """Four replicas that never talk: with ``agree=auto``, once they have seen later turns of conversations they
        did not place, every new conversation keeps one backend; with ``off`` its turns keep changing backends."""
        agreeing = [replica() for _ in range(4)]
        auto = run(agreeing)
        off = run([replica("off") for _ in range(4)])
        assert all(r.sessions is not None and r.sessions.agreeing for r in agreeing)
        assert all(len(set(p)) == 1 for c, p in auto.items() if c >= 16), auto
        assert changes(auto) <= 15 and changes(off) >= 150, (changes(auto), changes(off))

    def test_agree_on_needs_no_evidence(self) -> None:
        """With ``agree=on`` every turn of a conversation goes to the same backend from the first request."""
        assert changes(run([replica("on") for _ in range(4)])) == 0

    def test_one_replica_keeps_the_share_bound(self) -> None:
        """One router never sees a later turn of a conversation it did not place: it places as with ``off``."""
        router = replica()
        assert run([router]) == run([replica("off")])
        assert router.sessions is not None and not router.sessions.agreeing
        assert router.sessions.strangers.foreign == 0

    def test_synced_replicas_do_not_switch(self) -> None:
        """With peers (``shared``) the replicas share their bindings: no switch to the key's home."""
        router = replica(shared=True)
        assert router.sessions is not None
        for _ in range(MIN_EVIDENCE):
            router.sessions.strangers.observe(True)
        assert router.sessions.strangers.on and not router.sessions.agreeing

    def test_a_binding_made_before_the_switch_is_placed_again_once(self) -> None:
        """A conversation bound by the strategy's own pick moves to its key's home once the replica switches, then
        stays."""
        router = replica()
        sessions = router.sessions
        assert sessions is not None
        messages = [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": "find the bug " * 40}]
        moved = None
        for attempt in range(64):  # a conversation the share bound put elsewhere than its home
            messages[1]["content"] = f"task {attempt} " * 40
            with router.route(chat(messages)) as lease:
                if lease.decision.reason != "hash":
                    moved = lease.backend.id
                    break
        assert moved is not None
        for _ in range(MIN_EVIDENCE):
            sessions.strangers.observe(True)
        later = [*messages, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
        with router.route(chat(later)) as lease:
            assert lease.decision.detail["move_reason"] == "agree" and lease.backend.id != moved
            home = lease.backend.id
        with router.route(chat(later)) as lease:
            assert (lease.backend.id, lease.decision.reason) == (home, "session")
        assert sessions.moved == Counter({"agree": 1})

    def test_rejects_an_unknown_mode(self) -> None:
        with pytest.raises(ValueError, match="'agree' must be one of auto, on, off"):
            Sessions(agree="maybe")
