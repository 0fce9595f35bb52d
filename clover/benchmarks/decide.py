"""`clover bench decide`: joint vs independent decision mode on the held-out split of the decision
benchmark (clover.data.tasks.decision_benchmark): accuracy, forwards, model calls, seconds per group."""

from __future__ import annotations

import sys

from ..errors import UserError
from .report import markdown_table, set_threads, write_json


def _spoken(value) -> str:
    return ("yes" if value else "no") if isinstance(value, bool) else str(value)


def run(args) -> int:
    """Joint vs independent decision mode on the held-out split of the decision benchmark."""
    import torch
    from tqdm import tqdm

    from ..api import DEFAULT_MODEL, load
    from ..data.tasks import decision_benchmark
    from ..decision import decide
    from ..settings import infill_settings

    if args.groups < 1:
        raise UserError("--groups must be >= 1")
    if not args.model and not (DEFAULT_MODEL / "config.json").is_file():
        raise UserError(f"no default model at {DEFAULT_MODEL} (build it with `make model`) and no --model given")
    set_threads(args.threads)
    model, tokenizer = load(args.model, args.device)
    _, groups = decision_benchmark(args.seed, n_heldout=args.groups)
    modes = ("joint", "independent")
    totals = {m: dict(right=0, groups_right=0, forwards=0, calls=0, prompt=0, seconds=0.0) for m in modes}
    questions = sum(len(g["questions"]) for g in groups)
    for i, g in enumerate(tqdm(groups, desc="bench decide", file=sys.stderr, leave=False)):
        asked = [{"question": q, **spec} for q, spec in zip(g["questions"], g["specs"])]
        for mode in modes if i % 2 == 0 else modes[::-1]:  # alternate the order: equal share of any contention
            with torch.inference_mode():
                d = decide(model, tokenizer, g["material"], asked, mode=mode, threshold=args.threshold,
                           block_size=args.block_size)
            right = [_spoken(a.answer) == want for a, want in zip(d.answers, g["answers"])]
            t = totals[mode]
            t["right"] += sum(right)
            t["groups_right"] += all(right)
            t["forwards"] += d.forward_passes
            t["calls"] += d.model_calls
            t["prompt"] += d.prompt_tokens
            t["seconds"] += d.seconds
    n = len(groups)
    rows, results = [], []
    for mode in modes:
        t = totals[mode]
        r = dict(mode=mode, questions_right=100 * t["right"] / questions, groups_all_right=100 * t["groups_right"] / n,
                 forward_passes_per_group=t["forwards"] / n, model_calls_per_group=t["calls"] / n,
                 prompt_tokens_per_group=t["prompt"] / n, seconds_per_group=t["seconds"] / n)
        results.append(r)
        rows.append([mode, f"{r['questions_right']:.1f}%", f"{r['groups_all_right']:.1f}%",
                     f"{r['forward_passes_per_group']:.2f}", f"{r['model_calls_per_group']:.2f}",
                     f"{r['prompt_tokens_per_group']:.0f}", f"{r['seconds_per_group']:.3f}"])
    # chance: a uniform pick among each question's allowed answers (options, yes/no, 0..99 for 2 digits)
    from ..decision import parse_question

    def allowed(q, spec) -> int:
        parsed = parse_question({"question": q, **spec})
        return len(parsed.options) if parsed.options else 10 ** parsed.max_tokens

    odds = [[1 / allowed(q, s) for q, s in zip(g["questions"], g["specs"])] for g in groups]
    chance_q = 100 * sum(map(sum, odds)) / questions
    chance_g = 100 * sum(__import__("math").prod(o) for o in odds) / n
    rows.append(["chance (uniform over allowed answers)", f"{chance_q:.1f}%", f"{chance_g:.1f}%", "-", "-", "-", "-"])
    described = args.model or "default model"
    threshold, block = infill_settings(model, args.threshold, args.block_size)  # what decide committed at
    print(f"Joint decision mode: {described}; held-out split of the decision benchmark (seed {args.seed}), {n} groups / "
          f"{questions} questions (2-8 linked questions each); threshold {threshold}, block {block or 'published'}, "
          f"{model.device} {str(model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads.\n")
    print("Forward passes = per-row decoding forwards summed over the group's rows (independent: one row per "
          "question, batched; prefill not counted); model calls = batched forwards; prompt tokens = tokens prefilled "
          "(independent reads the material once per question).\n")
    print(markdown_table(["mode", "questions right", "groups all right", "forward passes / group",
                          "model calls / group", "prompt tokens / group", "s / group"], rows))
    write_json(args, dict(model=described, seed=args.seed, groups=n, questions=questions, threshold=threshold,
                          chance=dict(questions_right=chance_q, groups_all_right=chance_g),
                          block_size=block, threads=torch.get_num_threads(), results=results))
    return 0
