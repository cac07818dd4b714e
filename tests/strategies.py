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
