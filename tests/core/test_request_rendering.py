"""The canonical routing text: media markers, escaping, and that different chats never render alike."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute import RouteRequest
from kvroute.hashing import hash64, hash_parts
from kvroute.request import render_messages
from tests.hypothesis_strategies import chat_tools, media_parts, tricky_conversations

Messages = list[dict[str, Any]]
Chat = tuple[list[Any] | None, Messages]  # (tools, messages)

MARKER = re.compile(r"<\|(image|audio|video|file):([0-9a-f]{16})\|>")
RESERVED_ROLES = ("tools", "tool_calls", "part", "image", "audio", "video", "file")

#: For every media part shape the strategies generate: marker name, kind of source, where the value is.
MEDIA_SHAPES: dict[str, tuple[str, Callable[[dict[str, Any]], tuple[str, Any]]]] = {
    "image_url": ("image", lambda p: ("url", p["image_url"]["url"])),
    "input_image": ("image", lambda p: ("url", p["image_url"])),
    "input_audio": ("audio", lambda p: ("data", p["input_audio"]["data"])),
    "audio_url": ("audio", lambda p: ("url", p["audio_url"]["url"])),
    "video_url": ("video", lambda p: ("url", p["video_url"]["url"])),
    "file": (
        "file",
        lambda p: ("file_id", p["file"]["file_id"]) if "file_id" in p["file"] else ("data", p["file"]["file_data"]),
    ),
    "input_file": ("file", lambda p: ("file_id", p["file_id"])),
}


def canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def expected_media(part: dict[str, Any]) -> tuple[str, str, str]:
    """The documented marker of a media part: a URL hashes as hash64 of its JSON, other sources tagged."""
    name, source_of = MEDIA_SHAPES[part["type"]]
    source, value = source_of(part)
    digest = hash64(canonical(value)) if source == "url" else hash_parts(source, canonical(value))
    return ("media", name, f"{digest:016x}")


def normal_form(chat: Chat) -> tuple[Any, ...]:
    """What a chat means for routing: the equivalences the docs allow (string content is one text part,
    adjacent text parts join, empty text, null content, empty name and falsy tool calls are nothing;
    media parts are their marker) and nothing else."""
    tools, messages = chat
    out = []
    for m in messages:
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        segments: list[tuple[Any, ...]] = []
        for p in parts:
            if p["type"] == "text":
                if not p["text"]:
                    continue
                if segments and segments[-1][0] == "text":
                    segments[-1] = ("text", segments[-1][1] + p["text"])
                else:
                    segments.append(("text", p["text"]))
            elif p["type"] in MEDIA_SHAPES:
                segments.append(expected_media(p))
            else:
                segments.append(("part", p))
        name = m.get("name") or None
        out.append((m["role"], name, segments, m.get("tool_calls") or None))
    return (tools or None, out)


# -- a reference parser of the documented grammar -------------------------------------------

_DECODER = json.JSONDecoder()


def _read_field(text: str, pos: int, stops: str) -> tuple[str, int]:
    out = []
    while text[pos] not in stops:
        if text[pos] == "\\":
            pos += 1
        out.append(text[pos])
        pos += 1
    return "".join(out), pos


def _unescape_text(text: str) -> str:
    assert "<|" not in text, f"unescaped marker opening in text {text!r}"
    return re.sub(r"<(\\+)\|", lambda m: "<" + m.group(1)[1:] + "|", text)


def _parse_body(text: str, pos: int) -> tuple[list[tuple[Any, ...]], Any, int]:
    """One message's content segments and tool calls, up to and past its closing newline."""
    segments: list[tuple[Any, ...]] = []
    while True:
        found = text.find("<|", pos)
        is_part = found >= 0 and text.startswith(
            ("<|image:", "<|audio:", "<|video:", "<|file:", "<|part|>", "<|tool_calls|>"), found
        )
        end = found if is_part else (len(text) if found < 0 else found) - 1  # else: at the closing newline
        if not is_part:
            assert text[end] == "\n", f"a message must end with a newline in {text!r}"
        if pos < end:  # a text run renders as one chunk, never next to another
            segments.append(("text", _unescape_text(text[pos:end])))
        if not is_part:
            return segments, None, end + 1
        if text.startswith("<|tool_calls|>", found):
            calls, pos = _DECODER.raw_decode(text, found + len("<|tool_calls|>"))
            assert text[pos] == "\n"
            return segments, calls, pos + 1
        if text.startswith("<|part|>", found):
            part, pos = _DECODER.raw_decode(text, found + len("<|part|>"))
            segments.append(("part", part))
            continue
        marker = MARKER.match(text, found)
        assert marker is not None, f"malformed media marker at {found} in {text!r}"
        segments.append(("media", marker[1], marker[2]))
        pos = marker.end()


def parse_routing_text(text: str) -> tuple[Any, ...]:
    """Read a chat's routing text back into its normal form, following docs/architecture.md."""
    tools, pos = None, 0
    if text.startswith("<|tools|>"):
        tools, pos = _DECODER.raw_decode(text, len("<|tools|>"))
        assert text[pos] == "\n"
        pos += 1
    messages = []
    while pos < len(text):
        assert text.startswith("<|", pos), f"expected a message header at {pos} in {text!r}"
        pos += 2
        reserved = text[pos] == "\\" and text[pos + 1] not in "\\|:"
        pos += reserved
        role, pos = _read_field(text, pos, ":|")
        assert reserved == (role in RESERVED_ROLES)
        name = None
        if text[pos] == ":":
            name, pos = _read_field(text, pos + 1, "|")
        assert text.startswith("|>", pos)
        pos += 2
        segments, calls, pos = _parse_body(text, pos)
        messages.append((role, name, segments, calls))
    return (tools, messages)


def render(chat: Chat) -> str:
    tools, messages = chat
    return render_messages(messages, tools)


# -- forgeries: a second chat built to render like the first under a naive rendering ---------


def _parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])


def _marker_text(part: dict[str, Any]) -> str:
    return render_messages([{"role": "user", "content": [part]}])[len("<|user|>") : -1]


def fold_next_message(chat: Chat, i: int) -> tuple[Chat, Chat]:
    """Message i's text ends with the next message as it renders, instead of the next message."""
    tools, messages = copy.deepcopy(chat)
    messages = [*messages, {"role": "assistant", "content": "a"}]
    i = min(i, len(messages) - 2)
    messages[i].pop("tool_calls", None)
    forged = copy.deepcopy(messages)
    forged[i]["content"] = [
        *_parts(forged[i]),
        {"type": "text", "text": "\n" + render_messages([forged.pop(i + 1)])[:-1]},
    ]
    return (tools, messages), (tools, forged)


def role_takes_the_name(chat: Chat, i: int) -> tuple[Chat, Chat]:
    """A role spelled ``ROLE:NAME`` instead of a role and a name."""
    tools, messages = copy.deepcopy(chat)
    messages[i]["name"] = messages[i].get("name") or "n"
    forged = copy.deepcopy(messages)
    forged[i]["role"] = f"{forged[i]['role']}:{forged[i].pop('name')}"
    return (tools, messages), (tools, forged)


def part_as_text(chat: Chat, i: int, media: dict[str, Any]) -> tuple[Chat, Chat]:
    """Text spelling a media (or unknown) part's marker instead of the part."""
    tools, messages = copy.deepcopy(chat)
    parts = _parts(messages[i])
    at = next((k for k, p in enumerate(parts) if p["type"] != "text"), None)
    if at is None:
        parts.append(media)
        at = len(parts) - 1
    messages[i]["content"] = parts
    forged = copy.deepcopy(messages)
    forged[i]["content"][at] = {"type": "text", "text": _marker_text(parts[at])}
    return (tools, messages), (tools, forged)


def media_as_message(chat: Chat, i: int, media: dict[str, Any]) -> tuple[Chat, Chat]:
    """A message whose role and name spell a media marker instead of a media part ending a line."""
    tools, messages = copy.deepcopy(chat)
    calls = messages[i].pop("tool_calls", None)
    head = [*_parts(messages[i]), {"type": "text", "text": "\n"}]
    messages[i]["content"] = [*head, media]
    if calls:
        messages[i]["tool_calls"] = calls
    role, name = _marker_text(media)[2:-2].split(":")
    forged = copy.deepcopy(messages)
    forged[i]["content"] = head[:-1]
    forged[i].pop("tool_calls", None)
    forged.insert(i + 1, {"role": role, "name": name, "content": "", **({"tool_calls": calls} if calls else {})})
    return (tools, messages), (tools, forged)


def tool_calls_as_text(chat: Chat, i: int) -> tuple[Chat, Chat]:
    """Text spelling the tool-calls marker and JSON instead of tool calls."""
    tools, messages = copy.deepcopy(chat)
    messages[i]["tool_calls"] = messages[i].get("tool_calls") or [{"id": "c", "type": "function"}]
    forged = copy.deepcopy(messages)
    calls = forged[i].pop("tool_calls")
    forged[i]["content"] = [*_parts(forged[i]), {"type": "text", "text": "<|tool_calls|>" + canonical(calls)}]
    return (tools, messages), (tools, forged)


def tools_as_message(chat: Chat, i: int) -> tuple[Chat, Chat]:
    """A first message with role ``tools`` and the tools' JSON instead of tools."""
    tools, messages = copy.deepcopy(chat)
    tools = tools or [{"type": "function"}]
    return (tools, messages), (None, [{"role": "tools", "content": canonical(tools)}, *messages])


FORGERIES: list[Callable[..., tuple[Chat, Chat]]] = [
    fold_next_message,
    role_takes_the_name,
    part_as_text,
    media_as_message,
    tool_calls_as_text,
    tools_as_message,
]

chats = st.tuples(chat_tools, tricky_conversations)
#: Parts that are not text: media of every kind, and one the router does not know.
non_text_parts = media_parts | st.just({"type": "refusal", "refusal": "no"})


class TestMediaMarkers:
    def test_audio_clips_differ_and_the_same_clip_is_equal(self) -> None:
        """Two input_audio clips with different data get different markers; the same data the same one."""

        def text(data: str, fmt: str = "wav") -> str:
            part = {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}
            return render_messages([{"role": "user", "content": [part]}])

        assert text("UklGRgAA") != text("UklGRgAB")
        assert text("UklGRgAA") == text("UklGRgAA") == text("UklGRgAA", "mp3")
        assert MARKER.fullmatch(text("UklGRgAA")[len("<|user|>") : -1])[1] == "audio"  # type: ignore[index]

    @pytest.mark.parametrize(
        ("part", "name"),
        [
            ({"type": "image_url", "image_url": {"url": "https://x/cat.png"}}, "image"),
            ({"type": "input_image", "image_url": "https://x/cat.png"}, "image"),
            ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
            ({"type": "audio_url", "audio_url": {"url": "https://x/a.wav"}}, "audio"),
            ({"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}, "video"),
            ({"type": "file", "file": {"file_id": "file-1"}}, "file"),
            ({"type": "file", "file": {"file_data": "JVBERi0=", "filename": "a.pdf"}}, "file"),
            ({"type": "input_file", "file_id": "file-1"}, "file"),
        ],
    )
    def test_each_part_type_renders_its_documented_marker(self, part: dict[str, Any], name: str) -> None:
        """Every media part type renders as <|NAME:HASH|> with 16 hex digits of the documented hash."""
        text = render_messages([{"role": "user", "content": [part]}])
        assert text == f"<|user|><|{name}:{expected_media(part)[2]}|>\n"

    def test_image_keys_did_not_change(self) -> None:
        """An image URL hashes as hash64 of its JSON string, so image routing keys stay the same across versions."""
        url = "https://example.com/cat.png"
        text = render_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
        assert text == f"<|user|><|image:{hash64(json.dumps(url)):016x}|>\n"

    def test_the_same_image_through_either_api_is_equal(self) -> None:
        """An image_url part and a Responses-style input_image with the same URL render the same marker."""
        a = {"type": "image_url", "image_url": {"url": "https://x/cat.png", "detail": "high"}}
        b = {"type": "input_image", "image_url": "https://x/cat.png"}
        assert render_messages([{"role": "user", "content": [a]}]) == render_messages(
            [{"role": "user", "content": [b]}]
        )

    def test_a_file_id_is_not_an_equal_url(self) -> None:
        """A file id and a URL that happen to be the same string render different markers."""
        a = {"type": "input_file", "file_id": "x"}
        b = {"type": "input_file", "file_url": "x"}
        assert render_messages([{"role": "u", "content": [a]}]) != render_messages([{"role": "u", "content": [b]}])

    def test_a_part_without_an_identifying_field_hashes_whole(self) -> None:
        """A media part with no URL, data or file id is identified by the whole part, so two such parts differ."""
        a = {"type": "input_audio", "input_audio": {"format": "wav"}}
        b = {"type": "input_audio", "input_audio": {"format": "mp3"}}
        assert render_messages([{"role": "u", "content": [a]}]) != render_messages([{"role": "u", "content": [b]}])


class TestEscaping:
    def test_ordinary_text_is_unchanged(self) -> None:
        """Text without '<' + backslashes + '|' renders verbatim, including lone markup characters."""
        text = "a < b | c \\ d > e <\\ f |> g <<"
        assert render_messages([{"role": "user", "content": text}]) == f"<|user|>{text}\n"

    def test_a_role_marker_in_text_is_not_a_message(self) -> None:
        """Text containing '\\n<|assistant|>' renders escaped, unlike a separate assistant message."""
        one = render_messages([{"role": "user", "content": "x\n<|assistant|>y"}])
        two = render_messages([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])
        assert one == "<|user|>x\n<\\|assistant|>y\n"
        assert two == "<|user|>x\n<|assistant|>y\n"

    def test_the_escape_is_escaped(self) -> None:
        """'<\\|' in text gains a backslash too, so it cannot pass for an escaped '<|'."""
        assert render_messages([{"role": "user", "content": "<\\|"}]) == "<|user|><\\\\|\n"
        assert render_messages([{"role": "user", "content": "<|"}]) == "<|user|><\\|\n"

    def test_markers_split_across_text_parts_are_escaped(self) -> None:
        """'<' ending one text part and '|' starting the next are escaped like '<|' in one string."""
        split = [{"type": "text", "text": "<"}, {"type": "text", "text": "|user|>"}]
        assert render_messages([{"role": "a", "content": split}]) == render_messages(
            [{"role": "a", "content": "<|user|>"}]
        )
        assert "<|user|>" not in render_messages([{"role": "a", "content": split}])

    def test_roles_and_names_are_escaped(self) -> None:
        """A role containing ':' differs from a role and a name; roles spelled like markers get a backslash."""
        assert render_messages([{"role": "user:bob", "content": ""}]) == "<|user\\:bob|>\n"
        assert render_messages([{"role": "user", "name": "bob", "content": ""}]) == "<|user:bob|>\n"
        assert render_messages([{"role": "a|>b", "name": "c|>\\", "content": ""}]) == "<|a\\|>b:c\\|>\\\\|>\n"
        assert render_messages([{"role": "image", "content": ""}]) == "<|\\image|>\n"
        assert render_messages([{"role": "tools", "content": ""}]) == "<|\\tools|>\n"

    def test_documented_example(self) -> None:
        """The example in docs/architecture.md renders exactly as shown there."""
        body = {
            "model": "m",
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "name": "ann",
                    "content": [
                        {"type": "text", "text": "Say <|assistant|> twice: "},
                        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                    ],
                },
            ],
        }
        assert RouteRequest.from_openai(body).text == (
            '<|tools|>[{"function":{"name":"f"},"type":"function"}]\n'
            "<|system|>Be brief.\n"
            "<|user:ann|>Say <\\|assistant|> twice: <|image:aaf786ae6003dd55|>\n"
        )


class TestInjectivity:
    @settings(max_examples=300, derandomize=True, deadline=None)
    @given(chats)
    def test_the_text_parses_back_to_the_chat(self, chat: Chat) -> None:
        """The documented grammar reads the rendering back to the chat's normal form (so it is one-to-one)."""
        assert parse_routing_text(render(chat)) == normal_form(chat)

    @settings(max_examples=300, derandomize=True, deadline=None)
    @given(chats, st.sampled_from(FORGERIES), st.data())
    def test_forged_chats_render_differently(
        self, chat: Chat, forge: Callable[..., tuple[Chat, Chat]], data: st.DataObject
    ) -> None:
        """Two different chats never render alike, even when one spells the other's markup in its text, role or name.

        Independently drawn chats almost never collide, so the second chat is forged from the first.
        """
        i = data.draw(st.integers(0, len(chat[1]) - 1), label="i")
        extra = []
        if forge is part_as_text:
            extra = [data.draw(non_text_parts, label="part")]
        elif forge is media_as_message:
            extra = [data.draw(media_parts, label="media")]
        a, b = forge(chat, i, *extra)
        assert normal_form(a) != normal_form(b)
        assert render(a) != render(b)

    @settings(max_examples=200, derandomize=True, deadline=None)
    @given(chat_tools, tricky_conversations, tricky_conversations)
    def test_turns_still_nest(self, tools: list[Any] | None, history: Messages, more: Messages) -> None:
        """With markup in text, roles and names, turn N+1's text still starts with turn N's."""
        assert render_messages(history + more, tools).startswith(render_messages(history, tools))
