"""Tokenization: model files, piece-wise tokenization equal to whole-text tokenization, the word fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute_tokenizer_prefix.tokenizer import (
    ModelTokenizer,
    WordTokenizer,
    chunk_ids,
    load_tokenizer,
    prompt_ids,
    resolve_model_files,
    split_points,
)

import kvroute
from kvroute.errors import ConfigError, InvalidRequest

# Text like prompts: words, spaces, newlines, digits, punctuation, Unicode, special-token look-alikes.
_fragments = st.sampled_from(
    [
        "Hello",
        " world",
        "the",
        " cat",
        "\n",
        "\n\n",
        "  ",
        " \n",
        "\t",
        ".",
        ",",
        "!",
        "?",
        "'s",
        " 123",
        "4567",
        "é",
        " naïve",
        "日本",
        "😀",
        "\u00a0",
        "<|im_start|>",
        "<|im_end|>",
        "<|bos|>",
        "x.\n",
        "\nItem",
        "def f():\n    ",
        "A",
        "b",
        "Zz",
        "(",
        ")",
        "-",
        "_",
        ":",
        "\r\n",
    ]
)
texts = st.one_of(st.lists(_fragments, max_size=80).map("".join), st.text(max_size=300))


class TestResolveModelFiles:
    def test_tokenizer_json_path(self, model_dir: Path) -> None:
        """A tokenizer.json path also finds the config files beside it."""
        found = resolve_model_files(model_dir / "tokenizer.json")
        assert found["tokenizer.json"] == model_dir / "tokenizer.json"
        assert found["tokenizer_config.json"] == model_dir / "tokenizer_config.json"

    def test_directory(self, model_dir: Path) -> None:
        """A model directory yields its tokenizer files."""
        assert set(resolve_model_files(model_dir)) >= {
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
        }

    def test_directory_without_tokenizer_json(self, tmp_path: Path) -> None:
        """A directory without tokenizer.json is a ConfigError naming the directory."""
        with pytest.raises(ConfigError, match=r"has no tokenizer\.json"):
            resolve_model_files(tmp_path)

    def test_hub_id_from_local_cache(self, hf_cache: Path) -> None:
        """A Hub id resolves to its snapshot in the local cache, offline."""
        found = resolve_model_files("test-org/tiny-chat")
        assert found["tokenizer.json"].is_file()
        assert hf_cache in found["tokenizer.json"].parents

    def test_hub_id_missing_from_cache(self, hf_cache: Path) -> None:
        """A Hub id not in the cache is a ConfigError that says nothing is downloaded."""
        with pytest.raises(ConfigError, match="never downloads"):
            resolve_model_files("test-org/absent")

    def test_nonexistent_path(self) -> None:
        """A path that does not exist is a ConfigError with what was expected."""
        with pytest.raises(ConfigError, match=r"must be a tokenizer\.json file"):
            resolve_model_files("/no/such/tokenizer.json")


class TestModelTokenizer:
    def test_byte_level_tokenizers_are_split(self, tok: ModelTokenizer, gpt2: ModelTokenizer) -> None:
        """Byte-level BPE tokenizers pass the self-check and are tokenized piece by piece."""
        assert tok.splittable and gpt2.splittable

    def test_metaspace_prepend_is_tokenized_whole(self, metaspace: ModelTokenizer) -> None:
        """A tokenizer that prepends a marker to every piece is tokenized whole."""
        assert not metaspace.splittable

    @settings(max_examples=300)
    @given(text=texts)
    def test_pieces_equal_whole_text_llama3(self, tok: ModelTokenizer, text: str) -> None:
        """Piece-wise ids equal the whole text's ids (Llama-3-style split regex)."""
        pieces = [t for chunk in tok.text_chunks(text, add_special_tokens=False) for t in chunk_ids(chunk)]
        assert pieces == tok.encode_text(text)

    @settings(max_examples=300)
    @given(text=texts)
    def test_pieces_equal_whole_text_gpt2(self, gpt2: ModelTokenizer, text: str) -> None:
        """Piece-wise ids equal the whole text's ids (GPT-2-style byte-level regex)."""
        pieces = [t for chunk in gpt2.text_chunks(text, add_special_tokens=False) for t in chunk_ids(chunk)]
        assert pieces == gpt2.encode_text(text)

    @given(text=texts)
    def test_whole_text_fallback_equals_encoding(self, metaspace: ModelTokenizer, text: str) -> None:
        """An unsplittable tokenizer still yields exactly the library's ids."""
        ids = [t for chunk in metaspace.text_chunks(text, add_special_tokens=True) for t in chunk_ids(chunk)]
        assert ids == metaspace.encode_text(text, add_special_tokens=True)

    @given(text=texts)
    def test_completion_prompt_gets_bos(self, tok: ModelTokenizer, text: str) -> None:
        """A completions text prompt is tokenized with special tokens, as vLLM's completions endpoint does."""
        request = kvroute.RouteRequest.from_text(text)
        assert prompt_ids(tok, request) == tok.encode_text(text, add_special_tokens=True)

    def test_repeated_prefix_is_served_from_the_cache(self, model_dir: Path) -> None:
        """A second prompt sharing a long prefix reuses the cached pieces and still gets exact ids."""
        tok = load_tokenizer(model_dir, piece_bytes=64)
        shared = " ".join(f"word{i} and more text" for i in range(200))
        first = shared + " first question?"
        second = shared + " second question?"
        assert [chunk_ids(c) for c in tok.text_chunks(first, add_special_tokens=False)] and tok.hits == 0
        misses = tok.misses
        ids = [t for chunk in tok.text_chunks(second, add_special_tokens=False) for t in chunk_ids(chunk)]
        assert ids == tok.encode_text(second)
        assert tok.hits >= misses - 2
        assert tok.misses - misses <= 2

    def test_cache_is_bounded(self, model_dir: Path) -> None:
        """The piece cache never holds more than ``cache_tokens`` ids."""
        tok = load_tokenizer(model_dir, piece_bytes=16, cache_tokens=50)
        [chunk_ids(c) for c in tok.text_chunks(" ".join(f"w{i}" for i in range(500)), add_special_tokens=False)]
        assert 0 < tok.cached_tokens <= 50

    def test_token_ids_are_used_as_they_are(self, tok: ModelTokenizer) -> None:
        """A prompt sent as token ids is not re-tokenized."""
        body = {"model": "m", "prompt": [5, 6, 7, 1 << 40]}
        request = kvroute.RouteRequest.from_openai(body, endpoint="completions")
        assert prompt_ids(tok, request) == [5, 6, 7, 1 << 40]

    def test_negative_token_ids_are_rejected(self, tok: ModelTokenizer) -> None:
        """A negative token id is an InvalidRequest saying the allowed range."""
        request = kvroute.RouteRequest.from_text("x", token_ids=[1, -2])
        with pytest.raises(InvalidRequest, match="between 0 and 2\\*\\*64-1"):
            prompt_ids(tok, request)

    def test_chat_is_rendered_without_adding_special_tokens(self, tok: ModelTokenizer) -> None:
        """Chat ids are the rendered template tokenized without a second BOS."""
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi there"}]}
        request = kvroute.RouteRequest.from_openai(body)
        text = "<|bos|><|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        assert tok.render(request) == text
        assert prompt_ids(tok, request) == tok.encode_text(text)
        assert prompt_ids(tok, request).count(tok.prefix_ids[0]) == 1

    def test_chat_without_template_is_an_invalid_request(self, tmp_path: Path) -> None:
        """A model without a chat template cannot tokenize chat messages, and says how to fix it."""
        from conftest import train, write_model

        tok = load_tokenizer(write_model(tmp_path / "m", train("gpt2", vocab_size=400), template=None))
        request = kvroute.RouteRequest.from_openai({"model": "m", "messages": [{"role": "user", "content": "x"}]})
        with pytest.raises(InvalidRequest, match="no chat template"):
            prompt_ids(tok, request)


class TestSplitPoints:
    @given(data=st.binary(max_size=400) | texts.map(lambda t: t.encode()), size=st.integers(1, 64))
    def test_pieces_cover_the_text(self, data: bytes, size: int) -> None:
        """Cuts are increasing, end at the text's length, and every piece but the last is at least ``size`` long."""
        cuts = list(split_points(data, size))
        if not data:
            assert cuts == []
            return
        assert cuts[-1] == len(data)
        starts = [0, *cuts[:-1]]
        assert all(end - start >= size for start, end in zip(starts[:-1], cuts[:-1], strict=True))

    @given(shared=texts, a=texts, b=texts, size=st.integers(1, 32))
    def test_cuts_depend_only_on_the_bytes_before(self, shared: str, a: str, b: str, size: int) -> None:
        """Two texts sharing a prefix are cut the same way up to where the shared bytes end."""
        x, y = (shared + a).encode(), (shared + b).encode()
        limit = len(shared.encode())
        cx = [c for c in split_points(x, size) if c < limit - 1]
        cy = [c for c in split_points(y, size) if c < limit - 1]
        assert cx == cy


class TestWordTokenizer:
    def test_chat_matches_the_simulators_vocabulary(self) -> None:
        """Chat requests get the simulated engine's exact token ids."""
        from kvroute.vocabulary import vocabulary

        messages = [{"role": "system", "content": "bada bade"}, {"role": "user", "content": "badi"}]
        request = kvroute.RouteRequest.from_openai({"model": "m", "messages": messages})
        assert prompt_ids(WordTokenizer(), request) == list(vocabulary().render_chat(messages))

    @settings(max_examples=200)
    @given(
        messages=st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard", "my role"]),
                    "content": st.lists(
                        st.sampled_from(
                            ["bada", "bade", "<|end|>", "<|user|>", "x", " ", "\n", "  ", "unknownword", "é"]
                        ),
                        max_size=12,
                    ).map("".join),
                }
            ),
            min_size=1,
            max_size=5,
        ),
        generation=st.booleans(),
    )
    def test_chats_get_the_vocabularys_ids(self, messages: list[dict[str, str]], generation: bool) -> None:
        """Any chat, with any roles and marker-like words in its content, gets exactly render_chat's ids."""
        from kvroute.vocabulary import vocabulary

        body = {"model": "m", "messages": messages, "add_generation_prompt": generation}
        request = kvroute.RouteRequest.from_openai(body)
        tok = WordTokenizer(piece_bytes=8, fine_bytes=2)
        expected = list(vocabulary().render_chat(messages, add_generation_prompt=generation))
        assert prompt_ids(tok, request) == expected

    def test_text_is_split_on_whitespace(self) -> None:
        """A text prompt is one token per whitespace-separated word."""
        from kvroute.vocabulary import vocabulary

        request = kvroute.RouteRequest.from_text("bada  bade\nunknownword")
        assert prompt_ids(WordTokenizer(), request) == list(vocabulary().encode("bada bade unknownword"))
