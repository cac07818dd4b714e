"""Hypothesis strategies shared by the test suites of every package."""

from __future__ import annotations

from hypothesis import strategies as st

#: Backend ids as operators write them.
backend_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)

#: Capacity weights, from a small to a large instance.
weights = st.sampled_from([0.5, 1.0, 1.0, 1.0, 2.0, 4.0])

#: Text that includes non-ASCII and control characters, as real prompts may.
prompt_text = st.text(min_size=0, max_size=200)

#: OpenAI chat message content: a string or a list of text parts.
message_content = st.one_of(
    prompt_text,
    st.lists(st.builds(lambda t: {"type": "text", "text": t}, prompt_text), min_size=1, max_size=3),
)

#: One chat message.
chat_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": message_content}
)

#: A conversation of one or more messages.
conversations = st.lists(chat_message, min_size=1, max_size=6)

# -- chats that try to confuse the canonical routing text (kvroute.request) -----------------

#: Pieces of the routing text's own markup (markers, escapes, separators) and plain words.
_markup_pieces = st.sampled_from(
    [
        "<|",
        "|>",
        "<",
        "|",
        ">",
        "\\",
        ":",
        "\n",
        "user",
        "image",
        "<|user|>",
        "\n<|assistant|>",
        "<|image:",
        "<|audio:",
        "<|tools|>",
        "<|tool_calls|>",
        "<|part|>",
        "<\\|",
        "0123456789abcdef",
    ]
)

#: Text that often looks like routing-text markup, sometimes plain.
markup_text = st.lists(_markup_pieces | st.text(max_size=2), max_size=5).map("".join)

#: Chat roles: the usual ones, ones spelled like markers, and ones full of markup characters.
chat_roles = st.sampled_from(
    [
        "system",
        "user",
        "assistant",
        "tool",
        "developer",
        "tools",
        "tool_calls",
        "part",
        "image",
        "audio",
        "video",
        "file",
    ]
) | markup_text.filter(bool)

#: The value identifying a media clip (URL, base64 data or file id): few, so that clips repeat.
_clip = st.text(alphabet="ab:/=", max_size=3)

#: Media content parts of every shape the router knows, identified by a URL, data or a file id.
media_parts = st.one_of(
    st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, _clip),
    st.builds(
        lambda u, d: {"type": "image_url", "image_url": {"url": u, "detail": d}},
        _clip,
        st.sampled_from(["low", "high"]),
    ),
    st.builds(lambda u: {"type": "input_image", "image_url": u}, _clip),
    st.builds(
        lambda d, f: {"type": "input_audio", "input_audio": {"data": d, "format": f}},
        _clip,
        st.sampled_from(["wav", "mp3"]),
    ),
    st.builds(lambda u: {"type": "audio_url", "audio_url": {"url": u}}, _clip),
    st.builds(lambda u: {"type": "video_url", "video_url": {"url": u}}, _clip),
    st.builds(lambda i: {"type": "file", "file": {"file_id": i}}, _clip),
    st.builds(lambda d: {"type": "file", "file": {"file_data": d, "filename": "a.pdf"}}, _clip),
    st.builds(lambda i: {"type": "input_file", "file_id": i}, _clip),
)

#: A list content: text parts with markup, media parts, and a part type the router does not know.
content_parts = st.lists(
    st.builds(lambda t: {"type": "text", "text": t}, markup_text)
    | media_parts
    | st.builds(lambda t: {"type": "refusal", "refusal": t}, markup_text),
    max_size=4,
)

#: Tool calls as an assistant message carries them (empty lists included).
tool_calls = st.lists(
    st.builds(
        lambda i, n, a: {"id": i, "type": "function", "function": {"name": n, "arguments": a}},
        markup_text,
        markup_text,
        markup_text,
    ),
    max_size=2,
)

#: A chat message that stresses the rendering: odd roles and names, markup in text, media, tool calls.
tricky_message = st.fixed_dictionaries(
    {"role": chat_roles, "content": st.none() | markup_text | content_parts},
    optional={"name": markup_text, "tool_calls": tool_calls},
)

#: One or more tricky messages.
tricky_conversations = st.lists(tricky_message, min_size=1, max_size=4)

#: A chat's ``tools`` (or None).
chat_tools = st.none() | st.lists(
    st.builds(lambda n: {"type": "function", "function": {"name": n}}, markup_text), max_size=2
)

#: Any JSON value (as json.loads returns them), nested a few levels.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
