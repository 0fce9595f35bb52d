"""`clover bench NAME`: benchmarks that print a markdown table (and can write JSON).

Each benchmark is a pair in BENCHMARKS: `register(parser)` adding its flags and `run(args)`.
Add one (e.g. `pareto`) by writing those two functions and one line in BENCHMARKS. Timings follow
design-notes section 5: warm up, run candidates alternately in one process, report medians.
"""

from __future__ import annotations

import json
import os
import sys

from . import UserError


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (markdown tables; --json for programs)")
    benches = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    for name, (add_flags, run, help_text) in BENCHMARKS.items():
        q = benches.add_parser(name, help=help_text)
        q.add_argument("--json", metavar="FILE", help="also write the results as JSON")
        q.add_argument("--threads", type=int, help="torch threads (default: all cores)")
        add_flags(q)
        q.set_defaults(func=run)
    p.set_defaults(func=lambda args: (_ for _ in ()).throw(UserError(f"name a benchmark: {', '.join(BENCHMARKS)}")))


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---- decode -----------------------------------------------------------------------------------------
def add_decode_flags(p) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model folder (default: the shipped default model)")
    src.add_argument("--preset", help="a random-weight preset instead (default when no default model exists)")
    p.add_argument("--device", default=None)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")


def decode_model(args):
    """(model, prompt ids, description, random?) for `bench decode`."""
    import torch

    from ..api import DEFAULT_MODEL, encode, load
    from ..models import PRESETS, CloverForBlockDiffusion, preset_config

    if args.model or (not args.preset and (DEFAULT_MODEL / "config.json").is_file()):
        model, tokenizer = load(args.model, args.device)
        text = "Write a short story about a robot who learns to paint. " * 16
        ids = encode(tokenizer, text)[: args.prompt_tokens]
        return model, ids, args.model or "default model", False
    name = args.preset or "clover-small"
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(preset_config(name)).to(args.device or "cpu").eval()
    ids = torch.randint(0, model.config.mask_token_id, (args.prompt_tokens,)).tolist()
    return model, ids, f"{name}, random weights", True


def run_decode(args) -> int:
    import torch
    from tqdm import tqdm

    from ..engine import DecodeConfig, Engine
    from ..utils.timing import time_alternately

    for flag in ("prompt_tokens", "max_new_tokens", "repeats"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    model, prompt, described, random_weights = decode_model(args)
    n = args.max_new_tokens
    configs = {
        "low_confidence t=0.90": DecodeConfig(threshold=0.90),
        "low_confidence t=0.95": DecodeConfig(threshold=0.95),
        "self_spec": DecodeConfig(mode="self_spec"),
        "ar": DecodeConfig(mode="ar"),
    }
    last = {}  # name -> (tokens, forwards) of the latest run; EOS off so every run makes n tokens

    def engine_run(name, cfg):
        cfg.block_size, cfg.max_new_tokens = args.block_size, n
        def go():
            seq = Engine(model, cfg).generate([prompt])[0]
            last[name] = (len(seq.token_ids), seq.forward_passes)
        return go

    candidates = {name: engine_run(name, cfg) for name, cfg in configs.items()}
    if not args.no_hf:
        from ..convert.mapping import qwen3next_twin

        hf = qwen3next_twin(model.config).to(model.device, model.dtype).eval()
        ids = torch.tensor([prompt], device=model.device)

        def hf_go():
            with torch.inference_mode():
                out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            last["transformers generate"] = (out.shape[1] - ids.shape[1], out.shape[1] - ids.shape[1])
        candidates["transformers generate"] = hf_go
    bar = tqdm(total=(1 + args.repeats) * len(candidates), desc="bench decode", file=sys.stderr, leave=False)
    with torch.inference_mode():
        seconds = time_alternately(candidates, repeats=args.repeats, warmup=1, setup=lambda name: bar.update())
    bar.close()
    rate = {name: last[name][0] / s for name, s in seconds.items()}
    rows, results = [], []
    for name, s in seconds.items():
        tokens, forwards = last[name]
        r = dict(mode=name, tokens=tokens, forwards=forwards, tpf=tokens / forwards, seconds=s, tokens_per_second=rate[name],
                 vs_ar=rate[name] / rate["ar"], vs_transformers=rate[name] / rate["transformers generate"] if not args.no_hf else None)
        results.append(r)
        rows.append([name, tokens, forwards, f"{r['tpf']:.2f}", f"{s:.3f}", f"{r['tokens_per_second']:.1f}",
                     f"{r['vs_ar']:.2f}x", "-" if r["vs_transformers"] is None else f"{r['vs_transformers']:.2f}x"])
    print(f"Decode speed: {described}; prompt {len(prompt)} tokens, {n} new tokens, block {args.block_size}, "
          f"{model.device} {str(model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} alternating runs.\n")
    if random_weights:
        print("Note: random weights (no trained default model yet): confidences are low, so low_confidence fills "
              "about one token per step and self_spec drafts are rarely accepted; TPF targets need the trained model.\n")
    print(markdown_table(["mode", "tokens", "forwards", "TPF", "median s", "tokens/s", "vs ar", "vs transformers"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=described, random_weights=random_weights, prompt_tokens=len(prompt), max_new_tokens=n,
                           block_size=args.block_size, threads=torch.get_num_threads(), results=results), f, indent=2)
    return 0


BENCHMARKS = {
    "decode": (add_decode_flags, run_decode, "tokens/s and tokens per forward of each decoding mode vs transformers"),
}
