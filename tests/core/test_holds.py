"""Router-replica sync in the library: the hold log, adopting holds in the session table and the router."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from kvroute import Backend, Fleet, Hold, HoldLog, Holds, Router, RouteRequest, Sessions
from kvroute.sessions import session_key
from tests.helpers import Clock

PREAMBLE = "You are a coding agent with tools read_file, write_file and run_tests. " * 200


def fleet(count: int = 7) -> Fleet:
    f = Fleet()
    for i in range(count):
        f.add(Backend(f"b{i}", f"http://10.0.0.{i}:8000"))
    return f


def replica(sync: bool, clock: Clock | None = None, agree: str = "auto") -> Router:
    """A router as ``kvroute serve`` builds it: bounded-load, sessions, and a hold log when synced."""
    sessions = Sessions(shared=sync, clock=clock or Clock(), agree=agree)
    return Router.create(fleet(), "bounded-load", sessions=sessions, holds=HoldLog() if sync else None)


def sync_all(routers: list[Router]) -> None:
    for source in routers:
        assert source.holds is not None
        holds = source.holds.drain()
        for target in routers:
            if target is not source:
                target.adopt_holds(holds)


def chat(messages: list[dict[str, Any]], session: str | None = None) -> RouteRequest:
    headers = {"x-session-id": session} if session else {}
    return RouteRequest.from_openai({"model": "m", "messages": messages}, endpoint="chat", headers=headers)


def run(routers: list[Router], *, sync: bool, sessions: bool = False, conversations: int = 28) -> dict[int, set[str]]:
    """Five turns of each conversation, each turn sent to a replica picked at random (seeded); engines used."""
    rng = random.Random(0)
    histories = [
        [
            {"role": "system", "content": PREAMBLE},
            {"role": "user", "content": f"task {c} " + "x" * rng.randrange(300, 900)},
        ]
        for c in range(conversations)
    ]
    used: dict[int, set[str]] = {}
    for turn in range(5):
        for c, messages in enumerate(histories):
            router = routers[rng.randrange(len(routers))]
            with router.route(chat(messages, f"s{c}" if sessions else None)) as lease:
                used.setdefault(c, set()).add(lease.backend.id)
            messages += [{"role": "assistant", "content": f"done {c}.{turn}"}, {"role": "user", "content": "out " * 40}]
            if sync:
                sync_all(routers)
    return used


class TestHoldLog:
    def test_drain_ages_holds_by_their_time_in_the_log(self) -> None:
        """Drained holds come out oldest first, each aged by its time in the log (plus the age it came with)."""
        clock = Clock()
        log = HoldLog(clock=clock)
        log.add([Hold("conversation", 1, "b0"), Hold("key", 2, "b1", 0.5)])
        clock.now += 0.25
        log.add([Hold("conversation", 1, "b3")])
        clock.now += 0.25
        assert log.drain() == [
            Hold("conversation", 1, "b0", 0.5),
            Hold("key", 2, "b1", 1.0),
            Hold("conversation", 1, "b3", 0.25),
        ]
        assert len(log) == 0

    def test_bounded_with_drops_counted(self) -> None:
        """Past ``max_holds`` the oldest holds go and are counted; a drain takes at most ``limit``."""
        log = HoldLog(max_holds=3, clock=Clock())
        log.add(Hold("key", k, "b0") for k in range(5))
        assert (len(log), log.dropped, log.added) == (3, 2, 5)
        assert [h.key for h in log.drain(limit=2)] == [2, 3]
        assert [h.key for h in log.drain()] == [4]

    def test_rejects_an_empty_log(self) -> None:
        """A log that can hold nothing is a configuration mistake."""
        with pytest.raises(ValueError, match="max_holds"):
            HoldLog(max_holds=0)


class TestSessionsAdopt:
    def test_results(self) -> None:
        """A peer's binding is new here, refreshes the same backend, moves ours when newer, and loses when older."""
        clock = Clock()
        sessions = Sessions(clock=clock)
        assert sessions.adopt_holds([Hold("session", 7, "b1", 1.0)]) == {"new": 1}
        assert sessions.adopt_holds([Hold("session", 7, "b1", 0.0)]) == {"same": 1}
        assert sessions.adopt_holds([Hold("session", 7, "b2", 5.0)]) == {"older": 1}
        clock.now += 1.0
        assert sessions.adopt_holds([Hold("conversation", 7, "b2", 0.5)]) == {"newer": 1}
        assert sessions.adopt_holds([Hold("key", 8, "b2")]) == {}
        assert sessions.adopt_holds([Hold("session", 9, "b2", 301.0)]) == {"expired": 1}
        assert sessions.stats()["adopted"] == {"expired": 1, "new": 1, "newer": 1, "older": 1, "same": 1}
        assert sessions.bound() == 1

    def test_an_adopted_binding_routes_the_next_request(self) -> None:
        """A session another replica bound goes to that replica's backend here, whatever its hash home."""
        router = replica(sync=True)
        request = chat([{"role": "user", "content": "hello"}], session="abc")
        key = session_key(request)
        assert key is not None
        home = router.decide(request)[0].backend.id
        other = next(s.id for s in router.fleet if s.id != home)
        assert router.adopt_holds([Hold("session", key, other, 0.1)]) == Counter({"new": 1, "strategy_adopted": 1})
        with router.route(request) as lease:
            assert lease.backend.id == other


class TestRouterSync:
    def test_unknown_backends_are_counted_and_skipped(self) -> None:
        """A hold naming a backend this fleet lacks is not adopted anywhere."""
        router = replica(sync=True)
        assert router.adopt_holds([Hold("conversation", 1, "nope")]) == Counter({"unknown_backend": 1})
        assert router.sessions is not None and router.sessions.bound() == 0

    def test_bounded_load_implements_the_holds_protocol(self) -> None:
        """The default strategy exports and adopts holds (`kvroute.Holds`)."""
        assert isinstance(replica(sync=True).strategy, Holds)

    def test_no_log_without_sync(self) -> None:
        """A router built without a hold log keeps nothing for peers."""
        router = replica(sync=False)
        with router.route(chat([{"role": "user", "content": "hi"}])):
            pass
        assert router.holds is None

    def test_conversations_stay_on_one_backend_across_synced_replicas(self) -> None:
        """Four replicas that share holds send each conversation's turns to one backend; without (nor ``agree``),
        many split."""
        synced = run([replica(sync=True) for _ in range(4)], sync=True)
        alone = run([replica(sync=False, agree="off") for _ in range(4)], sync=False)
        assert all(len(b) == 1 for b in synced.values()), synced
        assert sum(len(b) > 1 for b in alone.values()) >= 10, alone

    def test_conversations_under_a_long_preamble_spread_across_synced_replicas(self) -> None:
        """28 conversations under one preamble longer than ``prefix_length``, no session id, 4 synced replicas:
        spread over the 7 backends as one router spreads them (3-5 each), not parked on the preamble's holder.

        The preamble's key turns hot only when the placements of every replica's requests count, which the
        peers' key holds carry; counting only its own, each replica kept sending new conversations to the
        key's holder (8 of 28 on one backend)."""
        synced = run([replica(sync=True) for _ in range(4)], sync=True)
        alone = run([replica(sync=False, agree="off")], sync=False)
        for used in (synced, alone):
            assert all(len(b) == 1 for b in used.values()), used
            per_backend = Counter(next(iter(b)) for b in used.values())
            assert len(per_backend) == 7 and max(per_backend.values()) <= 6, per_backend

    def test_synced_sessions_spread_by_the_share_bound(self) -> None:
        """With sync, session ids are placed under the share bound: 140 sessions over 7 backends within 19-21 each.

        Placed by their hash alone (``Sessions(shared=False)``), the same sessions land 18-23 per backend.
        """
        used = run([replica(sync=True) for _ in range(4)], sync=True, sessions=True, conversations=140)
        assert all(len(b) == 1 for b in used.values())
        per_backend = Counter(next(iter(b)) for b in used.values())
        assert len(per_backend) == 7 and max(per_backend.values()) - min(per_backend.values()) <= 3, per_backend
