"""Fixtures for the tokenizer-prefix tests: small tokenizers trained here with `tokenizers`, no downloads.

``model_dir`` is a model directory as a Hub snapshot would hold it: ``tokenizer.json`` (a
byte-level BPE with a Llama-3-style split regex and a BOS post-processor),
``tokenizer_config.json`` (special tokens and a ChatML-like chat template with tools) and
``special_tokens_map.json``. Other fixtures vary one property at a time.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

# One training thread: the merges do not depend on scheduling, so the fixture is the same every run.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BOS = "<|bos|>"
EOS = "<|eos|>"
SPECIALS = (BOS, EOS, "<|pad|>", "<|im_start|>", "<|im_end|>")

#: Llama 3's pre-tokenizer split pattern (a public fact of its tokenizer.json).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML-like, reads content as a string (content format "string"), renders tools as JSON.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nTools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Loops over content parts (content format "openai"), trims blocks like real templates do.
PARTS_TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
<|im_start|>{{ message.role }}
{% if message.content is string %}{{ message.content }}{% else %}
{%- for part in message.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}
{%- endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def corpus(seed: int = 7, lines: int = 3000) -> list[str]:
    """English-looking lines from a seeded lexicon, with digits, punctuation, code and some Unicode."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    lexicon = sorted({"".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3)))) for _ in range(1500)})
    lexicon += ["the", "and", "of", "to", "a", "in", "is", "you", "that", "it", "naïve", "café", "日本語", "😀"]
    weights = [1.0 / (r + 1) for r in range(len(lexicon))]
    out = []
    for _ in range(lines):
        words = rng.choices(lexicon, weights=weights, k=rng.randint(3, 20))
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        line = " ".join(words) + rng.choice(".....?!:;")
        if rng.random() < 0.1:
            line = "    def f(x):\n        return x + 1\n" + line
        out.append(line[0].upper() + line[1:])
    return out


def train(kind: str = "llama3", vocab_size: int = 2000, seed: int = 7) -> object:
    """Train a small tokenizer: ``llama3`` (split regex + byte level), ``gpt2`` (byte level regex) or ``metaspace``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if kind == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet: list[str] = []
        specials = ["<unk>", *SPECIALS]
    else:
        tok = Tokenizer(models.BPE())
        if kind == "llama3":
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        elif kind == "gpt2":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            raise ValueError(kind)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        specials = list(SPECIALS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tok


def write_model(out: Path, tok: object, template: str | list[dict[str, str]] | None = CHAT_TEMPLATE) -> Path:
    """Write a model directory (tokenizer files only) the way transformers' save_pretrained lays it out."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))  # type: ignore[attr-defined]
    added = {
        str(tok.token_to_id(t)): {  # type: ignore[attr-defined]
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIALS
    }
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": "<|pad|>",
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "added_tokens_decoder": added,
    }
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": "<|pad|>"})
    )
    return out


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-3-style byte-level BPE with a ChatML-like chat template (content as a string)."""
    return write_model(tmp_path_factory.mktemp("model"), train("llama3"))


@pytest.fixture(scope="session")
def parts_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tokenizer with a template that loops over content parts (content format ``openai``)."""
    return write_model(tmp_path_factory.mktemp("parts-model"), train("llama3"), PARTS_TEMPLATE)


@pytest.fixture(scope="session")
def gpt2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPT-2-style byte-level BPE (regex inside the ByteLevel pre-tokenizer)."""
    return write_model(tmp_path_factory.mktemp("gpt2-model"), train("gpt2"))


@pytest.fixture(scope="session")
def metaspace_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece-style tokenizer (Metaspace, prepend "first"): pieces cannot be tokenized apart."""
    return write_model(tmp_path_factory.mktemp("metaspace-model"), train("metaspace"))


@pytest.fixture
def hf_cache(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A local Hugging Face cache holding ``model_dir`` as the snapshot of ``test-org/tiny-chat``."""
    snapshot = tmp_path / "hub" / "models--test-org--tiny-chat" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    refs = tmp_path / "hub" / "models--test-org--tiny-chat" / "refs"
    refs.mkdir()
    (refs / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    yield tmp_path / "hub"


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> object:
    """The Llama-3-style tokenizer, cutting pieces at every boundary (8 bytes at least)."""
    from kvroute_tokenizer_prefix import load_tokenizer

    return load_tokenizer(model_dir, piece_bytes=8)


@pytest.fixture(scope="session")
def gpt2(gpt2_model_dir: Path) -> object:
    """The GPT-2-style tokenizer, cutting pieces at every boundary (8 bytes at least)."""
    from kvroute_tokenizer_prefix import load_tokenizer

    return load_tokenizer(gpt2_model_dir, piece_bytes=8)


@pytest.fixture(scope="session")
def metaspace(metaspace_model_dir: Path) -> object:
    """The SentencePiece-style tokenizer (tokenized whole)."""
    from kvroute_tokenizer_prefix import load_tokenizer

    return load_tokenizer(metaspace_model_dir, piece_bytes=8)
