"""consistent-hash keyed at message boundaries (``prefix=messages``, the default); bounded-load's own file repeats
the behaviours it inherits."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute_consistent_hash import ConsistentHash
from kvroute_consistent_hash.groups import MIN_EVIDENCE

from kvroute import Backend, ConfigError, Fleet, Router, RouteRequest
from kvroute.keys import message_cuts, prefix_key
from kvroute.testing import ScalingStateMachine
from tests.helpers import chat, conversation, words
from tests.hypothesis_strategies import prompt_text


def router(**options: object) -> Router:
    return Router.create(Fleet([Backend(f"instance-{i}") for i in range(7)]), "consistent-hash", options)


def strategy(**options: object) -> ConsistentHash:
    chosen = router(**options).strategy
    assert isinstance(chosen, ConsistentHash)
    return chosen


def chat_traffic(requests: int = 300, prompts: int = 24, seed: int = 0) -> list[tuple[int, RouteRequest]]:
    """Chat traffic with short shared prefixes: 24 system prompts of ~2,500 characters, each request with its own
    ~2,000-character question."""
    rng = random.Random(seed)
    systems = [words(rng, 2500) for _ in range(prompts)]
    out = []
    for _ in range(requests):
        group = rng.randrange(prompts)
        messages = [{"role": "system", "content": systems[group]}, {"role": "user", "content": words(rng, 2000)}]
        out.append((group, RouteRequest.from_openai({"model": "m", "messages": messages})))
    return out


class TestPrefixOption:
    def test_default_is_messages(self) -> None:
        """With no options the key is cut at message boundaries, capped at 4,096 characters."""
        default = strategy()
        assert (default.prefix, default.prefix_length) == ("messages", None)

    def test_prefix_length_alone_is_fixed(self) -> None:
        """prefix_length given alone keeps SageMaker's meaning: the first prefix_length characters are the key."""
        fixed = strategy(prefix_length=4096)
        request = chat_traffic(1)[0][1]
        assert fixed.prefix == "fixed" and fixed.key(request) == prefix_key(request, 4096)

    def test_messages_with_prefix_length_caps_the_cut(self) -> None:
        """prefix=messages with prefix_length keeps message cuts, capped at that length."""
        capped = strategy(prefix="messages", prefix_length=1024)
        request = chat_traffic(1)[0][1]
        assert capped.key(request) == prefix_key(request, 1024) != strategy(prefix_length=2048).key(request)
        assert strategy(prefix="messages").key(request) == prefix_key(request, message_cuts(request).group)

    def test_fixed_alone_uses_4096(self) -> None:
        """prefix=fixed without prefix_length keys on the first 4,096 characters."""
        request = chat_traffic(1)[0][1]
        assert strategy(prefix="fixed").key(request) == prefix_key(request, 4096)

    def test_bad_prefix(self) -> None:
        """An unknown prefix value is a ConfigError naming the choices and what was got."""
        with pytest.raises(ConfigError, match=r"'prefix' must be one of messages, fixed \(got 'tokens'\)"):
            router(prefix="tokens")

    def test_affinity_key_still_wins(self) -> None:
        """With an affinity key the text does not matter, whatever the prefix option."""
        a = RouteRequest.from_openai(
            {"model": "m", "messages": [{"role": "user", "content": "a"}]}, headers={"x-kvroute-affinity": "s-1"}
        )
        b = RouteRequest.from_openai(
            {"model": "m", "messages": [{"role": "user", "content": "b"}]}, headers={"x-kvroute-affinity": "s-1"}
        )
        assert strategy().key(a) == strategy().key(b) == prefix_key(a)


class TestShortSharedPrefix:
    def test_each_system_prompt_has_one_backend_by_default(self) -> None:
        """With a 2,500-character system prompt and a 2,000-character question, every request of one
        system prompt goes to one backend under the default options."""
        r = router()
        homes: defaultdict[int, set[str]] = defaultdict(set)
        for group, request in chat_traffic():
            with r.route(request) as lease:
                homes[group].add(lease.backend.id)
        assert all(len(backends) == 1 for backends in homes.values()), homes
        assert len(set().union(*homes.values())) >= 4  # 24 prompts are spread, not piled on one backend

    def test_fixed_4096_spreads_them(self) -> None:
        """With a fixed prefix_length=4096 the question is in the key: one prompt's
        requests spread."""
        r = router(prefix_length=4096)
        homes: defaultdict[int, set[str]] = defaultdict(set)
        for group, request in chat_traffic():
            homes[group].add(r.decide(request)[0].backend.id)
        assert max(len(backends) for backends in homes.values()) >= 4


class TestTurns:
    @settings(derandomize=True, max_examples=100)
    @given(
        st.none() | prompt_text | st.integers(0, 6000).map(lambda n: "s" * n),
        st.lists(
            st.tuples(prompt_text | st.integers(0, 3000).map(lambda n: "q" * n), prompt_text), min_size=2, max_size=5
        ),
    )
    def test_every_turn_has_the_first_turns_key_and_backend(
        self, system: str | None, turns: list[tuple[str, str]]
    ) -> None:
        """Turn N+1 of a conversation gets turn N's key and backend (short first turns included)."""
        r = router()
        decisions = [r.decide(request)[0] for request in conversation(system, turns)]
        assert len({(d.key, d.backend.id) for d in decisions}) == 1

    def test_fixed_length_moves_short_first_turns(self) -> None:
        """With the fixed 4,096-character key a short first turn's key differs from the second turn's (which the
        default's message-boundary key avoids)."""
        requests = conversation("be brief", [("hi", "hello! " * 300), ("and then?", "")])
        fixed = strategy(prefix_length=4096)
        assert fixed.key(requests[0]) != fixed.key(requests[1])
        assert strategy().key(requests[0]) == strategy().key(requests[1])


class TestHotSystemPrompt:
    def test_one_shared_system_prompt_spreads_by_conversation(self) -> None:
        """Under one shared system prompt, conversations spread over the fleet once it is hot, and every turn of
        a conversation started after that stays on one backend."""
        r = router()
        rng = random.Random(3)
        system = words(rng, 3000)
        conversations = [
            conversation(system, [(words(rng, 200), words(rng, 400)) for _ in range(3)]) for _ in range(60)
        ]
        first_turns = [turns[0] for turns in conversations]
        for request in first_turns[:MIN_EVIDENCE]:  # the learning period: the group's home takes them
            with r.route(request):
                pass
        assert isinstance(r.strategy, ConsistentHash) and len(r.strategy.hot_groups.hot) == 1
        backends: Counter[str] = Counter()
        for turns in conversations[MIN_EVIDENCE:]:
            homes = set()
            for request in turns:
                with r.route(request) as lease:
                    homes.add(lease.backend.id)
            assert len(homes) == 1
            backends.update(homes)
        assert len(backends) >= 5, backends

    def test_later_turns_do_not_make_a_group_hot(self) -> None:
        """Hot groups count conversations: 100 later turns of two conversations leave their system prompt cold."""
        r = router()
        rng = random.Random(6)
        system = words(rng, 3000)
        long_ones = [conversation(system, [(words(rng, 100), words(rng, 100)) for _ in range(51)]) for _ in range(2)]
        for turns in long_ones:
            for request in turns[1:]:
                with r.route(request):
                    pass
        assert isinstance(r.strategy, ConsistentHash) and not r.strategy.hot_groups.hot
        for turns in long_ones:
            with r.route(turns[0]):
                pass
        assert not r.strategy.hot_groups.hot

    def test_replicas_agree_once_they_have_seen_the_traffic(self) -> None:
        """Two routers that saw the same traffic (each its own requests) make the same picks."""
        a, b = router(), router()
        rng = random.Random(4)
        system = words(rng, 3000)
        requests = [chat([{"role": "system", "content": system}, {"role": "user", "content": words(rng, 100)}])]
        requests += [
            chat([{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]) for i in range(40)
        ]
        for i, request in enumerate(requests):
            with (a if i % 2 else b).route(request):
                pass
        assert [a.decide(q)[0].backend.id for q in requests] == [b.decide(q)[0].backend.id for q in requests]


def agent_session(preamble: str, task: str, rng: random.Random, turns: int = 4) -> list[RouteRequest]:
    """The requests of one agent session: the preamble, the task, then per turn an answer and a tool result."""
    messages: list[dict[str, object]] = [{"role": "system", "content": preamble}, {"role": "user", "content": task}]
    requests = [chat(messages)]
    for _ in range(turns - 1):
        messages = [
            *messages,
            {"role": "assistant", "content": words(rng, 200)},
            {"role": "tool", "content": words(rng, 3000)},
        ]
        requests.append(chat(messages))
    return requests


class TestLongPreamble:
    def test_conversations_spread_and_keep_their_backend(self) -> None:
        """Under one 12,000-character tools + instructions preamble (longer than prefix_length), once the preamble is
        hot each session has its own key, the same on every turn, and sessions spread over the fleet."""
        r = router()
        rng = random.Random(12)
        preamble = words(rng, 12_000)
        sessions = [agent_session(preamble, f"task {i}: " + words(rng, 300), rng) for i in range(80)]
        for turns in sessions[:MIN_EVIDENCE]:  # the learning period: the group's home takes them
            with r.route(turns[0]):
                pass
        assert isinstance(r.strategy, ConsistentHash) and len(r.strategy.hot_groups.hot) == 1
        keys: set[int] = set()
        backends: Counter[str] = Counter()
        for turns in sessions[MIN_EVIDENCE:]:
            decisions = []
            for request in turns:
                with r.route(request) as lease:
                    decisions.append(lease.decision)
            assert len({(d.key, d.backend.id) for d in decisions}) == 1
            keys.add(decisions[0].key)  # type: ignore[arg-type]
            backends[decisions[0].backend.id] += 1
        assert len(keys) == len(sessions) - MIN_EVIDENCE
        assert len(backends) == 7 and max(backends.values()) <= 20, backends

    def test_later_agent_turns_are_not_new_conversations(self) -> None:
        """An agent's later turns (one user message, then answers and tool results) are not counted as conversations:
        200 of them from two sessions leave their preamble cold."""
        r = router()
        rng = random.Random(13)
        preamble = words(rng, 12_000)
        for i in range(2):
            for request in agent_session(preamble, f"task {i}", rng, turns=101)[1:]:
                with r.route(request):
                    pass
        assert isinstance(r.strategy, ConsistentHash) and not r.strategy.hot_groups.hot


class TestConversationKeyMethod:
    def test_same_over_turns_and_different_per_session(self) -> None:
        """conversation_key is the same on every turn of a session and differs between sessions, whether or not the
        group is hot (it does not depend on the strategy's state)."""
        chosen = strategy()
        rng = random.Random(14)
        preamble = words(rng, 12_000)
        sessions = [agent_session(preamble, f"task {i}", rng) for i in range(20)]
        keys = [{chosen.conversation_key(request) for request in turns} for turns in sessions]
        assert all(len(k) == 1 and None not in k for k in keys)
        assert len(set().union(*keys)) == 20

    def test_none_without_a_conversation(self) -> None:
        """None with prefix=fixed, an affinity key, a plain completion or a chat without a user message."""
        request = chat([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}])
        assert strategy().conversation_key(request) is not None
        assert strategy(prefix="fixed").conversation_key(request) is None
        assert strategy().conversation_key(RouteRequest.from_text("p" * 5000)) is None
        assert strategy().conversation_key(chat([{"role": "system", "content": "s"}])) is None
        pinned = RouteRequest.from_openai(
            {"model": "m", "messages": [{"role": "user", "content": "q"}]}, headers={"x-kvroute-affinity": "s-1"}
        )
        assert strategy().conversation_key(pinned) is None


def _chat_samples(count: int) -> list[RouteRequest]:
    """Sample chats for the scaling machine: the first six (the ones it starts) share a system prompt, which
    turns hot on the loaded router; the others each have their own."""
    shared = {"role": "system", "content": "a shared system prompt " * 20}
    out = []
    for i in range(count):
        system = shared if i < 6 else {"role": "system", "content": f"system prompt {i} " * 10}
        out.append(chat([system, {"role": "user", "content": f"question {i}"}]))
    return out


class _ChatScalingMachine(ScalingStateMachine):
    """The scaling machine over chats, so that a hot group switches keys on the router carrying the load."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = _CHATS


_CHATS = _chat_samples(ScalingStateMachine.keys)

TestChatScaling = _ChatScalingMachine.for_strategy("consistent-hash", max_examples=8).TestCase


class TestGroupMemo:
    def test_request_start_reuses_the_picks_key(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Routing one request cuts its messages once (pick and on_request_start share it); another request is cut
        afresh and keyed on its own text."""
        import kvroute_consistent_hash as module

        calls: list[RouteRequest] = []

        def counting(request: RouteRequest, length: int) -> object:
            calls.append(request)
            return message_cuts(request, length)

        monkeypatch.setattr(module, "message_cuts", counting)
        chosen = router()
        (_, first), (_, second) = chat_traffic(2, seed=3)
        with chosen.route(first):
            pass
        assert calls == [first]
        with chosen.route(second):
            pass
        assert calls == [first, second]
        strategy_ = chosen.strategy
        assert isinstance(strategy_, ConsistentHash)
        assert strategy_.key(second) == prefix_key(second, message_cuts(second, 4096).group)
