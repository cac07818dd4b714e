"""bounded-load with consistent-hash's message key (``prefix=messages``), the proxy's default strategy and options."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute_bounded_load import BoundedLoad

from kvroute import Backend, Fleet, Router, RouteRequest
from kvroute.testing import Claims, ScalingStateMachine
from tests.helpers import chat, conversation, route_chats, short_prompt_chats, words
from tests.hypothesis_strategies import prompt_text


def router(**options: object) -> Router:
    return Router.create(Fleet([Backend(f"instance-{i}") for i in range(7)]), "bounded-load", options)


class TestBoundedLoadMessageKey:
    def test_default_is_messages_and_prefix_length_alone_is_fixed(self) -> None:
        """bounded-load inherits the prefix option: messages by default, fixed when only prefix_length is set."""
        default, sagemaker = router().strategy, router(prefix_length=8000, concurrency_threshold=16).strategy
        assert isinstance(default, BoundedLoad) and isinstance(sagemaker, BoundedLoad)
        assert (default.prefix, sagemaker.prefix) == ("messages", "fixed")

    @staticmethod
    def _chat_traffic(r: Router) -> tuple[defaultdict[int, set[str]], Counter[str]]:
        """24 system prompts of 2,500 characters, 2,000-character questions, 300 requests, 8 in flight."""
        rng = random.Random(0)
        systems = [words(rng, 2500) for _ in range(24)]
        homes: defaultdict[int, set[str]] = defaultdict(set)
        requests: Counter[str] = Counter()
        in_flight = []
        for _ in range(300):
            group = rng.randrange(24)
            messages = [{"role": "system", "content": systems[group]}, {"role": "user", "content": words(rng, 2000)}]
            lease = r.acquire(chat(messages))
            homes[group].add(lease.backend.id)
            requests[lease.backend.id] += 1
            in_flight.append(lease)
            if len(in_flight) == 8:
                r.release(in_flight.pop(0))
        for lease in in_flight:
            r.release(lease)
        return homes, requests

    def test_chat_traffic_keeps_each_system_prompt_on_few_backends_and_balances(self) -> None:
        """Chat traffic of 24 system prompts on 7 backends: each prompt keeps one or two backends (it moves only
        when its backend is over 1.375x its share), and the busiest backend takes at most 1.4x a fair share."""
        homes, requests = self._chat_traffic(router())
        assert all(len(backends) <= 2 for backends in homes.values()), homes
        assert sum(len(backends) == 1 for backends in homes.values()) >= 18
        assert len(requests) == 7 and max(requests.values()) <= 1.4 * 300 / 7, requests

    def test_chat_traffic_without_the_share_bound_is_one_backend_per_prompt_and_lumpy(self) -> None:
        """With share_factor=off (pure hashing at this load) every prompt has one backend, and the busiest takes
        more than 1.4x a fair share: what the share bound corrects."""
        homes, requests = self._chat_traffic(router(share_factor="off"))
        assert all(len(backends) == 1 for backends in homes.values()), homes
        assert len(set().union(*homes.values())) >= 4
        assert max(requests.values()) > 1.4 * 300 / 7, requests

    @settings(derandomize=True, max_examples=60)
    @given(
        st.none() | prompt_text | st.integers(0, 6000).map(lambda n: "s" * n),
        st.lists(st.tuples(prompt_text, prompt_text), min_size=2, max_size=4),
    )
    def test_every_turn_has_the_first_turns_backend(self, system: str | None, turns: list[tuple[str, str]]) -> None:
        """On an idle fleet, turn N+1 of a conversation gets turn N's key and backend."""
        r = router()
        decisions = [r.decide(request)[0] for request in conversation(system, turns)]
        assert len({(d.key, d.backend.id) for d in decisions}) == 1

    def test_hot_system_prompt_spreads_conversations_without_spilling_them(self) -> None:
        """Under one shared system prompt (one chat application), conversations spread over the fleet by their
        first turn once the prompt is hot, instead of filling its home up to the load bound."""
        rng = random.Random(5)
        system = words(rng, 3000)
        r = router()
        backends: Counter[str] = Counter()
        for _ in range(200):
            (request,) = conversation(system, [(words(rng, 300), "")])
            with r.route(request) as lease:
                backends[lease.backend.id] += 1
        assert isinstance(r.strategy, BoundedLoad) and r.strategy.spills == 0
        assert len(backends) == 7 and max(backends.values()) < 200 / 7 * 2, backends

    @pytest.mark.parametrize("seed", [1, 2, 4, 7])
    def test_conversations_under_short_system_prompts_balance_on_a_small_fleet(self, seed: int) -> None:
        """Multi-turn chats under 16 short system prompts on 4 backends (no prompt is hot there): each conversation
        keeps one backend, and every backend takes 0.85-1.15x a fair share of the requests. A prompt's holder
        keeps new conversations only while it has room among the active conversations too, whose later turns
        are its coming requests (with the request share alone these seeds gave 1.17-1.25x and 0.66-0.84x)."""
        r = Router.create(Fleet([Backend(f"instance-{i}") for i in range(4)]), "bounded-load", {})
        traffic = short_prompt_chats(seed)
        requests, backends = route_chats(r, traffic)
        assert all(len(held) == 1 for held in backends.values()), backends
        fair = len(traffic) / 4
        assert len(requests) == 4 and 0.85 * fair <= min(requests.values()), requests
        assert max(requests.values()) <= 1.15 * fair, requests


def _chat_samples(count: int) -> list[RouteRequest]:
    """Sample chats for the scaling machine: the first six (the ones it starts) share a system prompt, which
    turns hot on the loaded router; the others each have their own."""
    shared = {"role": "system", "content": "a shared system prompt " * 20}
    out = []
    for i in range(count):
        system = shared if i < 6 else {"role": "system", "content": f"system prompt {i} " * 10}
        out.append(chat([system, {"role": "user", "content": f"question {i}"}]))
    return out


_CHATS = _chat_samples(ScalingStateMachine.keys)


class _ChatScalingMachine(ScalingStateMachine):
    """The scaling machine over chats, so that a hot group switches keys on the router carrying the load."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = _CHATS


TestChatScaling = _ChatScalingMachine.for_strategy(
    "bounded-load", claims=Claims(load_factor=1.25, min_capacity=16), max_examples=8
).TestCase
