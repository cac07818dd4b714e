"""Sessions: reading session ids, binding sessions and conversations, moving once, expiry and bounds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvroute import (
    Backend,
    BackendState,
    BaseStrategy,
    ConfigError,
    Decision,
    Fleet,
    Router,
    RouteRequest,
    Sessions,
    hash64,
)
from kvroute.session_ids import (
    DEFAULT_SESSION_SOURCES,
    MAX_SESSION_ID_BYTES,
    SessionSource,
    parse_sources,
    read_session_id,
)
from kvroute.sessions import session_key
from tests.helpers import Clock


class _Limits:
    """A load bound in the shape `Sessions` reads: ``measure(candidates).limit(state)``."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap

    def measure(self, candidates: Sequence[BackendState]) -> _Limits:
        return self

    def limit(self, state: BackendState) -> str | None:
        return "concurrency_threshold" if self.cap is not None and state.in_flight >= self.cap else None


class HashLike(BaseStrategy):
    """Places a key on the candidate its value picks, as the hash strategies' ``place`` does; logs its calls."""

    def __init__(self, cap: int | None = None, conversations: bool = False) -> None:
        self.bound = _Limits(cap)
        self.calls: list[str] = []
        self._conversations = conversations

    def place(self, key: int, model: str | None, candidates: Sequence[BackendState]) -> Decision:
        self.calls.append("place")
        free = [s for s in candidates if self.bound.limit(s) is None] or list(candidates)
        return Decision(free[key % len(free)].backend, reason="hash", key=key)

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
        self.calls.append("pick")
        return Decision(candidates[0].backend, reason="first")

    def conversation_key(self, request: RouteRequest) -> int | None:
        if not self._conversations or request.messages is None:
            return None
        first_user = next(m for m in request.messages if m["role"] == "user")
        return hash64(first_user["content"]) & 0xFFFF


def chat(*turns: str, session: str | None = None, **headers: str) -> RouteRequest:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for i, text in enumerate(turns):
        if i:
            messages.append({"role": "assistant", "content": f"answer {i}"})
        messages.append({"role": "user", "content": text})
    if session is not None:
        headers["x-session-id"] = session
    return RouteRequest.from_openai({"model": "m", "messages": messages}, headers=headers)


def make(n: int = 4, **strategy: Any) -> tuple[Router, HashLike, Clock]:
    clock = Clock()
    s = HashLike(**strategy)
    fleet = Fleet([Backend(f"b{i}") for i in range(n)])
    return Router(fleet, s, strategy_name="hash-like", sessions=Sessions(clock=clock, ttl_s=60)), s, clock


def send(router: Router, request: RouteRequest, exclude: Sequence[str] = ()) -> Decision:
    with router.route(request, exclude=exclude) as lease:
        return lease.decision


class TestSessionSources:
    def test_parse_header_and_body(self) -> None:
        """Sources are 'header:NAME' (lower-cased) or 'body:PATH' split on dots."""
        assert SessionSource.parse("Header:X-Session-Id") == SessionSource("header", "x-session-id")
        assert SessionSource.parse("body:metadata.session_id").path == ("metadata", "session_id")
        assert [str(s) for s in parse_sources("header:a, body:b,header:a")] == ["header:a", "body:b"]

    @pytest.mark.parametrize("bad", ["x-session-id", "query:x", "header:", "body:a..b", "header:a b"])
    def test_bad_source_is_a_config_error(self, bad: str) -> None:
        """A source that is neither form is refused, naming what was expected."""
        with pytest.raises(ConfigError, match=r"header:NAME|header name|empty key"):
            SessionSource.parse(bad)

    def test_defaults_in_documented_order(self) -> None:
        """The default sources are the documented eight, kvroute's own header first."""
        assert [str(s) for s in DEFAULT_SESSION_SOURCES] == [
            "header:x-kvroute-affinity",
            "body:prompt_cache_key",
            "header:x-session-id",
            "header:x-dynamo-session-id",
            "header:x-claude-code-session-id",
            "header:session_id",
            "header:session-id",
            "body:metadata.session_id",
        ]


class TestReadSessionId:
    def test_first_usable_source_wins(self) -> None:
        """The earliest source with a value wins over later ones."""
        body = {"prompt_cache_key": "pck", "metadata": {"session_id": "meta"}}
        read = read_session_id(body, {"x-session-id": "hdr"}, DEFAULT_SESSION_SOURCES)
        assert (read.session_id, str(read.source), read.ignored) == ("pck", "body:prompt_cache_key", None)
        assert read_session_id({"metadata": {"session_id": "meta"}}, {}, DEFAULT_SESSION_SOURCES).session_id == "meta"

    def test_too_long_is_skipped_with_a_reason(self) -> None:
        """A session id over 256 bytes is skipped, the reason kept, and the next source used."""
        long_id = "é" * (MAX_SESSION_ID_BYTES // 2 + 1)  # 2 bytes each in UTF-8
        read = read_session_id({"prompt_cache_key": long_id}, {"x-session-id": "ok"}, DEFAULT_SESSION_SOURCES)
        assert (read.session_id, read.ignored) == ("ok", "too_long")
        exact = "a" * MAX_SESSION_ID_BYTES
        assert read_session_id({"prompt_cache_key": exact}, {}, DEFAULT_SESSION_SOURCES).session_id == exact

    def test_header_must_be_utf8(self) -> None:
        """A header whose bytes are not UTF-8 is skipped as not_utf8; a UTF-8 one is decoded."""
        bad = b"\xff\xfe".decode("latin-1")
        assert read_session_id({}, {"x-session-id": bad}, DEFAULT_SESSION_SOURCES).ignored == "not_utf8"
        good = "sé".encode().decode("latin-1")
        assert read_session_id({}, {"x-session-id": good}, DEFAULT_SESSION_SOURCES).session_id == "sé"

    @pytest.mark.parametrize("value", [5, ["a"], {"id": "a"}, True])
    def test_wrong_type_in_body(self, value: object) -> None:
        """A body field that is not a string is skipped as wrong_type."""
        read = read_session_id({"prompt_cache_key": value}, {}, DEFAULT_SESSION_SOURCES)
        assert (read.session_id, read.ignored) == (None, "wrong_type")

    def test_lone_surrogate_and_blank(self) -> None:
        """A JSON string with a lone surrogate is not_utf8; a blank one is empty."""
        assert read_session_id({"prompt_cache_key": "\ud800"}, {}, DEFAULT_SESSION_SOURCES).ignored == "not_utf8"
        assert read_session_id({"prompt_cache_key": "  "}, {}, DEFAULT_SESSION_SOURCES).ignored == "empty"

    def test_from_openai_reads_and_never_fails(self) -> None:
        """RouteRequest.from_openai fills session_id, or session_ignored for a bad one, and reads none with ()."""
        body = {"model": "m", "prompt": "hi", "prompt_cache_key": "s1"}
        assert RouteRequest.from_openai(body, endpoint="completions").session_id == "s1"
        assert RouteRequest.from_openai(body, endpoint="completions", session_sources=()).session_id is None
        bad = RouteRequest.from_openai({**body, "prompt_cache_key": 7}, endpoint="completions")
        assert (bad.session_id, bad.session_ignored) == (None, "wrong_type")


class TestSessions:
    def test_new_session_is_placed_by_its_key_and_replicas_agree(self) -> None:
        """A session with no binding goes where place() puts its key; a second router does the same."""
        router, strategy, _ = make()
        other, _, _ = make()
        request = chat("hi", session="s-1")
        key = session_key(request)
        assert key is not None
        first = send(router, request)
        assert strategy.calls == ["place"] and first.backend.id == f"b{key % 4}"
        assert send(other, request).backend.id == first.backend.id
        assert router.sessions is not None and router.sessions.new == 1

    def test_later_turns_stay_without_asking_the_strategy(self) -> None:
        """A bound session's later turns go to its backend with reason 'session'."""
        router, strategy, _ = make()
        first = send(router, chat("hi", session="s-1"))
        strategy.calls.clear()
        later = send(router, chat("hi", "more", session="s-1"))
        assert (later.backend.id, later.reason, strategy.calls) == (first.backend.id, "session", [])
        assert "session" in later.explain()

    def test_moves_once_when_unroutable_and_stays_at_the_new_home(self) -> None:
        """An excluded bound backend moves the session; when it returns, the session stays where it went."""
        router, _, _ = make()
        home = send(router, chat("hi", session="s-1")).backend.id
        moved = send(router, chat("hi", session="s-1"), exclude=[home])
        assert moved.backend.id != home and moved.detail["move_reason"] == "unroutable"
        again = send(router, chat("hi", session="s-1"))
        assert (again.backend.id, again.reason) == (moved.backend.id, "session")
        assert router.sessions is not None and router.sessions.moved == {"unroutable": 1}

    def test_moves_when_over_the_load_bound(self) -> None:
        """A bound backend at the strategy's load limit loses the session to one with room."""
        router, _, _ = make(cap=1)
        request = chat("hi", session="s-1")
        with router.route(request) as held:  # one request in flight fills the home (cap 1)
            nxt = send(router, chat("hi", "2", session="s-1"))
        assert nxt.backend.id != held.backend.id and nxt.detail["move_reason"] == "concurrency_threshold"
        assert send(router, request).backend.id == nxt.backend.id

    def test_expires_after_ttl(self) -> None:
        """A binding unused for ttl_s is dropped and counted; the next request is placed afresh."""
        router, strategy, clock = make()
        send(router, chat("hi", session="s-1"))
        clock.now += 61
        strategy.calls.clear()
        send(router, chat("hi", session="s-1"))
        sessions = router.sessions
        assert sessions is not None and (sessions.expired, strategy.calls, sessions.new) == (1, ["place"], 2)

    def test_bounded_memory_evicts_least_recently_used(self) -> None:
        """Beyond max_sessions the least recently used binding goes first, counted as evicted."""
        fleet = Fleet([Backend(f"b{i}") for i in range(3)])
        sessions = Sessions(max_sessions=2, clock=Clock())
        router = Router(fleet, HashLike(), sessions=sessions)
        for name in ("a", "b", "a", "c"):
            send(router, chat("hi", session=name))
        assert (len(sessions), sessions.evicted) == (2, 1)
        assert sessions.binding(chat("hi", session="b")) is None
        assert sessions.binding(chat("hi", session="a")) is not None

    def test_dry_run_binds_nothing(self) -> None:
        """Router.decide asks the sessions but creates no binding."""
        router, _, _ = make()
        router.decide(chat("hi", session="s-1"))
        assert router.sessions is not None and len(router.sessions) == 0

    def test_conversations_bind_by_the_strategy_key(self) -> None:
        """Without a session id, a strategy's conversation_key binds the first turn's backend for later turns."""
        router, strategy, _ = make(conversations=True)
        first = send(router, chat("question one"))
        assert strategy.calls == ["pick"] and first.detail["binds"] == "conversation"
        strategy.calls.clear()
        later = send(router, chat("question one", "follow-up"))
        assert (later.reason, later.backend.id, strategy.calls) == ("session", first.backend.id, [])
        assert router.sessions is not None and router.sessions.bound("conversation") == 1

    def test_no_key_means_the_strategy_alone(self) -> None:
        """A request with no session id and no conversation key is the strategy's pick, with nothing bound."""
        router, strategy, _ = make()
        decision = send(router, chat("hi"))
        assert decision.reason == "first" and strategy.calls == ["pick"]
        assert router.sessions is not None and len(router.sessions) == 0
