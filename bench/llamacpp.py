"""Step times of stock llama.cpp (an exported GGUF, llama-cpp-python's low-level API) against our
PyTorch eager step at the same dims, and greedy decoding speed on the sample prompts.

    python bench/llamacpp.py [--repeats 20] [--context 256] [--threads 1 2]

Needs the `make llamacpp` build. Every candidate of one table runs alternately (A B C A B C ...,
clover.utils.timing), so load from other processes hits all alike; each cell is the median, with
the floor (fastest run) beside it. Block steps are all-logits decodes of B tokens after a cached
prefix: for llama.cpp on a scratch sequence copied from the committed one (untimed), for Clover the
draft-window forward (not committed). llama.cpp runs with its defaults (f16 K/V, flash attention auto).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from clover.api import DEFAULT_MODEL, generate, load
from clover.backends.gguf_export import export_gguf
from clover.backends.llamacpp import SAMPLE_PROMPTS, LlamaCppModel, find_build, greedy_ar
from clover.models import CloverForBlockDiffusion, preset_config
from clover.utils.timing import time_alternately

BLOCKS = (8, 16, 32)


def timed(fn, samples: list):
    def run():
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return run


def models(tmp: Path):
    """(label, model folder): the shipped default model and a random clover-small (8 layers, 16 experts)."""
    yield "default (hidden 256, 4 layers, 8 experts)", DEFAULT_MODEL
    small = tmp / "clover-small"
    torch.manual_seed(0)
    CloverForBlockDiffusion(preset_config("clover-small")).save_pretrained(small)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEFAULT_MODEL / f, small / f)
    yield "clover-small (hidden 256, 8 layers, 16 experts)", small


def step_table(label, folder, tmp, args):
    files = {}
    for outtype in ("f32", "bf16", "q4_0"):
        files[outtype] = tmp / f"{folder.name}-{outtype}.gguf"
        export_gguf(folder, files[outtype], outtype)
    model, _ = load(folder, "cpu")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(2, vocab, (1, args.context), generator=g)
    step_ids = torch.randint(2, vocab, (1, max(BLOCKS)), generator=g)
    print(f"\n**{label}**, cached prefix of {args.context} tokens; ms per step, median (floor)\n")
    head = ["threads", "clover torch f32 AR"] + [f"clover torch f32 {b}-tok" for b in BLOCKS]
    for t in files:
        head += [f"llama.cpp {t} AR"] + [f"llama.cpp {t} {b}-tok" for b in BLOCKS]
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        cache = model.new_cache(1, capacity=args.context + 2 * max(BLOCKS))
        with torch.inference_mode():
            model(prefix, cache=cache)
        snap = cache.snapshot()
        cands, samples, setups = {}, {}, {}

        def add(name, fn, setup=None):
            samples[name] = []
            cands[name] = timed(fn, samples[name])
            if setup:
                setups[name] = setup

        one = step_ids[:, :1]
        add("torch AR", lambda: model(one, cache=cache), lambda: cache.restore(snap))
        for b in BLOCKS:
            blk = step_ids[:, :b]
            add(f"torch {b}", lambda blk=blk, b=b: model(blk, cache=cache, block_size=b, draft_len=b))
        cpps = {}
        for t, path in files.items():
            cpp = cpps[t] = LlamaCppModel(path, rows=2, threads=threads, n_ctx=args.context + 2 * max(BLOCKS))
            cpp.decode([prefix[0].tolist(), []], logits="last")
            toks = step_ids[0].tolist()
            add(f"{t} AR", lambda cpp=cpp: cpp.decode([[], toks[:1]], logits="all"), lambda cpp=cpp: cpp.fork(0, 1))
            for b in BLOCKS:
                add(f"{t} {b}", lambda cpp=cpp, b=b: cpp.decode([[], toks[:b]], logits="all"), lambda cpp=cpp: cpp.fork(0, 1))
        with torch.inference_mode():
            time_alternately(cands, repeats=args.repeats, warmup=3, setup=lambda name: setups.get(name, lambda: None)())
        for cpp in cpps.values():
            cpp.close()
        cells = [f"{statistics.median(s[3:]) * 1e3:.2f} ({min(s[3:]) * 1e3:.2f})" for s in samples.values()]
        rows.append([str(threads)] + cells)
    # one table per thread count would be wide either way: transpose (candidates as rows)
    print("| step | " + " | ".join(f"{r[0]} thread{'s' if r[0] != '1' else ''}" for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for i, name in enumerate(head[1:]):
        print(f"| {name} | " + " | ".join(r[i + 1] for r in rows) + " |")


def decode_table(tmp, args):
    """Greedy tokens/s on the 20 sample prompts, one prompt at a time, 32 new tokens (no EOS stop)."""
    model, tok = load(DEFAULT_MODEL, "cpu")
    torch.set_num_threads(1)
    n = 32
    print(f"\n**Greedy decoding, shipped default model, {len(SAMPLE_PROMPTS)} sample prompts one at a time, "
          f"{n} new tokens, 1 thread** (tokens/s over all prompts; clover's EOS stops count fewer tokens)\n")
    print("| decoder | tokens/s | tokens per forward |")
    print("|---|---:|---:|")
    for mode, bs in (("ar", 1), ("low_confidence", 8), ("low_confidence", 16), ("low_confidence", 32)):
        toks = fwd = 0
        start = time.perf_counter()
        for p in SAMPLE_PROMPTS:
            r = generate(model, tok, p, max_new_tokens=n, mode=mode, block_size=bs)
            toks, fwd = toks + len(r.token_ids), fwd + r.forward_passes
        secs = time.perf_counter() - start
        name = "clover torch f32 ar" if mode == "ar" else f"clover torch f32 low_confidence B={bs}"
        print(f"| {name} | {toks / secs:.1f} | {toks / max(fwd, 1):.2f} |")
    for outtype in ("f32", "bf16", "q4_0"):
        path = tmp / f"default-{outtype}.gguf"
        with LlamaCppModel(path, threads=1) as cpp:
            ids = [cpp.tokenize(p) for p in SAMPLE_PROMPTS]
            start = time.perf_counter()
            toks = sum(len(greedy_ar(cpp, i, n)) for i in ids)
            secs = time.perf_counter() - start
        print(f"| stock llama.cpp {outtype} AR | {toks / secs:.1f} | 1.00 |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    build = find_build()
    if build is None:
        print("bench/llamacpp.py: no llama.cpp build (make llamacpp)", file=sys.stderr)
        return 2
    print(f"`python bench/llamacpp.py --repeats {args.repeats} --context {args.context} --threads "
          f"{' '.join(map(str, args.threads))}` (llama.cpp from llama-cpp-python 0.3.36's sdist, torch {torch.__version__})")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for label, folder in models(tmp):
            step_table(label, Path(folder), tmp, args)
        decode_table(tmp, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
