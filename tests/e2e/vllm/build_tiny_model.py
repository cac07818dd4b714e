"""Build a tiny random-weight Llama and a byte-level BPE tokenizer for end-to-end tests, with no downloads.

Usage: python build_tiny_model.py OUTPUT_DIR [--seed N] [--vocab-size N] [--force]

Needs torch, transformers and tokenizers (all present in the vLLM virtualenv). The output is a directory that
``vllm.entrypoints.openai.api_server --model OUTPUT_DIR`` serves: config.json, generation_config.json,
model.safetensors, tokenizer.json and tokenizer_config.json (with a chat template). For a given seed and
library versions the files are byte-for-byte the same on every run.

The model knows nothing: its outputs are random tokens. It exists so that a real engine tokenizes, schedules,
caches prefixes and emits metrics and KV events the way it does for a real model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path

# Tokenizer training uses rayon threads; one thread keeps the merge order independent of scheduling.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BOS = "<|begin|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
END_OF_TURN = "<|eot|>"
ROLE_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, END_OF_TURN, *ROLE_MARKERS)

# Renders "<|begin|><|user|>\nHello<|eot|>\n<|assistant|>\n" for one user message with add_generation_prompt.
# Content given as a list of OpenAI parts is joined from its text parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '<|eot|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Model shape: small enough to build in seconds and serve on one CPU core, large enough to look like a Llama.
MODEL_SHAPE = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
}


def _corpus(seed: int, lines: int = 20_000) -> list[str]:
    """Generate English-looking text from a seeded lexicon of made-up words, punctuation and digits."""
    rng = random.Random(seed)
    consonants = "bcdfghjklmnprstvwz"
    vowels = "aeiou"

    def word() -> str:
        syllables = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        return "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(syllables))

    lexicon = sorted({word() for _ in range(3000)})
    # Zipf-like weights so that frequent words earn whole-word merges.
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    rng.shuffle(lexicon)
    text = []
    for _ in range(lines):
        n = rng.randint(4, 24)
        words = rng.choices(lexicon, weights=weights, k=n)
        if rng.random() < 0.2:
            words.insert(rng.randrange(n), str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(".....?!:;")
        text.append(sentence)
    return text


def build_tokenizer(out: Path, seed: int, vocab_size: int) -> int:
    """Train a byte-level BPE tokenizer, write tokenizer.json and tokenizer_config.json; return its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    # Like Llama: encode(..., add_special_tokens=True) prepends BOS; the chat template writes BOS itself.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)

    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_SHAPE["max_position_embeddings"],
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, sort_keys=True) + "\n")
    return tokenizer.get_vocab_size(with_added_tokens=True)


def build_model(out: Path, seed: int, vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> None:
    """Initialise a random Llama from a seed and save it with save_pretrained (safetensors, bfloat16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        torch_dtype="bfloat16",
        **MODEL_SHAPE,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(out, safe_serialization=True)


def _digest(out: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(out.iterdir()):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory looks complete")
    args = parser.parse_args(argv)

    out: Path = args.output_dir
    marker = out / "kvroute-tiny-model.json"
    wanted = {"seed": args.seed, "vocab_size": args.vocab_size, **MODEL_SHAPE}
    if not args.force and marker.is_file():
        try:
            done = json.loads(marker.read_text())
        except ValueError:
            done = None
        if done and done.get("params") == wanted:
            print(f"tiny model already built in {out} (sha256 {done['sha256']})")
            return 0

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab = build_tokenizer(tmp, args.seed, args.vocab_size)

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in (BOS, EOS, PAD)}
    build_model(tmp, args.seed, vocab, ids[BOS], ids[EOS], ids[PAD])
    digest = _digest(tmp)
    (tmp / marker.name).write_text(json.dumps({"params": wanted, "sha256": digest}, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"built tiny model in {out}: vocab {vocab}, sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
