"""`clover bench decode`: tokens/s and tokens per forward of each decoding mode against transformers'
`generate` on the same dimensions (a Qwen3-Next twin), on a story prompt or the held-out task prompts.
Timings follow clover/utils/timing.py: warm up, run candidates alternately in one process, report medians."""

from __future__ import annotations

import sys

from ..errors import UserError
from .report import markdown_table, set_threads, write_json


LONG_TOKENS = 256  # --workload long's tokens per prompt: outputs long enough that prefill does not dominate


def workload(args):
    """(model, [(prompt ids, max new tokens)], eos ids, description, random?) for `bench decode`."""
    import torch

    from ..api import DEFAULT_MODEL, encode, eos_ids, load
    from ..data.tasks import plain_prompt
    from ..eval import pareto
    from ..models import PRESETS, CloverForBlockDiffusion, preset_config

    if args.model or (not args.preset and (DEFAULT_MODEL / "config.json").is_file()):
        model, tokenizer = load(args.model, args.device)
        described = args.model or "default model"
        if args.workload == "tasks":
            exs = pareto.examples(args.per_task)
            jobs = [(encode(tokenizer, plain_prompt(ex)), ex["budget"]) for ex in exs]
            return model, jobs, eos_ids(model, tokenizer), f"{described}, {len(jobs)} held-out task prompts", False
        text = "Write a short story about a robot who learns to paint. " * 16
        return model, [(encode(tokenizer, text)[: args.prompt_tokens], args.max_new_tokens)], (), described, False
    if args.workload == "tasks":
        raise UserError("--workload tasks needs a trained model (--model or the shipped default model), not a preset")
    name = args.preset or "clover-small"
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(preset_config(name)).to(args.device or "cpu").eval()
    ids = torch.randint(0, model.config.mask_token_id, (args.prompt_tokens,)).tolist()
    return model, [(ids, args.max_new_tokens)], (), f"{name}, random weights", True


def long_run(args) -> int:
    """`--workload long` (benchmarks/decode_long.py): the default model or --model only."""
    from ..api import DEFAULT_MODEL, load
    from . import decode_long

    if args.preset or not (args.model or (DEFAULT_MODEL / "config.json").is_file()):
        raise UserError("--workload long needs a trained model (--model or the shipped default model), not a preset")
    if args.prompts < 1:
        raise UserError("--prompts must be >= 1")
    counts = decode_long.thread_counts(args.thread_counts)
    set_threads(counts[0])
    model, tokenizer = load(args.model, args.device)
    return decode_long.run(args, model, tokenizer)


def run(args) -> int:
    import torch
    from tqdm import tqdm

    from ..engine import DecodeConfig, Engine
    from ..utils.timing import time_alternately

    if getattr(args, "max_new_tokens", None) is None:
        from ..settings import DEFAULTS

        args.max_new_tokens = LONG_TOKENS if args.workload == "long" else DEFAULTS.max_new_tokens
    for flag in ("prompt_tokens", "max_new_tokens", "repeats", "per_task"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.workload == "long":
        return long_run(args)
    set_threads(args.threads)
    model, jobs, eos, described, random_weights = workload(args)
    configs = {
        "low_confidence t=0.90": DecodeConfig(threshold=0.90),
        "low_confidence t=0.95": DecodeConfig(threshold=0.95),
        "self_spec": DecodeConfig(mode="self_spec"),
        "ar": DecodeConfig(mode="ar"),
    }
    if getattr(args, "threshold", None) not in (None, 0.90, 0.95):  # --block-size auto tuned another threshold
        configs = {f"low_confidence t={args.threshold:.2f} (tuned)": DecodeConfig(threshold=args.threshold), **configs}
    last = {}  # name -> (tokens, forwards) of the latest run, summed over the workload's prompts
    ar_lengths = []  # tokens per prompt of our ar mode (transformers' twin makes as many)

    def engine_run(name, cfg):
        cfg = cfg.with_(block_size=args.block_size, eos_token_ids=eos, runner=args.runner)
        def go():
            lengths, forwards = [], 0
            for prompt, n in jobs:
                seq = Engine(model, cfg.with_(max_new_tokens=n)).generate([prompt])[0]
                lengths.append(len(seq.token_ids))
                forwards += seq.forward_passes
            last[name] = (sum(lengths), forwards)
            if name == "ar":
                ar_lengths[:] = lengths
        return go

    candidates = {name: engine_run(name, cfg) for name, cfg in configs.items()}
    if not args.no_hf:
        from ..convert.mapping import qwen3next_twin

        hf = qwen3next_twin(model.config).to(model.device, model.dtype).eval()

        def hf_go():
            # the twin has random weights (same dims), so it never stops by itself: it makes exactly
            # as many tokens per prompt as our ar mode did (ar runs first in every round)
            tokens = 0
            for (prompt, _), n in zip(jobs, ar_lengths):
                ids = torch.tensor([prompt], device=model.device)
                with torch.inference_mode():
                    out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
                tokens += out.shape[1] - ids.shape[1]
            last["transformers generate"] = (tokens, tokens)
        candidates["transformers generate"] = hf_go
    bar = tqdm(total=(1 + args.repeats) * len(candidates), desc="bench decode", file=sys.stderr, leave=False)
    with torch.inference_mode():
        seconds = time_alternately(candidates, repeats=args.repeats, warmup=1, setup=lambda name: bar.update())
    bar.close()
    rate = {name: last[name][0] / s for name, s in seconds.items()}
    per_forward = {name: s / last[name][1] for name, s in seconds.items()}
    rows, results = [], []
    for name, s in seconds.items():
        tokens, forwards = last[name]
        # tokens/s = TPF / (s per forward), so k times ar's tokens/s takes TPF = k * (s per forward) / ar's
        r = dict(mode=name, tokens=tokens, forwards=forwards, tpf=tokens / forwards, seconds=s, tokens_per_second=rate[name],
                 ms_per_forward=1e3 * per_forward[name], tpf_for_3x_ar=3 * per_forward[name] / per_forward["ar"],
                 vs_ar=rate[name] / rate["ar"], vs_transformers=rate[name] / rate["transformers generate"] if not args.no_hf else None)
        results.append(r)
        rows.append([name, tokens, forwards, f"{r['tpf']:.2f}", f"{s:.3f}", f"{r['tokens_per_second']:.1f}",
                     f"{r['ms_per_forward']:.2f}", f"{r['tpf_for_3x_ar']:.1f}" if name != "ar" else "-",
                     f"{r['vs_ar']:.2f}x", "-" if r["vs_transformers"] is None else f"{r['vs_transformers']:.2f}x"])
    if args.workload == "tasks":
        shape = f"{len(jobs)} prompts decoded one at a time until EOS or the task's answer budget"
    else:
        shape = f"prompt {len(jobs[0][0])} tokens, {jobs[0][1]} new tokens (EOS ignored)"
    print(f"Decode speed: {described}; {shape}, block {args.block_size}, {args.runner} runner, "
          f"{model.device} {str(model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} alternating runs (after one warm-up run each).\n")
    if random_weights:
        print("Note: random weights (no trained default model yet): confidences are low, so low_confidence fills "
              "about one token per step and self_spec drafts are rarely accepted; TPF targets need the trained model.\n")
    print(markdown_table(["mode", "tokens", "forwards", "TPF", "median s", "tokens/s", "ms / forward", "TPF for 3x ar",
                          "vs ar", "vs transformers"], rows))
    print("\nTPF for 3x ar: the tokens per forward a mode would need, at its measured time per forward, for 3x "
          "the tokens/s of ar (tokens/s = TPF / time per forward).")
    write_json(args, dict(model=described, random_weights=random_weights, workload=args.workload,
                          prompts=len(jobs), prompt_tokens=sum(len(p) for p, _ in jobs),
                          max_new_tokens=sum(n for _, n in jobs), block_size=args.block_size, runner=args.runner,
                          threads=torch.get_num_threads(), results=results))
    return 0
