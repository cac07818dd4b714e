"""kvroute.keys.message_cuts: where a key's text ends at message boundaries, and that every turn keeps it."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute import RouteRequest
from kvroute.keys import MIN_PREFIX_LENGTH, Cuts, conversation_key, message_cuts, prefix_key
from kvroute.request import render_messages
from tests.hypothesis_strategies import chat_tools, markup_text, prompt_text, tricky_conversations, tricky_message

Messages = list[dict[str, Any]]

#: Messages whose role is never ``user`` (a preamble), and user messages with tricky content.
preamble_messages = st.lists(tricky_message.filter(lambda m: m["role"] != "user"), max_size=3)
user_messages = tricky_message.map(lambda m: {**m, "role": "user"})
#: Long plain contents, so that caps at prefix_length are met too.
long_text = st.integers(0, 5000).map(lambda n: "w" * n)


def chat(messages: Messages, tools: Any = None) -> RouteRequest:
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if tools is not None:
        body["tools"] = tools
    return RouteRequest.from_openai(body)


def turns(
    preamble: Messages, first: dict[str, Any], later: list[tuple[dict[str, Any], dict[str, Any]]]
) -> list[Messages]:
    """The message lists of successive turns: each adds an answer and a new user message."""
    out = [[*preamble, first]]
    for answer, question in later:
        out.append([*out[-1], answer, question])
    return out


class TestMessageOffsets:
    @given(tricky_conversations, chat_tools)
    def test_offsets_are_the_rendering_of_each_head(self, messages: Messages, tools: Any) -> None:
        """Each offset is the length of the rendering of the messages before it, the last the text's length."""
        request = chat(messages, tools)
        assert request.message_offsets == tuple(
            len(render_messages(messages[:i], tools)) for i in range(len(messages) + 1)
        )

    def test_completions_have_no_offsets(self) -> None:
        """Only a chat has message offsets."""
        request = RouteRequest.from_openai({"model": "m", "prompt": "hello"}, endpoint="completions")
        assert request.message_offsets is None and RouteRequest.from_text("hello").message_offsets is None


class TestMessageCuts:
    def test_system_prompt_is_the_group(self) -> None:
        """A 2,500-character system prompt groups requests whatever 2,000-character question follows."""
        system = {"role": "system", "content": "s" * 2500}
        a = chat([system, {"role": "user", "content": "a" * 2000}])
        b = chat([system, {"role": "user", "content": "b" * 2000}])
        cuts = message_cuts(a)
        assert cuts == message_cuts(b) == Cuts(len(render_messages([system])), 4096)
        assert prefix_key(a, cuts.group) == prefix_key(b, cuts.group)
        assert prefix_key(a, cuts.conversation) != prefix_key(b, cuts.conversation)

    def test_conversation_ends_after_the_first_user_message(self) -> None:
        """The conversation cut is the end of the first user message, however many turns follow."""
        messages: Messages = [
            {"role": "system", "content": "be brief"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "answer"},
            {"role": "user", "content": "second"},
        ]
        cuts = message_cuts(chat(messages))
        assert cuts == Cuts(len(render_messages(messages[:2])), len(render_messages(messages[:3])))

    def test_tools_belong_to_the_preamble(self) -> None:
        """Tool definitions are part of the group, even with no system message."""
        tools = [{"type": "function", "function": {"name": "lookup"}}]
        request = chat([{"role": "user", "content": "q"}], tools)
        assert message_cuts(request).group == len(render_messages([], tools)) > 0

    def test_without_preamble_the_group_is_the_conversation(self) -> None:
        """A chat that starts with its user message has one cut: through that message."""
        first = {"role": "user", "content": "q" * 100}
        end = len(render_messages([first]))
        assert message_cuts(chat([first, {"role": "assistant", "content": "a"}])) == Cuts(end, end)

    def test_without_user_message_both_cuts_are_the_whole_text(self) -> None:
        """A chat with no user message is cut at its end (or at prefix_length)."""
        request = chat([{"role": "system", "content": "s" * 10}])
        assert message_cuts(request) == Cuts(len(request.text), len(request.text))
        long = chat([{"role": "system", "content": "s" * 5000}])
        assert message_cuts(long, 2048) == Cuts(2048, 2048)

    def test_cuts_are_capped_at_prefix_length(self) -> None:
        """A preamble or first message longer than prefix_length is cut at prefix_length."""
        request = chat([{"role": "system", "content": "s" * 9000}, {"role": "user", "content": "q"}])
        assert message_cuts(request, 8192) == Cuts(8192, 8192)
        assert message_cuts(request) == Cuts(4096, 4096)

    def test_completions_cut_after_a_head_and_after_prefix_length(self) -> None:
        """A plain prompt has no boundaries: its group is the first 1,024 characters, its conversation
        prefix_length."""
        assert message_cuts(RouteRequest.from_text("p" * 9000)) == Cuts(MIN_PREFIX_LENGTH, 4096)
        assert message_cuts(RouteRequest.from_text("p" * 9000), 2048) == Cuts(MIN_PREFIX_LENGTH, 2048)
        assert message_cuts(RouteRequest.from_text("p" * 10)) == Cuts(10, 10)
        assert message_cuts(RouteRequest.from_text("")) == Cuts(1, 1)

    @pytest.mark.parametrize("bad", [0, -1, True, 2.5, "4096"])
    def test_bad_prefix_length(self, bad: object) -> None:
        """A prefix length that is not a positive integer is a ValueError saying what was got."""
        with pytest.raises(ValueError, match="'prefix_length' must be a positive integer"):
            message_cuts(RouteRequest.from_text("x"), bad)  # type: ignore[arg-type]

    def test_same_cuts_and_keys_in_another_process(self) -> None:
        """A process with another PYTHONHASHSEED computes the same cuts and the same group and conversation keys."""
        body = {
            "model": "m",
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [{"role": "system", "content": "s\u00e9" * 700}, {"role": "user", "content": "q" * 3000}],
        }
        code = (
            "import json, sys; from kvroute import RouteRequest; from kvroute.keys import message_cuts, prefix_key; "
            "r = RouteRequest.from_openai(json.loads(sys.argv[1])); c = message_cuts(r); "
            "print(json.dumps([c.group, c.conversation, prefix_key(r, c.group), prefix_key(r, c.conversation)]))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(body)],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": "4321"},
        ).stdout
        request = RouteRequest.from_openai(body)
        cuts = message_cuts(request)
        expected = [
            cuts.group,
            cuts.conversation,
            prefix_key(request, cuts.group),
            prefix_key(request, cuts.conversation),
        ]
        assert json.loads(out) == expected and cuts.group < cuts.conversation

    @settings(derandomize=True, max_examples=200)
    @given(
        preamble_messages,
        user_messages,
        st.lists(st.tuples(tricky_message, user_messages), min_size=1, max_size=3),
        chat_tools,
        st.sampled_from([1024, 4096, 65536]),
    )
    def test_every_turn_keeps_the_first_turns_cuts_and_keys(
        self,
        preamble: Messages,
        first: dict[str, Any],
        later: list[tuple[dict[str, Any], dict[str, Any]]],
        tools: Any,
        prefix_length: int,
    ) -> None:
        """Turn N+1 of a conversation (turn N, an answer and a new user message) has turn N's cuts and keys."""
        requests = [chat(messages, tools) for messages in turns(preamble, first, later)]
        cuts = message_cuts(requests[0], prefix_length)
        for request in requests[1:]:
            assert message_cuts(request, prefix_length) == cuts
            assert prefix_key(request, cuts.group) == prefix_key(requests[0], cuts.group)
            assert prefix_key(request, cuts.conversation) == prefix_key(requests[0], cuts.conversation)

    @settings(derandomize=True, max_examples=100)
    @given(long_text, prompt_text, long_text, st.lists(st.tuples(markup_text, long_text), min_size=1, max_size=3))
    def test_long_turns_keep_their_keys(
        self, system: str, question: str, more: str, later: list[tuple[str, str]]
    ) -> None:
        """With contents around and beyond prefix_length, every turn still has the first turn's cuts."""
        preamble = [{"role": "system", "content": system}] if system else []
        first = {"role": "user", "content": question + more}
        rest = [({"role": "assistant", "content": a}, {"role": "user", "content": q}) for a, q in later]
        requests = [chat(messages) for messages in turns(preamble, first, rest)]
        assert len({message_cuts(r) for r in requests}) == 1


#: What follows a first turn in an agent loop or a chat: any messages (answers, tool results, new questions).
later_messages = st.lists(tricky_message, min_size=1, max_size=4)


class TestConversationKey:
    def test_a_long_preamble_does_not_hide_the_conversation(self) -> None:
        """Under a 12,000-character preamble, conversations with different first user messages get different keys,
        and each keeps its key over its turns (tool results and answers added)."""
        preamble = [{"role": "system", "content": "tools and instructions " * 522}]
        assert len(render_messages(preamble)) > 12_000
        keys = set()
        for i in range(50):
            first = {"role": "user", "content": f"task {i}: fix the failing test"}
            later = [
                {"role": "assistant", "content": f"reading file {i}"},
                {"role": "tool", "content": "x" * 3000},
                {"role": "assistant", "content": "running the tests"},
                {"role": "tool", "content": "y" * 6000},
            ]
            turn_keys = {conversation_key(chat([*preamble, first, *later[:n]])) for n in (0, 2, 4)}
            assert len(turn_keys) == 1 and None not in turn_keys
            keys |= turn_keys
        assert len(keys) == 50

    def test_the_first_user_message_counts_after_a_long_preamble(self) -> None:
        """After a preamble longer than prefix_length the first user message still counts, 1,024 characters of it:
        messages that differ within them differ in key, beyond them they share it."""
        system = {"role": "system", "content": "s" * 9000}
        a = chat([system, {"role": "user", "content": "a" * 100 + "q" * 5000}])
        b = chat([system, {"role": "user", "content": "b" * 100 + "q" * 5000}])
        c = chat([system, {"role": "user", "content": "a" * 100 + "q" * 1000 + "c" * 1000}])
        assert conversation_key(a) != conversation_key(b)
        assert conversation_key(a) == conversation_key(c)
        assert conversation_key(a, 16384) != conversation_key(c, 16384)  # 7,384 characters left after the preamble

    def test_after_a_short_preamble_the_text_is_cut_at_prefix_length(self) -> None:
        """After a short preamble the key covers the text's first prefix_length characters, as the conversation cut
        does: first messages that differ only past them share a key (a retrieved document's tail)."""
        system = {"role": "system", "content": "s" * 2000}
        a = chat([system, {"role": "user", "content": "d" * 2500 + "a" * 3000}])
        b = chat([system, {"role": "user", "content": "d" * 2500 + "b" * 3000}])
        assert message_cuts(a).conversation == 4096
        assert a.text[:4096] == b.text[:4096] and conversation_key(a) == conversation_key(b)
        assert conversation_key(a, 8192) != conversation_key(b, 8192)

    def test_the_preamble_is_part_of_the_key(self) -> None:
        """The same first user message under two preambles (or two models) gives two keys."""
        question = {"role": "user", "content": "hello"}
        one = chat([{"role": "system", "content": "one"}, question])
        two = chat([{"role": "system", "content": "two"}, question])
        other_model = RouteRequest.from_openai(
            {"model": "n", "messages": [{"role": "system", "content": "one"}, question]}
        )
        assert len({conversation_key(one), conversation_key(two), conversation_key(other_model)}) == 3

    def test_without_preamble_it_is_the_group_key(self) -> None:
        """A chat that starts with its user message has the key of its group cut (its first message)."""
        request = chat([{"role": "user", "content": "q" * 5000}, {"role": "assistant", "content": "a"}])
        assert conversation_key(request) == prefix_key(request, message_cuts(request).group)

    def test_short_first_turns_have_a_key(self) -> None:
        """A two-character first message under a short system prompt is a conversation key, kept on the next turn."""
        first = chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
        second = chat(
            [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello! " * 800},
                {"role": "user", "content": "and then?"},
            ]
        )
        assert conversation_key(first) == conversation_key(second) is not None

    def test_none_without_a_conversation(self) -> None:
        """No key for a plain completion, a chat without a user message, or a request with an affinity key."""
        assert conversation_key(RouteRequest.from_text("p" * 9000)) is None
        assert conversation_key(chat([{"role": "system", "content": "s"}])) is None
        pinned = RouteRequest.from_openai(
            {"model": "m", "messages": [{"role": "user", "content": "q"}]}, headers={"x-kvroute-affinity": "s-1"}
        )
        assert conversation_key(pinned) is None

    @pytest.mark.parametrize("bad", [0, -1, True, 2.5, "4096"])
    def test_bad_prefix_length(self, bad: object) -> None:
        """A prefix length that is not a positive integer is a ValueError saying what was got."""
        with pytest.raises(ValueError, match="'prefix_length' must be a positive integer"):
            conversation_key(RouteRequest.from_text("x"), bad)  # type: ignore[arg-type]

    def test_same_key_in_another_process(self) -> None:
        """A process with another PYTHONHASHSEED computes the same conversation key."""
        body = {
            "model": "m",
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [{"role": "system", "content": "s\u00e9" * 3000}, {"role": "user", "content": "q" * 300}],
        }
        code = (
            "import json, sys; from kvroute import RouteRequest; from kvroute.keys import conversation_key; "
            "print(conversation_key(RouteRequest.from_openai(json.loads(sys.argv[1]))))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(body)],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": "4321"},
        ).stdout
        assert int(out) == conversation_key(RouteRequest.from_openai(body))

    @settings(derandomize=True, max_examples=200)
    @given(
        preamble_messages,
        long_text,
        user_messages,
        later_messages,
        chat_tools,
        st.sampled_from([1024, 4096, 65536]),
    )
    def test_every_turn_shares_the_first_turns_key(
        self,
        preamble: Messages,
        shared: str,
        first: dict[str, Any],
        later: Messages,
        tools: Any,
        prefix_length: int,
    ) -> None:
        """Every later turn of a conversation (the first turn and any messages after it: answers, tool results,
        questions) has the first turn's conversation key, with preambles short or past prefix_length."""
        head = [*preamble, {"role": "system", "content": shared}] if shared else preamble
        turns_ = [chat([*head, first, *later[:n]], tools) for n in range(len(later) + 1)]
        key = conversation_key(turns_[0], prefix_length)
        assert key is not None
        assert all(conversation_key(t, prefix_length) == key for t in turns_[1:])
