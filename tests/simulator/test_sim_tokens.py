"""The simulator's word-level vocabulary and shared token sequences."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kvroute_simulator.tokens import ASSISTANT, END, ROOT_HASH, USER, TokenSeq, Vocabulary, root_hash, vocabulary
from tests.hypothesis_strategies import conversations

token_lists = st.lists(st.integers(0, 40_000), max_size=200)


class TestVocabulary:
    def test_default_vocabulary_is_fixed(self) -> None:
        """The default vocabulary has 32,000 entries in a fixed order, markers first."""
        vocab = vocabulary()
        assert vocab.size == 32_000
        assert vocab.words[:3] == ("<|system|>", "<|user|>", "<|assistant|>")
        assert vocab.words[Vocabulary.FIRST_WORD] == "baba"
        assert vocab == Vocabulary.generated(32_000)

    @given(ids=st.lists(st.integers(Vocabulary.FIRST_WORD, 31_999), max_size=50))
    def test_decode_then_encode_round_trips(self, ids: list[int]) -> None:
        """Text made from word ids encodes back to the same ids."""
        vocab = vocabulary()
        assert vocab.encode(vocab.decode(ids)) == tuple(ids)

    def test_unknown_words_get_stable_ids_above_the_vocabulary(self) -> None:
        """A word outside the vocabulary maps to the same id every time, above the vocabulary's size."""
        vocab = vocabulary()
        first = vocab.encode("quarterly report quarterly")
        assert first[0] == first[2] != first[1]
        assert min(first) >= vocab.size

    def test_chat_rendering_wraps_messages_in_markers(self) -> None:
        """A message renders as role marker, content, end; the prompt ends with the assistant marker."""
        vocab = vocabulary()
        ids = vocab.render_chat([{"role": "user", "content": "baba babe"}])
        assert ids == (USER, vocab.index["baba"], vocab.index["babe"], END, ASSISTANT)

    @given(messages=conversations)
    def test_earlier_turns_render_as_a_prefix(self, messages: list[dict[str, object]]) -> None:
        """The tokens of the first k messages are a prefix of the tokens of all of them."""
        vocab = vocabulary()
        full = vocab.render_chat(messages, add_generation_prompt=False)
        for k in range(len(messages)):
            part = vocab.render_chat(messages[:k], add_generation_prompt=False)
            assert full[: len(part)] == part


class TestTokenSeq:
    @given(tokens=token_lists, cuts=st.lists(st.integers(0, 200), max_size=5), block_size=st.sampled_from([1, 4, 16]))
    def test_hashes_do_not_depend_on_how_the_sequence_is_split(
        self, tokens: list[int], cuts: list[int], block_size: int
    ) -> None:
        """A sequence built from shared pieces hashes exactly like the same tokens in one piece."""
        bounds = sorted({0, len(tokens), *(c for c in cuts if c < len(tokens))})
        seq = TokenSeq.of(tokens[bounds[0] : bounds[1]]) if len(bounds) > 1 else TokenSeq.of(())
        for lo, hi in itertools.pairwise(bounds[1:]):
            seq = seq.extend(tokens[lo:hi])
        flat = TokenSeq.of(tokens)
        assert seq.to_tuple() == tuple(tokens)
        assert len(seq) == len(tokens)
        assert seq.block_hashes(block_size) == flat.block_hashes(block_size)
        assert len(flat.block_hashes(block_size)) == len(tokens) // block_size

    @given(prefix=token_lists, suffix=token_lists)
    def test_prefix_hashes_are_a_prefix_of_the_extension(self, prefix: list[int], suffix: list[int]) -> None:
        """Extending a sequence keeps its block hashes and only appends new ones."""
        base = TokenSeq.of(prefix)
        longer = base.extend(suffix)
        assert longer.block_hashes(16)[: len(base.block_hashes(16))] == base.block_hashes(16)

    def test_equal_blocks_after_different_prefixes_hash_differently(self) -> None:
        """Hashes are chained: the same block after a different parent gets a different hash."""
        block = tuple(range(100, 116))
        a = TokenSeq.of((*range(16), *block)).block_hashes(16)
        b = TokenSeq.of((*range(1, 17), *block)).block_hashes(16)
        assert a[1] != b[1]

    def test_extra_key_changes_every_hash(self) -> None:
        """A LoRA name or cache_salt mixed into the first block changes the whole chain, stably."""
        seq = TokenSeq.of(range(64))
        assert root_hash(None) == ROOT_HASH
        salted = seq.block_hashes(16, root_hash("tenant"))
        assert salted == seq.block_hashes(16, root_hash("tenant"))
        assert all(x != y for x, y in zip(salted, seq.block_hashes(16), strict=True))

    def test_text_decodes_the_tokens(self) -> None:
        """The text of a sequence is its words joined by spaces."""
        vocab = vocabulary()
        seq = TokenSeq.of(vocab.encode("baba babe")).extend(vocab.encode("babi"))
        assert seq.text() == "baba babe babi"
