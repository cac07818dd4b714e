"""The simulator's workloads: determinism, text consistent with tokens, nesting turns, trace parsing."""

from __future__ import annotations

import collections
import itertools
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

from kvroute import ConfigError, RouteRequest
from kvroute.keys import DEFAULT_PREFIX_LENGTH
from kvroute.request import render_messages
from kvroute_simulator.tokens import vocabulary
from kvroute_simulator.workloads import (
    WORKLOADS,
    Agentic,
    Arrival,
    HotPrefix,
    LongPrefix,
    MultiTurn,
    MultiTurnShort,
    Rag,
    ShortPrefix,
    Trace,
    TraceFormatError,
    make_workload,
)

FIXTURES = Path(__file__).parent / "fixtures"


def snapshot(arrivals: list[Arrival]) -> list[tuple[Any, ...]]:
    """Everything observable about a stream of arrivals, for equality checks."""
    return [
        (a.time, a.request_id, a.body, a.prompt.to_tuple(), a.output_len, a.output_tokens, a.follows, a.think_time)
        for a in arrivals
    ]


def prompt_tokens_of(arrival: Arrival) -> tuple[int, ...]:
    """The tokens the body's text stands for, under the simulator's vocabulary."""
    vocab = vocabulary()
    if arrival.endpoint == "chat":
        return vocab.render_chat(arrival.body["messages"])
    return vocab.encode(arrival.body["prompt"])


SMALL = {
    "long-prefix": {"groups": 5, "prefix_tokens": 300, "requests": 40},
    "hot-prefix": {"groups": 5, "prefix_tokens": 300, "requests": 40},
    "short-prefix": {"groups": 5, "requests": 40},
    "multi-turn": {"system_tokens": 50, "requests": 40, "rate": 2.0},
    "multi-turn-short": {"requests": 40},
    "rag": {"documents": 30, "doc_tokens": (20, 80), "requests": 40},
    "agentic": {"preamble_tokens": 700, "tool_tokens": (20, 200), "requests": 40, "rate": 1.0, "fanout_share": 0.3},
}


class TestGeneratedWorkloads:
    @pytest.mark.parametrize("name", sorted(SMALL))
    def test_same_seed_same_arrivals(self, name: str) -> None:
        """Two runs with the same parameters and seed produce identical arrivals."""
        first = snapshot(list(make_workload(name, seed=7, **SMALL[name]).arrivals()))
        again = snapshot(list(make_workload(name, seed=7, **SMALL[name]).arrivals()))
        assert first == again
        assert len(first) == 40

    @pytest.mark.parametrize("name", sorted(SMALL))
    def test_other_seed_other_arrivals(self, name: str) -> None:
        """A different seed changes the arrivals."""
        first = snapshot(list(make_workload(name, seed=7, **SMALL[name]).arrivals()))
        other = snapshot(list(make_workload(name, seed=8, **SMALL[name]).arrivals()))
        assert first != other

    @pytest.mark.parametrize("name", sorted(SMALL))
    def test_tokens_match_the_body_text(self, name: str) -> None:
        """Each arrival's token ids are exactly what its request body's text renders to."""
        for arrival in make_workload(name, **SMALL[name]).arrivals():
            assert arrival.prompt.to_tuple() == prompt_tokens_of(arrival)
            assert arrival.body["max_tokens"] == arrival.output_len

    @pytest.mark.parametrize("name", sorted(SMALL))
    def test_bodies_are_routable(self, name: str) -> None:
        """Every body parses as an OpenAI request for the router, with the text it carries."""
        for arrival in make_workload(name, **SMALL[name]).arrivals():
            route = RouteRequest.from_openai(arrival.body, endpoint=arrival.endpoint)
            assert route.text == render_messages(arrival.body["messages"])

    @pytest.mark.parametrize("name", sorted(SMALL))
    def test_arrivals_come_in_time_order(self, name: str) -> None:
        """Arrival times never decrease."""
        times = [a.time for a in make_workload(name, **SMALL[name]).arrivals()]
        assert times == sorted(times)

    def test_duration_ends_the_stream(self) -> None:
        """With a duration and no request count, no arrival is later than the duration."""
        arrivals = list(LongPrefix(requests=None, duration=30.0, rate=5.0, groups=3, prefix_tokens=50).arrivals())
        assert arrivals and max(a.time for a in arrivals) <= 30.0
        assert 100 < len(arrivals) < 200

    def test_a_workload_needs_an_end(self) -> None:
        """A workload without requests or duration is refused."""
        with pytest.raises(ConfigError, match="'requests' or 'duration'"):
            LongPrefix(requests=None, duration=None)

    def test_length_ranges_are_validated(self) -> None:
        """A length range must have 1 <= lo <= hi."""
        with pytest.raises(ConfigError, match=r"'question_tokens' must be a number of tokens N or a range LO..HI"):
            LongPrefix(question_tokens=(0, 5))

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"rate": "fast"}, r"'rate' must be a positive number \(got 'fast'\)"),
            ({"groups": 2.5}, r"'groups' must be a positive integer \(got 2.5\)"),
            ({"requests": True}, r"'requests' must be a positive integer \(got True\)"),
            ({"question_tokens": "many"}, r"'question_tokens' must be a number of tokens N or a range"),
            ({"seed": "x"}, r"'seed' must be an integer \(got 'x'\)"),
        ],
    )
    def test_options_of_the_wrong_type_are_config_errors(self, options: dict[str, object], message: str) -> None:
        """An option of the wrong type is refused with its name and value, not a TypeError deep inside."""
        with pytest.raises(ConfigError, match=message):
            LongPrefix(**options)  # type: ignore[arg-type]


class TestLongPrefix:
    def test_groups_share_one_prefix_object(self) -> None:
        """Requests of a group share the very same prefix node and system text, with unique questions."""
        arrivals = list(LongPrefix(groups=3, prefix_tokens=8000, requests=30).arrivals())
        by_group = collections.defaultdict(list)
        for a in arrivals:
            by_group[a.session_id].append(a)
        for members in by_group.values():
            prefixes = {id(a.prompt.parent) for a in members}
            texts = {id(a.body["messages"][0]["content"]) for a in members}
            assert len(prefixes) == 1 and len(texts) == 1
            assert len({a.prompt.tail for a in members}) == len(members)
        assert all(len(a.prompt.parent or a.prompt) == 8002 for a in arrivals)  # <|system|> + 8,000 + <|end|>

    def test_poisson_arrivals_at_the_rate(self) -> None:
        """Inter-arrival times average 1/rate."""
        arrivals = list(LongPrefix(rate=7.0, requests=2000, groups=10, prefix_tokens=20).arrivals())
        gaps = [b.time - a.time for a, b in itertools.pairwise(arrivals)]
        assert statistics.mean(gaps) == pytest.approx(1 / 7.0, rel=0.08)


class TestHotPrefix:
    def test_hot_prefix_takes_its_share(self) -> None:
        """Prefix 0 takes about hot_share of the requests; the others split the rest."""
        arrivals = list(HotPrefix(hot_share=0.5, groups=11, prefix_tokens=20, requests=2000).arrivals())
        counts = collections.Counter(a.session_id for a in arrivals)
        assert counts["group-0"] / 2000 == pytest.approx(0.5, abs=0.04)
        assert max(n for g, n in counts.items() if g != "group-0") < 200


class TestMultiTurn:
    def arrivals(self) -> list[Arrival]:
        return list(MultiTurn(system_tokens=50, requests=200, rate=1.0, mean_turns=4).arrivals())

    def test_turns_nest(self) -> None:
        """A turn's prompt followed by its answer is a prefix of the next turn's prompt, in tokens and in routing
        text."""
        arrivals = self.arrivals()
        by_id = {a.request_id: a for a in arrivals}
        follow_ups = [a for a in arrivals if a.follows]
        assert len(follow_ups) > 50
        for a in follow_ups:
            prev = by_id[a.follows]  # type: ignore[index]
            assert prev.output_tokens is not None
            answered = prev.prompt.to_tuple() + prev.output_tokens
            assert a.prompt.to_tuple()[: len(answered)] == answered
            assert render_messages(a.body["messages"]).startswith(render_messages(prev.body["messages"]))
            assert a.time == pytest.approx(prev.time + a.think_time)
            assert a.session_id == prev.session_id

    def test_answers_count_as_output(self) -> None:
        """A turn generates its answer and the end marker: output_len equals the known output tokens."""
        for a in self.arrivals():
            assert a.output_tokens is not None and len(a.output_tokens) == a.output_len
            assert a.engine_request().output_tokens == a.output_tokens

    def test_system_prompt_is_shared(self) -> None:
        """Every conversation starts with the same system prompt node."""
        roots = {id(a.prompt.nodes()[0]) for a in self.arrivals()}
        assert len(roots) == 1


class TestShortPrefix:
    def test_the_shared_prefix_is_shorter_than_the_default_key(self) -> None:
        """The system prompts are ~2,500 characters and the questions ~2,000, so a 4,096-character key is unique."""
        arrivals = list(ShortPrefix().arrivals())
        assert len(arrivals) == 300
        assert len({a.session_id for a in arrivals}) == 24
        systems = [len(a.body["messages"][0]["content"]) for a in arrivals]
        questions = [len(a.body["messages"][1]["content"]) for a in arrivals]
        assert 2300 < statistics.mean(systems) < 2700 and max(systems) < DEFAULT_PREFIX_LENGTH
        assert 1800 < statistics.mean(questions) < 2200
        keys = {RouteRequest.from_openai(a.body).text[:DEFAULT_PREFIX_LENGTH] for a in arrivals}
        assert len(keys) == len(arrivals)

    def test_a_group_shares_its_system_message(self) -> None:
        """Requests of one group share the system message object and its token node."""
        by_group = collections.defaultdict(set)
        for a in ShortPrefix(requests=60).arrivals():
            by_group[a.session_id].add(id(a.prompt.parent))
        assert all(len(nodes) == 1 for nodes in by_group.values())


class TestMultiTurnShort:
    def test_first_turns_are_shorter_than_the_default_key(self) -> None:
        """Turns 1-3 render shorter than 4,096 characters on average and the fifth longer, so keys change early on."""
        lengths = collections.defaultdict(list)
        for a in MultiTurnShort().arrivals():
            lengths[int(a.request_id[-2:])].append(len(render_messages(a.body["messages"])))
        assert max(lengths[0]) < DEFAULT_PREFIX_LENGTH
        assert statistics.mean(lengths[2]) < DEFAULT_PREFIX_LENGTH < statistics.mean(lengths[4])

    def test_conversations_pick_among_the_system_prompts(self) -> None:
        """Conversations start with one of ``systems`` distinct system prompts, each used by several."""
        firsts = collections.Counter(
            a.body["messages"][0]["content"] for a in MultiTurnShort(requests=600).arrivals() if not a.follows
        )
        assert len(firsts) == 16
        assert min(firsts.values()) >= 2

    def test_one_system_prompt_keeps_the_earlier_stream(self) -> None:
        """``systems=1`` (multi-turn's default) draws exactly what multi-turn drew before the option existed."""
        arrivals = list(MultiTurn(system_tokens=50, requests=60, rate=2.0).arrivals())
        assert len({a.body["messages"][0]["content"] for a in arrivals}) == 1
        assert arrivals[0].request_id == "multi-turn-c00000-t00"
        assert arrivals[0].prompt.to_tuple()[1:4] == (13610, 11840, 31241)


class TestRag:
    def test_documents_are_distinct_and_popular_ones_recur(self) -> None:
        """A request retrieves distinct documents, and the most popular document recurs most."""
        workload = Rag(documents=50, doc_tokens=(20, 40), docs_per_request=4, requests=500, zipf_s=1.0)
        firsts = collections.Counter()
        for a in workload.arrivals():
            parts = a.body["messages"][1]["content"].split("\n\n")
            assert len(parts) == 5 and len(set(parts[:4])) == 4
            firsts[a.session_id] += 1
        assert firsts.most_common(1)[0][0] == "doc-0"

    def test_requests_with_the_same_first_document_share_its_prefix(self) -> None:
        """Two requests retrieving the same first document share the node holding it."""
        arrivals = list(Rag(documents=5, doc_tokens=(20, 40), docs_per_request=2, requests=50).arrivals())
        by_doc = collections.defaultdict(set)
        for a in arrivals:
            by_doc[a.session_id].add(id(a.prompt.nodes()[1]))
        assert all(len(nodes) == 1 for nodes in by_doc.values())

    def test_more_documents_than_the_pool_is_refused(self) -> None:
        """docs_per_request cannot exceed the pool."""
        with pytest.raises(ConfigError, match="'docs_per_request' must be at most 'documents'=3"):
            Rag(documents=3, docs_per_request=4)


class TestMooncakeTrace:
    def arrivals(self, **kw: Any) -> list[Arrival]:
        return list(Trace(path=FIXTURES / "mooncake.jsonl", **kw).arrivals())

    def test_reads_the_fixture(self) -> None:
        """Each line becomes an arrival with its time in seconds, its input length and output length."""
        arrivals = self.arrivals()
        assert [a.time for a in arrivals] == [0.0, 0.0, 1.5, 4.25]
        assert [a.prompt_len for a in arrivals] == [1100, 1300, 700, 2000]
        assert [a.output_len for a in arrivals] == [40, 25, 12, 300]
        assert all(a.endpoint == "completions" for a in arrivals)
        assert [a.request_id for a in arrivals] == ["trace-000001", "trace-000002", "trace-000004", "trace-000005"]

    def test_equal_hash_ids_mean_equal_content(self) -> None:
        """Requests sharing leading hash ids share those 512-token blocks and differ after them."""
        a, b, c, d = (x.prompt.to_tuple() for x in self.arrivals())
        assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]
        assert c == a[:700]  # hash ids [0, 1] with a shorter last block: the first words of block 1
        assert d[:512] != a[:512]

    def test_tokens_match_the_prompt_text(self) -> None:
        """The prompt text encodes back to the prompt's tokens."""
        for arrival in self.arrivals():
            assert prompt_tokens_of(arrival) == arrival.prompt.to_tuple()

    def test_seed_changes_content_not_structure(self) -> None:
        """Another seed draws other words for the hash ids but keeps what is shared."""
        one = [a.prompt.to_tuple() for a in self.arrivals(seed=1)]
        two = [a.prompt.to_tuple() for a in self.arrivals(seed=2)]
        assert one != two
        assert two[0][:1024] == two[1][:1024]
        assert one == [a.prompt.to_tuple() for a in self.arrivals(seed=1)]

    def test_time_scale_and_cut_offs(self) -> None:
        """time_scale stretches the times; requests and duration cut the replay short."""
        assert [a.time for a in self.arrivals(time_scale=0.5)] == [0.0, 0.0, 0.75, 2.125]
        assert len(self.arrivals(requests=2)) == 2
        assert len(self.arrivals(duration=2.0)) == 3


class TestSimpleTrace:
    def test_reads_prompts_and_messages(self) -> None:
        """Prompts and messages become completions and chat bodies whose tokens match their text."""
        arrivals = list(Trace(path=FIXTURES / "simple.jsonl").arrivals())
        assert [a.endpoint for a in arrivals] == ["completions", "chat", "chat"]
        assert [a.time for a in arrivals] == [0.0, 0.25, 0.2505]
        assert [a.extra_key for a in arrivals] == [None, "tenant-7", None]
        assert arrivals[1].body["cache_salt"] == "tenant-7"
        for a in arrivals:
            assert a.prompt.to_tuple() == prompt_tokens_of(a)
        system = vocabulary().render_message("system", "you are terse")
        assert arrivals[1].prompt.to_tuple()[: len(system)] == arrivals[2].prompt.to_tuple()[: len(system)]


BAD_LINES = [
    ("{not json", r"expected a JSON object \(got invalid JSON at column 2: .*\)"),
    ("[1, 2]", r"expected a JSON object \(got list\)"),
    (
        '{"input_length": 10, "output_length": 1, "hash_ids": []}',
        r"'timestamp' must be a number of milliseconds >= 0 \(got null\)",
    ),
    ('{"timestamp": -5, "input_length": 10, "output_length": 1}', r"'timestamp' must be a number .* \(got -5\)"),
    (
        '{"timestamp": 0, "input_length": "12x", "output_length": 1, "hash_ids": [1]}',
        r"'input_length' must be an integer >= 1 \(got '12x'\)",
    ),
    (
        '{"timestamp": 0, "input_length": 12, "output_length": 0, "hash_ids": [1]}',
        r"'output_length' must be an integer >= 1 \(got 0\)",
    ),
    (
        '{"timestamp": 0, "input_length": 12, "output_length": 3, "hash_ids": "1,2"}',
        r"'hash_ids' must be a list of integers \(got '1,2'\)",
    ),
    (
        '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2, 3]}',
        r"'hash_ids' must hold at most ceil\(input_length / 512\) = 2 ids for input_length=600 \(got 3\)",
    ),
    (
        '{"timestamp": 0, "text": "hello", "output_length": 3}',
        r"expected Mooncake fields .* \(got keys \['output_length', 'text', 'timestamp'\]\)",
    ),
    ('{"timestamp": 0, "prompt": "", "output_length": 3}', r"'prompt' must be a non-empty string \(got ''\)"),
    (
        '{"timestamp": 0, "messages": [{"content": "hi"}], "output_length": 3}',
        r"'messages\[0\]' must be an object with a string 'role'",
    ),
    (
        '{"timestamp": 0, "prompt": "hi", "output_length": 3, "cache_salt": 5}',
        r"'cache_salt' must be a string \(got 5\)",
    ),
]


class TestTraceErrors:
    @pytest.mark.parametrize(("line", "message"), BAD_LINES)
    def test_bad_line_names_file_line_expected_and_got(self, tmp_path: Path, line: str, message: str) -> None:
        """A bad line raises TraceFormatError naming the file and line number, what was expected and what was got."""
        path = tmp_path / "trace.jsonl"
        good = '{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [0]}'
        path.write_text(f"{good}\n\n{line}\n", encoding="utf-8")
        with pytest.raises(TraceFormatError, match=rf"^{re.escape(str(path))}:3: {message}"):
            list(Trace(path=path).arrivals())

    def test_decreasing_timestamp_is_refused(self, tmp_path: Path) -> None:
        """Timestamps must not go backwards."""
        path = tmp_path / "trace.jsonl"
        path.write_text(
            '{"timestamp": 10, "prompt": "a", "output_length": 1}\n'
            '{"timestamp": 5, "prompt": "b", "output_length": 1}\n',
            encoding="utf-8",
        )
        with pytest.raises(TraceFormatError, match=r":2: 'timestamp' must not decrease \(got 5 after 10\)"):
            list(Trace(path=path).arrivals())

    def test_missing_file_is_a_config_error(self, tmp_path: Path) -> None:
        """A trace path that does not exist is reported as such."""
        with pytest.raises(ConfigError, match="'path' must be an existing trace file"):
            list(Trace(path=tmp_path / "nope.jsonl").arrivals())


class TestSessionIds:
    @pytest.mark.parametrize("name", ["multi-turn", "multi-turn-short", "agentic"])
    def test_on_every_request_names_its_session(self, name: str) -> None:
        """With session_ids on, the router reads each request's session id (metadata.session_id): the same for every
        turn of a conversation, different between conversations; off (the default), none."""
        options = SMALL[name]
        on = list(make_workload(name, session_ids=True, **options).arrivals())
        read = [RouteRequest.from_openai(a.body).session_id for a in on]
        assert read == [a.session_id for a in on] and len(set(read)) > 1
        off = make_workload(name, **options).arrivals()
        assert all(RouteRequest.from_openai(a.body).session_id is None for a in off)

    def test_the_option_does_not_change_the_stream(self) -> None:
        """session_ids only adds the id: the same prompts, times and outputs."""
        options = SMALL["agentic"]
        on, off = (list(make_workload("agentic", session_ids=v, **options).arrivals()) for v in (True, False))
        assert [(a.time, a.prompt.to_tuple(), a.output_len) for a in on] == [
            (a.time, a.prompt.to_tuple(), a.output_len) for a in off
        ]


class TestAgentic:
    @staticmethod
    def arrivals(**options: Any) -> list[Arrival]:
        return list(Agentic(**{"requests": 600, "rate": 0.5, **options}).arrivals())

    def test_a_long_preamble_is_shared(self) -> None:
        """Every session starts with one 10k-20k-token preamble (one shared token node), far longer than the default
        prefix_length in characters."""
        arrivals = self.arrivals()
        roots = {id(a.prompt.nodes()[0]) for a in arrivals}
        assert len(roots) == 1
        preamble = arrivals[0].prompt.nodes()[0]
        assert 10_000 <= len(preamble) - 2 <= 20_000
        assert len(arrivals[0].body["messages"][0]["content"]) > 10 * DEFAULT_PREFIX_LENGTH

    def test_turns_nest_with_tool_results(self) -> None:
        """A turn is the previous turn, its answer and a tool result (0.5k-8k tokens), in tokens and routing text."""
        arrivals = self.arrivals()
        by_id = {a.request_id: a for a in arrivals}
        follow_ups = [a for a in arrivals if a.follows and "-sub" not in a.request_id]
        assert len(follow_ups) > 300
        for a in follow_ups:
            prev = by_id[a.follows]  # type: ignore[index]
            assert prev.output_tokens is not None
            answered = prev.prompt.to_tuple() + prev.output_tokens
            tokens = a.prompt.to_tuple()
            assert tokens[: len(answered)] == answered
            assert 500 <= len(tokens) - len(answered) - 3 <= 8000
            assert a.body["messages"][-1]["role"] == "tool"
            assert render_messages(a.body["messages"]).startswith(render_messages(prev.body["messages"]))
            assert a.time == pytest.approx(prev.time + a.think_time) and a.session_id == prev.session_id

    def test_sessions_have_5_to_30_turns(self) -> None:
        """Sessions that ran to their end have 5-30 turns, and their lengths vary."""
        arrivals = self.arrivals(requests=3000)
        turns = collections.Counter(a.session_id for a in arrivals if "-sub" not in a.request_id)
        finished = list(turns.values())[: len(turns) // 2]  # the first half of the sessions all ended
        assert min(finished) >= 5 and max(finished) <= 30 and len(set(finished)) > 10

    def test_fan_outs_share_a_new_prefix_and_arrive_together(self) -> None:
        """A fanned-out turn's sub-requests arrive with it and share its history and new tool result, then diverge."""
        arrivals = self.arrivals()
        subs = [a for a in arrivals if "-sub" in a.request_id]
        assert len(subs) > 20
        by_id = {a.request_id: a for a in arrivals}
        for sub in subs:
            main = by_id[sub.request_id.rpartition("-sub")[0]]
            shared = main.prompt.to_tuple()[:-1]  # the turn's prompt without the generation marker
            assert sub.time == main.time and sub.prompt.to_tuple()[: len(shared)] == shared
            assert sub.body["messages"][-1]["role"] == "user" and sub.body["messages"][:-1] == main.body["messages"]

    def test_the_context_limit_ends_a_session(self) -> None:
        """No prompt and answer outgrow context_tokens: a session whose history would is cut short."""
        arrivals = self.arrivals(context_tokens=40_000)
        assert max(a.prompt_len + a.output_len for a in arrivals) <= 40_000
        turns = collections.Counter(a.session_id for a in arrivals if "-sub" not in a.request_id)
        assert min(turns.values()) >= 1 and max(turns.values()) < 30

    def test_sessions_differ_in_their_first_user_message(self) -> None:
        """Each session has its own task (its first user message)."""
        tasks = {a.body["messages"][1]["content"] for a in self.arrivals()}
        assert len(tasks) == len({a.session_id for a in self.arrivals()})


class TestMakeWorkload:
    def test_every_name_is_registered(self) -> None:
        """The eight workloads are available by name."""
        assert sorted(WORKLOADS) == [
            "agentic",
            "hot-prefix",
            "long-prefix",
            "multi-turn",
            "multi-turn-short",
            "rag",
            "short-prefix",
            "trace",
        ]

    def test_unknown_name_lists_the_choices(self) -> None:
        """An unknown workload name is refused with the valid names."""
        with pytest.raises(ConfigError, match=r"'workload' must be one of long-prefix, .* \(got 'nope'\)"):
            make_workload("nope")

    def test_unknown_option_lists_the_options(self) -> None:
        """An option the workload does not have is refused with the ones it has."""
        with pytest.raises(ConfigError, match=r"workload 'rag' has no option 'groups'; expected some of .*documents"):
            make_workload("rag", groups=3)

    def test_builds_with_options(self) -> None:
        """Options are passed to the workload."""
        workload = make_workload("long-prefix", groups=3, requests=5)
        assert isinstance(workload, LongPrefix) and workload.groups == 3
