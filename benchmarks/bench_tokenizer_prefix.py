"""Benchmark the tokenizer-prefix strategy's decision latency and index memory (not a test).

Usage: python benchmarks/bench_tokenizer_prefix.py [--tokenizer DIR] [--repeat N] [--json FILE]

Without ``--tokenizer`` a byte-level BPE (Llama-3 split regex, 8,000-entry vocabulary) is
trained here on generated English-like text: no download. The prompts are chat requests of
about 8,000 tokens: a system prompt, a document, a question. Scenarios, 8 backends, block size 16:

* ``warm``: the document was routed before (its blocks are in the index, its pieces in the
  tokenizer cache); each request asks a new question, so its last piece is tokenized fresh.
* ``cold``: a document nobody has seen (nothing matches: hashing stops after the first blocks).
* ``cold-shared-system``: a new document after a system prompt every backend already holds.
* ``record``: ``on_request_start`` after a warm pick (hash the rest, touch the index).
* ``record-cold``: ``on_request_start`` of a cold request (tokenizes the whole prompt: the
  cost of a prompt's first sighting, paid once).
* ``encode-whole``: the ``tokenizers`` library encoding the whole rendered prompt, for scale.

Prints medians and p99 in microseconds, and the index's bytes per block (tracemalloc).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from kvroute_tokenizer_prefix import BlockIndex, TokenizerPrefix, block_hashes

import kvroute

SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _lexicon(rng: random.Random) -> list[str]:
    syl = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    return sorted({"".join(rng.choice(syl) for _ in range(rng.choice((1, 2, 2, 3)))) for _ in range(6000)})


def text_source(seed: int) -> Callable[[int], str]:
    """A function returning ``n`` words of English-like text with sentences and paragraphs."""
    rng = random.Random(seed)
    words = _lexicon(random.Random(1))
    weights = [1.0 / (r + 1) ** 0.8 for r in range(len(words))]

    def make(n: int) -> str:
        out: list[str] = []
        while len(out) < n:
            sentence = rng.choices(words, weights=weights, k=rng.randint(6, 24))
            sentence[0] = sentence[0].capitalize()
            out.extend(sentence[:-1])
            out.append(sentence[-1] + rng.choice(".....,?!") + ("\n\n" if rng.random() < 0.15 else ""))
        return " ".join(out[:n])

    return make


def build_tokenizer(folder: Path) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=8000, min_frequency=2, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    make = text_source(99)
    tok.train_from_iterator((make(40) for _ in range(20000)), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>"))])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def percentiles(samples: list[float], cpu: list[float] | None = None) -> dict[str, float]:
    """Wall-clock p50/p99 and, when given, the p50 of the thread's CPU time (robust on a busy machine)."""
    ordered = sorted(samples)
    out = {
        "p50_us": round(statistics.median(ordered) * 1e6, 1),
        "p99_us": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6, 1),
        "n": len(ordered),
    }
    if cpu:
        out["cpu_p50_us"] = round(statistics.median(cpu) * 1e6, 1)
    return out


_CPU: list[float] = []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", help="a model directory or tokenizer.json to use instead of the trained one")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--backends", type=int, default=8)
    parser.add_argument("--piece-bytes", type=int, default=512, help="the strategy's piece_bytes option")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        source = args.tokenizer or str(build_tokenizer(Path(tmp) / "model"))
        setup_s = time.perf_counter() - t0
        strategy = TokenizerPrefix(tokenizer=source, block_size=16, max_prefix_tokens=8192, piece_bytes=args.piece_bytes)
        fleet = kvroute.Fleet([kvroute.Backend(f"b{i}") for i in range(args.backends)])
        router = kvroute.Router(fleet, strategy, strategy_name="tokenizer-prefix")
        candidates = fleet.candidates("m")
        tok: Any = strategy.prompt_tokenizer
        make = text_source(7)
        system = make(150)

        def body(doc: str, question: str, sys_prompt: str = system) -> dict[str, Any]:
            return {"model": "m", "messages": [{"role": "system", "content": sys_prompt}, {"role": "user", "content": doc + "\n\nQuestion: " + question}]}

        # Size documents so that the whole prompt is about 8,000 tokens.
        probe = make(6000)
        n_tokens = len(tok.encode_text(tok.render(kvroute.RouteRequest.from_openai(body(probe, "x")))))
        words = int(6000 * 8000 / n_tokens)
        docs = [make(words) for _ in range(16)]
        for doc in docs:  # the prefixes are routed once: their blocks are in the index
            with router.route(kvroute.RouteRequest.from_openai(body(doc, make(12)))):
                pass
        sample = kvroute.RouteRequest.from_openai(body(docs[0], "what?"))
        prompt_tokens = len(tok.encode_text(tok.render(sample)))
        rng = random.Random(3)
        results: dict[str, Any] = {"prompt_tokens": prompt_tokens, "backends": args.backends, "block_size": 16, "tokenizer": "trained-bpe-8k" if not args.tokenizer else args.tokenizer}

        def timed(build: Callable[[int], kvroute.RouteRequest], after: Callable[[kvroute.RouteRequest, kvroute.Decision], None] | None = None) -> list[float]:
            out = []
            _CPU.clear()
            for i in range(args.repeat):
                request = build(i)
                gc.disable()
                c = time.thread_time()
                t = time.perf_counter()
                decision = strategy.pick(request, candidates)
                out.append(time.perf_counter() - t)
                _CPU.append(time.thread_time() - c)
                gc.enable()
                if after is not None:
                    after(request, decision)
            return out

        warm = timed(lambda i: kvroute.RouteRequest.from_openai(body(docs[rng.randrange(16)], make(12))))
        results["warm"] = percentiles(warm, _CPU)
        cold = timed(lambda i: kvroute.RouteRequest.from_openai(body(make(words), make(12), sys_prompt=make(150))))
        results["cold"] = percentiles(cold, _CPU)
        # Every backend holds the shared system prompt: a new document still stops hashing right after it.
        for b in fleet.candidates("m"):
            strategy.index.record(b.id, strategy.prompt_blocks(kvroute.RouteRequest.from_openai(body("", ""))).complete()[:9])
        shared_cold = timed(lambda i: kvroute.RouteRequest.from_openai(body(make(words), make(12))))
        results["cold-shared-system"] = percentiles(shared_cold, _CPU)

        record: list[float] = []

        record_cpu: list[float] = []

        def start(request: kvroute.RouteRequest, decision: kvroute.Decision) -> None:
            c = time.thread_time()
            t = time.perf_counter()
            strategy.on_request_start(request, decision)
            record.append(time.perf_counter() - t)
            record_cpu.append(time.thread_time() - c)

        timed(lambda i: kvroute.RouteRequest.from_openai(body(docs[rng.randrange(16)], make(12))), start)
        results["record"] = percentiles(record, record_cpu)
        record.clear()
        record_cpu.clear()
        timed(lambda i: kvroute.RouteRequest.from_openai(body(make(words), make(12), sys_prompt=make(150))), start)
        results["record-cold"] = percentiles(record, record_cpu)

        texts = [tok.render(kvroute.RouteRequest.from_openai(body(make(words), "q"))) for _ in range(20)]
        encode, encode_cpu = [], []
        for text in texts:
            c = time.thread_time()
            t = time.perf_counter()
            tok.tokenizer.encode(text, add_special_tokens=False)
            encode.append(time.perf_counter() - t)
            encode_cpu.append(time.thread_time() - c)
        results["encode-whole"] = percentiles(encode, encode_cpu)
        results["load_average"] = os.getloadavg()[0]

        # Memory of the index: one backend, 100,000 distinct blocks.
        tracemalloc.start()
        index = BlockIndex(block_size=16, capacity_blocks=200_000)
        hashes = block_hashes(range(16 * 100_000), 16)
        before = tracemalloc.get_traced_memory()[0]
        index.record("a", hashes)
        one = tracemalloc.get_traced_memory()[0] - before
        index.record("b", hashes)
        two = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        results["index_bytes_per_block_first_backend"] = round(one / len(hashes), 1)
        results["index_bytes_per_block_more_backends"] = round((two - one) / len(hashes), 1)
        results["piece_cache_tokens"] = getattr(tok, "cached_tokens", None)
        results["setup_s"] = round(setup_s, 1)

    for name in ("warm", "cold", "cold-shared-system", "record", "record-cold", "encode-whole"):
        r = results[name]
        print(f"{name:20s} p50 {r['p50_us']:9.1f} us   p99 {r['p99_us']:9.1f} us   cpu p50 {r.get('cpu_p50_us', 0):9.1f} us   (n={r['n']})")
    print(f"prompt tokens {results['prompt_tokens']}, backends {args.backends}, block size 16, tokenizer {results['tokenizer']}, load average {results['load_average']:.2f}")
    print(
        f"index: {results['index_bytes_per_block_first_backend']} bytes per block for the first backend holding it, "
        f"{results['index_bytes_per_block_more_backends']} for each further backend"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
