"""The tokenizer-prefix strategy through the real Router: affinity by KV blocks, load bounds, bursts, scaling."""

from __future__ import annotations

import functools
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvroute_tokenizer_prefix import TokenizerPrefix, block_hashes, prompt_ids

import kvroute
from kvroute.errors import ConfigError
from kvroute.testing import Claims, ScalingStateMachine, StrategyConformance

SYSTEM = "You are a careful assistant. Answer briefly and cite the document you used. " * 12


def chat(*turns: str, system: str = SYSTEM) -> dict[str, Any]:
    """A chat body: the system prompt, then alternating user/assistant turns."""
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages}


def conversation_turn(conv: int, turn: int) -> dict[str, Any]:
    """Turn ``turn`` of conversation ``conv``: its whole history plus a new question."""
    turns: list[str] = []
    for t in range(turn + 1):
        turns.append(f"Conversation {conv} question {t}: tell me about topic {conv * 100 + t} in detail please.")
        if t < turn:
            turns.append(f"Answer {t} for conversation {conv}: " + "some words " * 40)
    return chat(*turns)


def make_router(strategy: TokenizerPrefix, count: int = 4) -> kvroute.Router:
    fleet = kvroute.Fleet([kvroute.Backend(f"b{i}") for i in range(count)])
    return kvroute.Router(fleet, strategy, strategy_name="tokenizer-prefix")


def request(body: dict[str, Any], **kw: Any) -> kvroute.RouteRequest:
    return kvroute.RouteRequest.from_openai(body, **kw)


@pytest.fixture
def strategy(model_dir: Path) -> TokenizerPrefix:
    return TokenizerPrefix(tokenizer=str(model_dir))


class TestOptions:
    def test_installed_under_its_name(self, model_dir: Path) -> None:
        """The plugin registers as 'tokenizer-prefix' and takes its options by name."""
        fleet = kvroute.Fleet([kvroute.Backend("a")])
        router = kvroute.Router.create(fleet, "tokenizer-prefix", {"tokenizer": str(model_dir), "block-size": "32"})
        assert isinstance(router.strategy, TokenizerPrefix)
        assert router.strategy.current_block_size == 32

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"block_size": 0}, "'block_size' must be between 1 and 4096"),
            ({"max_prefix_tokens": "lots"}, "'max_prefix_tokens': expected an integer"),
            ({"load_factor": 0.5}, "'load_factor' must be between 1.0 and 100.0"),
            ({"content_format": "xml"}, "'content_format' must be one of auto, string, openai"),
            ({"tokenizer": "/nowhere/tokenizer.json"}, r"must be a tokenizer\.json file"),
            ({"colour": "blue"}, "has no option 'colour'"),
        ],
    )
    def test_bad_options_are_config_errors(self, options: dict[str, Any], message: str) -> None:
        """A bad option value is a ConfigError saying what was expected and what was got."""
        with pytest.raises(ConfigError, match=message):
            kvroute.PluginManager().create_strategy("tokenizer-prefix", options)


class TestAffinity:
    def test_multi_turn_stays_on_one_backend(self, strategy: TokenizerPrefix) -> None:
        """Every turn of a conversation goes where its history is, while loads allow."""
        router = make_router(strategy)
        homes: dict[int, set[str]] = {c: set() for c in range(6)}
        for turn in range(4):
            for conv in range(6):
                with router.route(request(conversation_turn(conv, turn))) as lease:
                    homes[conv].add(lease.backend.id)
        assert all(len(h) == 1 for h in homes.values()), homes
        assert strategy.reasons["prefix"] >= 18

    def test_load_cost_lets_a_shared_system_prompt_split(self, model_dir: Path) -> None:
        """With load_cost_tokens, a conversation that only shares the system prompt goes to an idle backend."""
        strategy = TokenizerPrefix(tokenizer=str(model_dir), load_cost_tokens=256)
        router = make_router(strategy, 2)
        busy = [router.acquire(request(conversation_turn(0, 0))) for _ in range(3)]
        home = busy[0].backend.id
        other = router.acquire(request(conversation_turn(1, 0)))
        assert other.backend.id != home
        assert other.decision.detail["best_matched_tokens"] > 0

    def test_long_history_outweighs_small_load_differences(self, strategy: TokenizerPrefix) -> None:
        """A conversation with a long cached history stays home when its backend is only a little busier."""
        router = make_router(strategy, 2)
        with router.route(request(conversation_turn(0, 3))) as first:
            home = first.backend.id
        # One unrelated request in flight at home, none elsewhere.
        cold = [
            router.acquire(request(chat(f"unrelated {i} " * 50, system=f"other system {i} " * 40))) for i in range(6)
        ]
        loads = {s.id: s.in_flight for s in router.fleet}
        assert loads[home] >= 1
        lease = router.acquire(request(conversation_turn(0, 4)))
        assert lease.backend.id == home, (loads, lease.decision.explain())
        for lease_ in cold:
            router.release(lease_)

    def test_hot_system_prompt_never_exceeds_the_cap(self, model_dir: Path) -> None:
        """Requests that all share one hot prefix spread once its home is at the load_factor cap."""
        strategy = TokenizerPrefix(tokenizer=str(model_dir), min_capacity=0)
        router = make_router(strategy, 4)
        leases = [router.acquire(request(chat(f"question {i}"))) for i in range(40)]
        loads = sorted(s.in_flight for s in router.fleet)
        # ceil(1.25 * 40 / 4) = 13: no backend above the cap, spills counted.
        assert max(loads) <= 13 and sum(loads) == 40
        assert strategy.reasons["spilled"] > 0
        for lease in leases:
            router.release(lease)

    def test_min_capacity_is_a_floor_under_the_cap(self, model_dir: Path) -> None:
        """Below min_capacity requests in flight a backend is never full, so a warm prefix stays home that long."""
        strategy = TokenizerPrefix(tokenizer=str(model_dir), min_capacity=16, hot_window=0)
        router = make_router(strategy, 4)
        leases = [router.acquire(request(chat(f"question {i}"))) for i in range(40)]
        loads = sorted(s.in_flight for s in router.fleet)
        assert loads[-1] == 16 and sum(loads) == 40  # max(16, ceil(1.25 * 40 / 4) = 13)
        for lease in leases:
            router.release(lease)

    def test_cold_prompts_spread_by_their_first_blocks(self, strategy: TokenizerPrefix) -> None:
        """Prompts nobody has seen spread over the fleet by consistent hashing, not onto the first backend."""
        counts: Counter[str] = Counter()
        fleet = kvroute.Fleet([kvroute.Backend(f"b{i}") for i in range(4)])
        router = kvroute.Router(fleet, strategy)
        for i in range(400):
            decision, _ = router.decide(request(chat(f"q {i}", system=f"system prompt number {i} " * 10)))
            counts[decision.backend.id] += 1
            assert decision.reason == "cold"
        assert set(counts) == {"b0", "b1", "b2", "b3"}
        assert max(counts.values()) < 400 * 0.25 + 6 * (400 * 0.25 * 0.75) ** 0.5

    def test_replicas_agree_on_cold_prompts(self, model_dir: Path) -> None:
        """Two strategy instances over the same members place every cold prompt identically."""
        a = make_router(TokenizerPrefix(tokenizer=str(model_dir)))
        b = make_router(TokenizerPrefix(tokenizer=str(model_dir)))
        for i in range(50):
            r = request(chat(f"q {i}", system=f"sys {i} " * 30))
            assert a.decide(r)[0].backend.id == b.decide(r)[0].backend.id

    def test_lora_and_cache_salt_do_not_share_blocks(self, strategy: TokenizerPrefix) -> None:
        """The same prompt under another cache_salt or LoRA adapter matches nothing."""
        router = make_router(strategy)
        with router.route(request(chat("hello"))):
            pass
        salted = router.decide(request({**chat("hello"), "cache_salt": "tenant-b"}))[0]
        adapted = router.decide(request({**chat("hello"), "lora_adapter": "sql"}))[0]
        assert salted.detail["best_matched_tokens"] == 0 and adapted.detail["best_matched_tokens"] == 0
        assert router.decide(request(chat("hello")))[0].detail["best_matched_tokens"] > 0

    def test_token_prompts_match_their_text_twin(self, strategy: TokenizerPrefix) -> None:
        """A prompt sent as token ids matches the blocks of the same prompt sent as text."""
        router = make_router(strategy)
        text = "A long completion prompt about routing. " * 40
        with router.route(request({"model": "m", "prompt": text}, endpoint="completions")) as lease:
            home = lease.backend.id
        ids = prompt_ids(strategy.prompt_tokenizer, request({"model": "m", "prompt": text}, endpoint="completions"))
        decision = router.decide(request({"model": "m", "prompt": [*ids, 5, 6]}, endpoint="completions"))[0]
        assert decision.backend.id == home and decision.reason == "prefix"
        assert decision.detail["matched_tokens"] == len(ids) // 16 * 16

    def test_untokenizable_request_is_still_routed(self, strategy: TokenizerPrefix) -> None:
        """A chat the template rejects is placed by its text and says why."""
        router = make_router(strategy)
        decision = router.decide(request({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}))[0]
        assert decision.reason == "untokenizable" and "Unknown role" in decision.detail["error"]

    def test_max_prefix_tokens_bounds_hashing(self, model_dir: Path) -> None:
        """At most max_prefix_tokens tokens are hashed for a long prompt; past them, one hash per message."""
        strategy = TokenizerPrefix(tokenizer=str(model_dir), max_prefix_tokens=64)
        blocks = strategy.prompt_blocks(request(chat("x " * 5000)))
        assert len(blocks.complete()) == 4 + 2 and blocks.tokens_of(len(blocks.hashes)) == 64
        plain = TokenizerPrefix(tokenizer=str(model_dir), max_prefix_tokens=64, messages_past_cap=False)
        assert len(plain.prompt_blocks(request(chat("x " * 5000))).complete()) == 4

    def test_decision_explains_reuse(self, strategy: TokenizerPrefix) -> None:
        """Decisions carry matched and best-available tokens; stats add them up."""
        router = make_router(strategy)
        with router.route(request(conversation_turn(0, 0))):
            pass
        with router.route(request(conversation_turn(0, 1))) as lease:
            detail = lease.decision.detail
        assert detail["matched_tokens"] == detail["best_matched_tokens"] > 0
        stats = strategy.stats()
        assert stats["reuse_chosen_tokens"] == stats["reuse_available_tokens"] == detail["matched_tokens"]


class TestHotHeads:
    def test_conversations_under_a_hot_system_prompt_spread(self, strategy: TokenizerPrefix) -> None:
        """New conversations under a system prompt every request shares spread over the fleet, not onto its holder."""
        router = make_router(strategy)
        counts: Counter[str] = Counter()
        for conv in range(80):
            with router.route(request(conversation_turn(conv, 0))) as lease:
                counts[lease.backend.id] += 1
        assert set(counts) == {"b0", "b1", "b2", "b3"} and max(counts.values()) <= 40, counts
        assert strategy.stats()["hot_blocks"] > 0 and lease.decision.detail["hot_tokens"] > 0

    def test_a_conversation_stays_home_past_a_hot_head(self, strategy: TokenizerPrefix) -> None:
        """Once its system prompt is hot, a conversation's later turns still go where its history is."""
        router = make_router(strategy)
        for conv in range(20):
            with router.route(request(conversation_turn(conv, 0))):
                pass
        homes: dict[int, set[str]] = {}
        for turn in range(4):
            for conv in range(20, 26):
                with router.route(request(conversation_turn(conv, turn))) as lease:
                    homes.setdefault(conv, set()).add(lease.backend.id)
                    assert lease.decision.reason == ("cold" if turn == 0 else "prefix"), lease.decision.explain()
        assert all(len(h) == 1 for h in homes.values()), homes

    def test_a_prefix_below_one_backends_share_co_locates(self, strategy: TokenizerPrefix) -> None:
        """Eight system prompts taking turns on four backends are not hot: each keeps its requests on one backend."""
        router = make_router(strategy)
        homes: dict[int, set[str]] = {}
        for i in range(96):
            system = f"System prompt {i % 8} of this application. " * 10
            with router.route(request(chat(f"Question {i}?", system=system))) as lease:
                homes.setdefault(i % 8, set()).add(lease.backend.id)
        assert all(len(h) == 1 for h in homes.values()), homes
        # Only what all eight share (the template's start) is hot; each system prompt past it is matched.
        assert lease.decision.reason == "prefix"
        assert lease.decision.detail["matched_tokens"] > lease.decision.detail["hot_tokens"] + 100

    def test_cold_choices_take_the_least_used_of_the_keys_first(self, strategy: TokenizerPrefix) -> None:
        """With cold_choices, new prompts go to the least used of their key's first backends (recent starts)."""
        counts: dict[int, Counter[str]] = {}
        for choices in (1, 4):
            spread = TokenizerPrefix(tokenizer=strategy.prompt_tokenizer.name, cold_choices=choices)
            router = make_router(spread)
            counts[choices] = Counter()
            for i in range(16):
                body = {"model": "m", "prompt": f"Prompt {i} of its own, about {i * 17}. " * 12}
                with router.route(request(body, endpoint="completions")) as lease:
                    counts[choices][lease.backend.id] += 1
        assert sorted(counts[4].values()) == [4, 4, 4, 4], counts
        assert sorted(counts[1].values()) != [4, 4, 4, 4], counts  # the key's first backend, however many it had

    def test_cold_prompts_are_placed_without_the_min_capacity_floor(self, model_dir: Path) -> None:
        """Prompts nobody holds spread under load_factor's cap even below min_capacity: they have no hits to lose."""
        strategy = TokenizerPrefix(tokenizer=str(model_dir), min_capacity=16)
        router = make_router(strategy)
        prompts = [{"model": "m", "prompt": f"{i} is a prompt of its own. " * 10} for i in range(12)]
        leases = [router.acquire(request(body, endpoint="completions")) for body in prompts]
        assert {lease.decision.reason for lease in leases} <= {"cold", "spilled"}
        loads = [s.in_flight for s in router.fleet]
        assert max(loads) <= 4, loads  # ceil(1.25 * 12 / 4)
        for lease in leases:
            router.release(lease)


#: A preamble (tools and instructions) longer than the cap of the tests below: 96 words, the cap 64 tokens.
PREAMBLE = "Tool definitions and standing instructions for the agent. " * 12


def agent_turn(session: int, turn: int) -> dict[str, Any]:
    """Turn ``turn`` of an agent session under `PREAMBLE`: its task, then a tool call and its output per turn."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": PREAMBLE},
        {"role": "user", "content": f"Task {session}: fix bug {session * 7} in module {session % 5}."},
    ]
    for t in range(turn):
        messages.append({"role": "assistant", "content": f"Calling the tool, step {t} of session {session}."})
        messages.append({"role": "tool", "content": f"Tool output {t} of session {session}: " + "line " * 30})
    return {"model": "m", "messages": messages}


class TestPastTheCap:
    def test_message_hashes_extend_from_turn_to_turn(self) -> None:
        """Past the cap, a prompt's hashes are its blocks then one per message; a later turn starts with the earlier."""
        strategy = TokenizerPrefix(max_prefix_tokens=64, block_size=16)
        first = strategy.prompt_blocks(request(agent_turn(0, 1))).complete()
        second = strategy.prompt_blocks(request(agent_turn(0, 2))).complete()
        other = strategy.prompt_blocks(request(agent_turn(1, 1))).complete()
        assert len(first) == 4 + 4 and len(second) == 4 + 6
        assert second[: len(first)] == first
        assert other[:5] == first[:5] and other[5] != first[5]  # the same preamble message, another task

    def test_sessions_under_a_long_hot_preamble_spread_and_stay(self) -> None:
        """Sessions whose shared preamble is longer than the cap spread over the fleet, each turn going home."""
        strategy = TokenizerPrefix(max_prefix_tokens=64, block_size=16)
        router = make_router(strategy)
        homes: dict[int, set[str]] = {}
        for turn in range(4):
            for session in range(24):
                with router.route(request(agent_turn(session, turn))) as lease:
                    homes.setdefault(session, set()).add(lease.backend.id)
        assert strategy.stats()["hot_blocks"] >= 4
        used = Counter(next(iter(h)) for h in homes.values() if len(h) == 1)
        assert sum(used.values()) >= 20, homes  # the few parked on the preamble's home before it turned hot may move
        assert len(used) == 4 and max(used.values()) <= 12, used
        assert lease.decision.reason == "prefix" and lease.decision.detail["best_matched_messages"] >= 5

    def test_cold_key_past_the_cap_is_the_sessions_first_message(self) -> None:
        """Exact backends with no events and no grace: every turn is cold, and a session's key (so its home) stays."""
        strategy = TokenizerPrefix(max_prefix_tokens=64, block_size=16, recent_grace=0)
        router = make_router(strategy)
        for backend in ("b0", "b1", "b2", "b3"):
            strategy.index.set_exact(backend)
        for session in range(12):  # the preamble turns hot
            with router.route(request(agent_turn(100 + session, 0))):
                pass
        used = set()
        for session in range(12):
            homes = set()
            for turn in range(4):
                with router.route(request(agent_turn(session, turn))) as lease:
                    assert lease.decision.reason == "cold", lease.decision.explain()
                    homes.add(lease.backend.id)
            assert len(homes) == 1, (session, homes)
            used |= homes
        assert len(used) >= 3, used  # keyed by the session's task, not by the preamble

    def test_without_message_hashes_every_session_is_alike(self) -> None:
        """With messages_past_cap off the hashes end inside the preamble: later turns look alike, all go one way."""
        strategy = TokenizerPrefix(max_prefix_tokens=64, block_size=16, messages_past_cap=False)
        router = make_router(strategy)
        homes: dict[int, set[str]] = {}
        for turn in range(4):
            for session in range(24):
                with router.route(request(agent_turn(session, turn))) as lease:
                    homes.setdefault(session, set()).add(lease.backend.id)
        assert len({b for h in homes.values() for b in h}) == 1, homes


class TestBursts:
    def test_burst_co_locates_before_any_finishes(self, strategy: TokenizerPrefix) -> None:
        """Siblings sharing a new prefix, all in flight at once, land together while the cap allows."""
        strategy = TokenizerPrefix(tokenizer=strategy.prompt_tokenizer.name, load_factor=None, concurrency_threshold=8)
        router = make_router(strategy)
        doc = "A brand new document nobody has seen. " * 60
        leases = [router.acquire(request(chat(f"{doc} Question {i}?"))) for i in range(6)]
        assert len({lease.backend.id for lease in leases}) == 1

    def test_burst_co_locates_on_exact_backends(self, strategy: TokenizerPrefix) -> None:
        """With KV events (exact mode) siblings co-locate through recent decisions, before the engine reports."""
        strategy = TokenizerPrefix(tokenizer=strategy.prompt_tokenizer.name, load_factor=None, concurrency_threshold=8)
        router = make_router(strategy)
        for i in range(4):
            strategy.index.set_exact(f"b{i}")
        doc = "Another new document for a fan-out. " * 60
        leases = [router.acquire(request(chat(f"{doc} Sample {i}?"))) for i in range(5)]
        assert len({lease.backend.id for lease in leases}) == 1
        assert len(strategy.index) == 0 and len(strategy.recent) == 5
        for lease in leases:
            router.release(lease)
        assert len(strategy.recent) == 5  # kept for the grace after finishing: no event covered them

    def test_no_grace_forgets_at_finish(self, strategy: TokenizerPrefix) -> None:
        """With recent_grace 0 a finished request's recent decision is forgotten at once."""
        strategy = TokenizerPrefix(tokenizer=strategy.prompt_tokenizer.name, recent_grace=0)
        router = make_router(strategy)
        strategy.index.set_exact("b0")
        with router.route(request(chat("A question for one backend. " * 40))):
            pass
        assert len(strategy.recent) == 0

    def test_siblings_after_finish_land_together_before_events(self, strategy: TokenizerPrefix) -> None:
        """8 siblings sent back to back, each done before the next and before any KV event, land on one backend."""
        strategy = TokenizerPrefix(tokenizer=strategy.prompt_tokenizer.name)
        router = make_router(strategy, 7)
        for i in range(7):
            strategy.index.set_exact(f"b{i}")
        # A short new shared head (about two blocks), then each sibling's own text: their cold keys all differ.
        head = "Parallel tool calls for the failing build, step three:"
        homes = []
        for i in range(8):
            own = f"call {i} reads file number {i * 7919} " * 20
            with router.route(request(chat(head + own, system="Agent."))) as lease:
                homes.append(lease.backend.id)
        assert len(set(homes)) == 1, homes
        assert strategy.stats()["recent_kept_after_finish"] == 8

    def test_events_covering_a_finished_request_end_its_grace(self, strategy: TokenizerPrefix) -> None:
        """A finished request whose blocks the engine reported is forgotten at once (the index holds them)."""
        strategy = TokenizerPrefix(tokenizer=strategy.prompt_tokenizer.name)
        router = make_router(strategy, 2)
        strategy.index.set_exact("b0")
        strategy.index.set_exact("b1")
        body = chat("What does the document say?")
        ids = prompt_ids(strategy.prompt_tokenizer, request(body))
        with router.route(request(body)) as lease:
            strategy.index.blocks_stored(lease.backend.id, ids, block_size=16)
        assert len(strategy.recent) == 0

    def test_kv_events_feed_exact_matches(self, strategy: TokenizerPrefix) -> None:
        """Blocks reported by an engine's KV events attract requests with that prefix."""
        router = make_router(strategy)
        body = chat("What does the document say?")
        ids = prompt_ids(strategy.prompt_tokenizer, request(body))
        strategy.index.set_exact("b2")
        strategy.index.blocks_stored("b2", ids, block_size=16, engine_hashes=None)
        decision = router.decide(request(body))[0]
        assert decision.backend.id == "b2" and decision.detail["matched_tokens"] == len(ids) // 16 * 16
        assert strategy.index.match(block_hashes(ids, 16), ["b2"]) == {"b2": len(ids) // 16}


@attrs.define
class EagerTokenizerPrefix(TokenizerPrefix):
    """The reference: records every block of a prompt when it is sent (no pending tails)."""

    def on_request_start(self, request: kvroute.RouteRequest, decision: kvroute.Decision) -> None:
        picked = self._pending.get(request.request_id)
        if picked is not None:
            picked[0].complete()
        super().on_request_start(request, decision)


def document(n: int, words: int = 120) -> str:
    """Document ``n``: documents share their first sentences in pairs, then differ."""
    shared = " ".join(f"Shared part {n // 2} sentence {i}." for i in range(words // 8))
    return shared + " " + " ".join(f"Own part {n} says {i}." for i in range(words // 4))


class TestLazyRecording:
    def test_first_sighting_records_only_what_pick_hashed(self, strategy: TokenizerPrefix) -> None:
        """Sending a new long prompt records the blocks the decision needed and keeps the rest pending."""
        router = make_router(strategy)
        body = chat(document(0) + " Question?")
        with router.route(request(body)) as lease:
            home = lease.backend.id
        total = len(prompt_ids(strategy.prompt_tokenizer, request(body))) // 16
        assert 0 < strategy.index.blocks(home) < total // 2
        assert strategy.stats()["pending_tails"] == 1

    def test_second_sighting_matches_every_shared_block(self, model_dir: Path) -> None:
        """A request sharing a pending prompt's prefix matches all the blocks they share, as if all had been
        recorded."""
        strategy = TokenizerPrefix(tokenizer=str(model_dir), prefetch=False)
        router = make_router(strategy)
        first, second = chat(document(0) + " First question?"), chat(document(0) + " Another one?")
        with router.route(request(first)) as lease:
            home = lease.backend.id
        tok = strategy.prompt_tokenizer
        a, b = block_hashes(prompt_ids(tok, request(first)), 16), block_hashes(prompt_ids(tok, request(second)), 16)
        shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        decision = router.decide(request(second))[0]
        assert decision.backend.id == home and decision.detail["matched_tokens"] == shared * 16 > 1000
        assert strategy.stats()["tails_extended"] == 1

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(
        ops=st.lists(
            st.tuples(st.integers(0, 5), st.integers(0, 2), st.booleans(), st.integers(0, 2)), min_size=1, max_size=24
        ),
        fine=st.integers(4, 64),
    )
    def test_lazy_recording_decides_like_eager_recording(
        self, model_dir: Path, ops: list[tuple[int, int, bool, int]], fine: int
    ) -> None:
        """Decisions and matched tokens equal those of recording every block at once, prefetch or not."""
        options = {"tokenizer": str(model_dir), "piece_bytes": 64, "fine_bytes": fine, "load_cost_tokens": 64}
        lazy = make_router(TokenizerPrefix(**options), 3)
        eager = make_router(EagerTokenizerPrefix(**options, prefetch=False), 3)
        held: list[tuple[kvroute.Lease, kvroute.Lease]] = []
        for n, (doc, question, release, depth) in enumerate(ops):
            body = chat(document(doc) + f" Question {question}?", *[f"Turn {t} of {doc}." for t in range(depth)])
            a = lazy.acquire(request(body, request_id=f"r{n}"))
            b = eager.acquire(request(body, request_id=f"r{n}"))
            assert (a.backend.id, a.decision.detail["matched_tokens"]) == (
                b.backend.id,
                b.decision.detail["matched_tokens"],
            )
            assert a.decision.detail["best_matched_tokens"] == b.decision.detail["best_matched_tokens"]
            held.append((a, b))
            if release:
                x, y = held.pop(0)
                lazy.release(x)
                eager.release(y)

    @settings(max_examples=60, deadline=None)
    @given(
        sent=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 3)), max_size=12),
        query=st.tuples(st.integers(0, 5), st.integers(0, 3)),
        capacity=st.integers(4, 400),
    )
    def test_bisection_counts_like_a_full_walk(
        self, sent: list[tuple[int, int, int]], query: tuple[int, int], capacity: int
    ) -> None:
        """On the router's own (prefix-closed) records, the bisecting match equals looking up every block."""
        strategy = TokenizerPrefix(block_size=4, capacity_blocks=capacity, prefetch=False)
        router = make_router(strategy, 4)
        cands = list(router.fleet.candidates("m"))

        def text(doc: int, turns: int) -> dict[str, Any]:
            return chat(
                f"doc {doc} " + "word " * 30,
                *[f"turn {t} of {doc} " + "more " * 10 for t in range(turns)],
                system="sys",
            )

        for backend, doc, turns in sent:
            strategy.index.record(f"b{backend}", strategy.prompt_blocks(request(text(doc, turns))).complete())
        blocks = strategy.prompt_blocks(request(text(*query)))
        matched, _ = strategy._match(blocks, [s.id for s in cands])
        expected = strategy.index.match(blocks.complete(), [s.id for s in cands])
        assert matched == [expected[s.id] for s in cands]

    def test_prefetched_second_sighting_tokenizes_almost_nothing(self, model_dir: Path) -> None:
        """Once the prefetch thread has hashed a pending prompt, a request sharing it needs no tokenization for the
        shared part."""
        strategy = TokenizerPrefix(tokenizer=str(model_dir))
        router = make_router(strategy)
        with router.route(request(chat(document(1, 600) + " First question?"))):
            pass
        assert strategy.wait_prefetched(timeout=30)
        assert strategy.stats()["prefetched_pieces"] >= 2
        tok: Any = strategy.prompt_tokenizer
        misses = tok.misses
        decision = router.decide(request(chat(document(1, 600) + " Second question?")))[0]
        assert decision.detail["matched_tokens"] > 3000
        assert tok.misses - misses <= 3  # the pieces where the two questions differ

    def test_a_little_text_left_is_hashed_at_once_with_words(self) -> None:
        """With the word-level tokenizer a prompt with little left to hash is recorded whole, a long one stays
        pending."""
        strategy = TokenizerPrefix()
        router = make_router(strategy)
        with router.route(request(chat("a short question", system="a short system prompt"))):
            pass
        assert strategy.stats()["pending_tails"] == 0
        with router.route(request(chat("question", system="word " * 3000))):
            pass
        assert strategy.stats()["pending_tails"] == 1

    def test_exact_backend_tails_end_with_their_request(self, strategy: TokenizerPrefix) -> None:
        """A pending tail sent to an exact-mode backend feeds its recent decision and goes when the request ends."""
        router = make_router(strategy)
        for i in range(4):
            strategy.index.set_exact(f"b{i}")
        lease = router.acquire(request(chat(document(2) + " Question?")))
        assert strategy.stats()["pending_tails"] == 1 and len(strategy.index) == 0
        sibling = router.acquire(request(chat(document(2) + " Other question?")))
        assert sibling.backend.id == lease.backend.id and sibling.decision.detail["matched_tokens"] > 1000
        router.release(lease)
        router.release(sibling)
        assert strategy.stats()["pending_tails"] == 0 and len(strategy.recent) == 2  # kept for the grace

    def test_removed_backend_drops_its_tails(self, strategy: TokenizerPrefix) -> None:
        """Removing a backend forgets the pending tails sent to it."""
        router = make_router(strategy)
        with router.route(request(chat(document(3) + " Question?"))) as lease:
            home = lease.backend.id
        router.fleet.remove(home)
        assert strategy.stats()["pending_tails"] == 0

    def test_pending_tails_are_bounded(self, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """At most MAX_TAILS prompts (and MAX_TAIL_BYTES of their text) stay pending; the oldest go first."""
        import kvroute_tokenizer_prefix.tails as module

        monkeypatch.setattr(module, "MAX_TAILS", 5)
        strategy = TokenizerPrefix(tokenizer=str(model_dir), prefetch=False)
        router = make_router(strategy)
        for i in range(12):
            with router.route(request(chat(document(10 + i)))):
                pass
        assert strategy.stats()["pending_tails"] == 5
        monkeypatch.setattr(module, "MAX_TAIL_BYTES", 1)
        with router.route(request(chat(document(40)))):
            pass
        assert strategy.stats()["pending_tails"] == 0 and strategy.stats()["pending_tail_bytes"] == 0


class TestFleetAndBlockSize:
    def test_removed_backend_is_forgotten(self, strategy: TokenizerPrefix) -> None:
        """A backend removed from the fleet loses its index entries."""
        router = make_router(strategy)
        with router.route(request(chat("remember me"))) as lease:
            home = lease.backend.id
        assert strategy.index.blocks(home) > 0
        router.fleet.remove(home)
        assert strategy.index.blocks(home) == 0

    def test_block_size_follows_the_adapter(self, strategy: TokenizerPrefix) -> None:
        """Without a block_size option, the engine's reported block size is adopted and the index restarts."""
        router = make_router(strategy)
        with router.route(request(chat("before"))):
            pass
        router.fleet.update_load("b0", kvroute.EngineLoad(block_size=128))
        router.decide(request(chat("after")))
        assert strategy.current_block_size == 128 and len(strategy.index) == 0

    def test_block_size_option_wins(self, model_dir: Path) -> None:
        """An explicit block_size ignores what adapters report."""
        strategy = TokenizerPrefix(tokenizer=str(model_dir), block_size=32)
        router = make_router(strategy)
        router.fleet.update_load("b0", kvroute.EngineLoad(block_size=128))
        router.decide(request(chat("x")))
        assert strategy.current_block_size == 32


@functools.cache
def _shared_model_dir() -> str:
    """A fixture model for class-level configuration (conformance, state machine), built once per process."""
    from conftest import train, write_model

    return str(write_model(Path(tempfile.mkdtemp(prefix="kvroute-tp-")) / "model", train("llama3", vocab_size=600)))


def _with_model(**options: Any) -> TokenizerPrefix:
    return TokenizerPrefix(tokenizer=_shared_model_dir(), **options)


class TestConformanceWords(StrategyConformance):
    strategy = "tokenizer-prefix"
    deterministic = True


class TestConformanceModel(StrategyConformance):
    strategy = "tokenizer-prefix"
    factory = staticmethod(_with_model)
    deterministic = True


TestScalingWords = ScalingStateMachine.for_strategy(
    "tokenizer-prefix", claims=Claims(load_factor=1.25, min_capacity=16), max_examples=8, steps=20, keys=400
).TestCase
TestScalingSmallBlocks = ScalingStateMachine.for_strategy(
    "tokenizer-prefix",
    {"block_size": 2, "key_blocks": 1, "load_factor": 2.0, "min_capacity": 0},
    claims=Claims(load_factor=2.0),
    max_examples=8,
    steps=20,
    keys=400,
).TestCase


def dp_router(strategy: TokenizerPrefix, sizes: list[int]) -> kvroute.Router:
    """A router over backends b0, b1... with the given data-parallel sizes."""
    backends = [kvroute.Backend(f"b{i}", data_parallel_size=n) for i, n in enumerate(sizes)]
    return kvroute.Router(kvroute.Fleet(backends), strategy, strategy_name="tokenizer-prefix")


class TestDataParallelRanks:
    def test_events_on_a_rank_draw_requests_to_that_rank(self, strategy: TokenizerPrefix) -> None:
        """Blocks reported on rank 2 of a 4-rank backend send the prompt to that backend and rank, explained."""
        router = dp_router(strategy, [4, 4])
        body = chat("What does the document say about ranks?")
        ids = prompt_ids(strategy.prompt_tokenizer, request(body))
        strategy.index.set_exact("b1")
        strategy.index.blocks_stored("b1", ids, block_size=16, rank=2)
        decision = router.decide(request(body))[0]
        assert (decision.backend.id, decision.data_parallel_rank) == ("b1", 2)
        assert decision.detail["matched_tokens"] == len(ids) // 16 * 16
        assert "b1 rank 2" in decision.explain()

    def test_no_rank_without_data_parallelism(self, strategy: TokenizerPrefix) -> None:
        """Backends of one rank get decisions naming no rank."""
        router = dp_router(strategy, [1, 1])
        with router.route(request(chat("Plain question?"))) as lease:
            assert lease.decision.data_parallel_rank is None

    def test_siblings_share_backend_and_rank(self, strategy: TokenizerPrefix) -> None:
        """Approximate mode: siblings of a new prompt land on one backend and one rank, its own records per rank."""
        router = dp_router(strategy, [4, 4, 4])
        doc = "A brand new document for a data-parallel fleet. " * 40
        leases = [router.acquire(request(chat(f"{doc} Question {i}?"))) for i in range(8)]
        assert len({(lease.backend.id, lease.decision.data_parallel_rank) for lease in leases}) == 1
        rank = leases[0].decision.data_parallel_rank
        assert rank is not None and strategy.stats()["rank_decisions"] == {str(rank): 8}
        for lease in leases:
            router.release(lease)

    def test_cold_prompts_spread_over_ranks(self, strategy: TokenizerPrefix) -> None:
        """Different new prompts to one data-parallel backend use several of its ranks (the key's rank order)."""
        router = dp_router(strategy, [4])
        ranks = set()
        for i in range(24):
            with router.route(request(chat(f"Unrelated topic number {i * 7}: " + f"word{i} " * 80))) as lease:
                ranks.add(lease.decision.data_parallel_rank)
        assert len(ranks) >= 3

    def test_new_prompts_spread_evenly_over_ranks(self, strategy: TokenizerPrefix) -> None:
        """New documents go to the rank that started fewest of the recent requests; their questions follow them."""
        router = dp_router(strategy, [4])
        docs = [f"Document {i} about subject {i * 13}: " + f"term{i} fact{i * 3} " * 40 for i in range(16)]

        def ask(doc: str, question: str) -> dict[str, Any]:
            return {"model": "m", "messages": [{"role": "user", "content": f"{doc} {question}"}]}

        homes: dict[int, int | None] = {}
        for i, doc in enumerate(docs):
            with router.route(request(ask(doc, "First question?"))) as lease:
                homes[i] = lease.decision.data_parallel_rank
        assert sorted(Counter(homes.values()).items()) == [(0, 4), (1, 4), (2, 4), (3, 4)], homes
        for i, doc in enumerate(docs):
            with router.route(request(ask(doc, "Second question?"))) as lease:
                assert lease.decision.data_parallel_rank == homes[i], lease.decision.explain()

    def test_busy_rank_passed_over(self, strategy: TokenizerPrefix) -> None:
        """A rank the engine reports far busier than the others does not get the prompt it holds."""
        from kvroute.backend import RankLoad

        router = dp_router(strategy, [2])
        body = chat("What does the document say about busy ranks?")
        ids = prompt_ids(strategy.prompt_tokenizer, request(body))
        strategy.index.set_exact("b0")
        strategy.index.blocks_stored("b0", ids, block_size=16, rank=1)
        loads = (RankLoad(0, running=0), RankLoad(1, running=40))
        router.fleet.update_load("b0", kvroute.EngineLoad(ranks=loads))
        assert router.decide(request(body))[0].data_parallel_rank == 0
        router.fleet.update_load("b0", kvroute.EngineLoad(ranks=(RankLoad(0, running=3), RankLoad(1, running=3))))
        assert router.decide(request(body))[0].data_parallel_rank == 1


class TestTierCredit:
    def _setup(self, strategy: TokenizerPrefix) -> tuple[kvroute.Router, dict[str, Any], list[int]]:
        router = make_router(strategy, 2)
        body = chat("Explain the offloaded document in detail. " + "tiered words " * 120)
        ids = prompt_ids(strategy.prompt_tokenizer, request(body))
        full = len(ids) // 16
        for b in ("b0", "b1"):
            strategy.index.set_exact(b)
        strategy.index.blocks_stored("b0", ids[: full * 16], block_size=16, medium="CPU")
        strategy.index.blocks_stored("b1", ids[: (full * 6 // 10) * 16], block_size=16)
        return router, body, ids

    def test_cpu_hit_credited_at_its_fraction(self, model_dir: Path) -> None:
        """A whole prompt on CPU (0.85 by default) beats 60 % of it on GPU; with cpu_credit 0.5 the GPU backend wins."""
        strategy = TokenizerPrefix(tokenizer=str(model_dir), hot_window=0)
        router, body, _ = self._setup(strategy)
        decision = router.decide(request(body))[0]
        assert decision.backend.id == "b0" and set(decision.detail["tier_tokens"]) == {"CPU"}
        assert strategy.stats()["tier_hit_tokens"]["CPU"] == decision.detail["matched_tokens"]
        low = TokenizerPrefix(tokenizer=str(model_dir), hot_window=0, cpu_credit=0.5)
        router, body, _ = self._setup(low)
        assert router.decide(request(body))[0].backend.id == "b1"

    def test_gpu_hits_counted_per_tier(self, strategy: TokenizerPrefix) -> None:
        """Without slower tiers the chosen match counts as GPU tokens in the stats."""
        router = make_router(strategy, 2)
        body = chat("What does the GPU hold?")
        ids = prompt_ids(strategy.prompt_tokenizer, request(body))
        strategy.index.set_exact("b1")
        strategy.index.blocks_stored("b1", ids, block_size=16)
        decision = router.decide(request(body))[0]
        assert strategy.stats()["tier_hit_tokens"] == {"GPU": decision.detail["matched_tokens"]}


class TestDataParallelRemoval:
    def test_removed_backend_forgets_every_rank(self, strategy: TokenizerPrefix) -> None:
        """Removing a data-parallel backend drops its ranks' blocks, recent decisions and pending tails."""
        router = dp_router(strategy, [2, 1])
        for b in ("b0", "b1"):
            strategy.index.set_exact(b)
        body = chat(document(5) + " Question?")
        ids = prompt_ids(strategy.prompt_tokenizer, request(body))
        strategy.index.blocks_stored("b0", ids[:64], block_size=16, rank=1)  # draws the prompt to rank 1
        leases = [router.acquire(request(chat(document(5) + f" Question {i}?"))) for i in range(3)]
        assert all(lease.decision.data_parallel_rank == 1 for lease in leases)
        for lease in leases:
            router.release(lease)
        assert len(strategy.recent) == 3  # kept for the grace, in rank 1's slot
        router.fleet.remove("b0")
        router.fleet.remove("b1")
        assert len(strategy.recent) == 0 and strategy.stats()["pending_tails"] == 0
        assert strategy.index.slots_of("b0") == ["b0"]


class TestRankOfOtherDecisions:
    def test_keyed_decision_without_rank_records_where_the_host_sends_it(self, strategy: TokenizerPrefix) -> None:
        """A decision naming no rank (a session's binding) is recorded in the rank the proxy derives from its key."""
        from kvroute.ranks import rank_for

        router = dp_router(strategy, [4])
        state = router.fleet.get("b0")
        body = request(chat("A session's turn on a data-parallel backend. " * 20))
        decision = kvroute.Decision(state.backend, reason="session", key=12345)
        strategy.pick(body, [state])
        strategy.on_request_start(body, decision)
        rank = rank_for(decision, state)
        assert rank is not None and rank > 0
        slot = strategy.index.slot("b0", rank)
        assert strategy.index.blocks(slot) > 0 and strategy.index.blocks("b0") == 0


class TestSessionsWithTokenizerPrefix:
    def test_new_session_placed_by_its_key_and_moved_by_the_load_bound(self) -> None:
        """A new session goes to its id's rendezvous home (as bounded-load's); at the concurrency threshold it moves."""
        from kvroute import Backend, Fleet, Router, RouteRequest, Sessions

        backends = [Backend(f"b{i}") for i in range(5)]
        tp = Router.create(Fleet(backends), "tokenizer-prefix", {"concurrency_threshold": 1}, sessions=Sessions())
        bl = Router.create(Fleet(backends), "bounded-load", {}, sessions=Sessions())
        body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
        for name in ("a", "b", "c", "d"):
            request = RouteRequest.from_openai(body, headers={"x-session-id": name})
            assert tp.decide(request)[0].backend.id == bl.decide(request)[0].backend.id
        request = RouteRequest.from_openai(body, headers={"x-session-id": "a"})
        with tp.route(request) as first, tp.route(request) as second:
            assert second.backend.id != first.backend.id
            assert second.decision.detail["move_reason"] == "concurrency_threshold"


def family_opener(family: int, conv: int) -> dict[str, Any]:
    """A conversation's first turn under one of a few short system prompts (``multi-turn-short``'s shape)."""
    system = f"System prompt of application {family}: answer politely and briefly. " * 6
    return chat(f"Conversation {conv} asks about topic {conv * 31} today.", system=system)


class TestShares:
    def run(self, strategy: TokenizerPrefix, count: int = 8, requests: int = 900) -> Counter[str]:
        """Openers of 6 families (of unequal sizes) on ``count`` backends; requests per backend over the last 400."""
        router = make_router(strategy, count)
        counts: Counter[str] = Counter()
        for i in range(requests):
            family = min(i % 10, 5)  # family 5 gets 5 of every 10 conversations
            with router.route(request(family_opener(family, i))) as lease:
                if i >= requests - 400:
                    counts[lease.backend.id] += 1
        return counts

    def test_new_conversations_leave_a_short_prefixs_busy_holder(self) -> None:
        """Openers under short system prompts spread within the share bound; without it each family stays home."""
        counts = self.run(TokenizerPrefix(block_size=16))
        assert len(counts) == 8 and max(counts.values()) <= 1.25 * 400 / 8 and min(counts.values()) >= 0.6 * 400 / 8
        before = self.run(TokenizerPrefix(block_size=16, share_factor=None))
        assert min(before.values()) <= 0.5 * 400 / 8, before  # the backends no family's home is

    def test_later_turns_stay_with_their_history(self) -> None:
        """The share bound moves conversation openers only: a later turn follows its history, over share or not."""
        strategy = TokenizerPrefix(block_size=16)
        router = make_router(strategy, 4)
        for i in range(300):
            with router.route(request(family_opener(0, i))):
                pass
        system = family_opener(0, 0)["messages"][0]["content"]
        homes: dict[int, set[str]] = {}
        for turn in range(3):
            for conv in range(8):
                turns = []  # a first question long enough to fill blocks of its own, then answers and questions
                for t in range(turn + 1):
                    turns.append(f"Conversation {conv} question {t}: " + f"tell me about topic {conv}. " * 8)
                    if t < turn:
                        turns.append(f"Answer {t} for conversation {conv}: " + "some words " * 20)
                with router.route(request(chat(*turns, system=system))) as lease:
                    homes.setdefault(conv, set()).add(lease.backend.id)
        assert all(len(h) == 1 for h in homes.values()), homes
        assert len({h for hs in homes.values() for h in hs}) > 1  # the openers did leave the busy holder

    def test_an_adopted_hold_places_a_cold_prompt(self) -> None:
        """A key another replica holds sends that prompt where the other replica sent it (router-replica sync)."""
        a, b = make_router(TokenizerPrefix(block_size=16)), make_router(TokenizerPrefix(block_size=16))
        body = {"model": "m", "prompt": "A prompt of its own about routing keys. " * 10}
        with a.route(request(body, endpoint="completions")) as lease:
            holds = a.strategy.holds_made(lease.request, lease.decision)  # type: ignore[attr-defined]
            home = lease.backend.id
        assert [(h.kind, h.backend_id) for h in holds] == [("key", home)]
        other = next(s.id for s in b.fleet if s.id != home)
        moved = [kvroute.Hold("key", holds[0].key, other)]
        assert b.strategy.adopt_holds(moved) == {"adopted": 1, "held": 0, "counted": 1}  # type: ignore[attr-defined]
        decision = b.decide(request(body, endpoint="completions"))[0]
        assert decision.backend.id == other and decision.reason == "cold" and decision.detail["held"] == other

    def test_each_request_is_one_counted_hold_with_sessions(self) -> None:
        """With the session table on, every request gives the other replicas exactly one hold they count as a start
        (a session's binding or the strategy's key, never both), so a peer's window counts each request once."""
        from kvroute.holds import HoldLog
        from kvroute.sessions import Sessions

        log = HoldLog()
        fleet = kvroute.Fleet([kvroute.Backend(f"b{i}") for i in range(4)])
        router = kvroute.Router(
            fleet, TokenizerPrefix(block_size=16), strategy_name="tokenizer-prefix", sessions=Sessions(), holds=log
        )
        made: list[list[str]] = []
        for conv in range(6):
            for turn in range(3):
                body = conversation_turn(conv, turn)
                req = attrs.evolve(request(body), session_id=f"s{conv}" if conv % 2 else None)
                with router.route(req):
                    pass
                made.append([hold.kind for hold in log.drain() if hold.kind != "group"])
        assert all(len(kinds) == 1 for kinds in made), made
        assert {kinds[0] for kinds in made} == {"key", "session"}  # both kinds of request were made

    def test_other_replicas_starts_count_towards_the_share(self) -> None:
        """Requests another replica started (its holds) fill a backend's share here, so new prompts go elsewhere."""
        bodies = [{"model": "m", "prompt": f"Prompt {i} of its own, about {i * 17}. " * 12} for i in range(40)]
        fresh = make_router(TokenizerPrefix(block_size=16))
        homes = [fresh.decide(request(body, endpoint="completions"))[0].backend.id for body in bodies]
        b = make_router(TokenizerPrefix(block_size=16))
        b.strategy.adopt_holds([kvroute.Hold("key", k, "b0") for k in range(300)])  # type: ignore[attr-defined]
        after = [b.decide(request(body, endpoint="completions"))[0].backend.id for body in bodies]
        assert "b0" in homes and "b0" not in after
        assert [x for x, y in zip(homes, after, strict=True) if x != "b0"] == [
            y for x, y in zip(homes, after, strict=True) if x != "b0"
        ]
