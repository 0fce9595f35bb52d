"""`clover bench pareto`: the speed-quality curve, suite accuracy against tokens per forward and
tokens/s for ar, self_spec per block size and low_confidence over thresholds x block sizes, the
Pareto front and d3LLM's AUP (the evaluation itself and AUP's definition: clover.eval.pareto)."""

from __future__ import annotations

import os

from ..errors import UserError
from .report import load_checked, markdown_table, progress_iter, write_json


def run(args) -> int:
    import torch

    from ..api import eos_ids
    from ..eval import pareto

    try:
        thresholds = [float(x) for x in args.thresholds.split(",") if x]
        blocks = [int(x) for x in args.block_sizes.split(",") if x]
    except ValueError as e:
        raise UserError(f"--thresholds / --block-sizes: {e}") from None
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(pareto.MODES):
        raise UserError(f"--modes: a comma list of {', '.join(pareto.MODES)}, got {args.modes!r}")
    if not thresholds or not blocks or args.batch < 1 or args.per_task < 0:
        raise UserError("need at least one threshold and block size, --batch >= 1, --per-task >= 0")
    if args.plot is not None and not str(args.plot).endswith(".png"):
        raise UserError(f"--plot must name a .png file, got {args.plot}")
    model, tokenizer = load_checked(args, blocks, low=2, flag="--block-sizes")
    exs = pareto.examples(args.per_task)
    eos = eos_ids(model, tokenizer)
    settings = pareto.settings([m for m in modes if not (m == "ar" and args.no_ar)], blocks, thresholds)
    rows = []
    with torch.inference_mode():
        pareto.evaluate(model, tokenizer, exs[:2], *settings[0], args.batch, eos)  # warm-up
        for mode, b, t in progress_iter(settings, "bench pareto"):
            rows.append(pareto.evaluate(model, tokenizer, exs, mode, b, t, args.batch, eos))
    described = args.model or "default model"
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        pareto.plot(rows, args.plot, f"Clover speed-quality curve: {described}, {len(exs)} held-out prompts")
    front = pareto.pareto_front(rows)
    names = list(rows[0]["per_task"])
    print(f"Speed-quality curve: {described}; {len(exs)} held-out prompts ({args.per_task or 'all'} per synthetic task: "
          f"{', '.join(names)}), exact match, greedy, batches of {args.batch}, {model.device} "
          f"{str(model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads. TPF = generated tokens / "
          f"forwards per row; tokens/s = batched wall-clock throughput. * = on the accuracy-TPF Pareto front.\n")
    table = [[r["mode"], r["block_size"], "-" if r["threshold"] is None else f"{r['threshold']:g}",
              f"{100 * r['accuracy']:.1f}" + (" *" if i in front else ""), f"{r['tpf']:.2f}", f"{r['tokens_per_second']:.1f}",
              *(f"{100 * r['per_task'][n]:.0f}" for n in names)] for i, r in enumerate(rows)]
    print(markdown_table(["mode", "block", "threshold", "accuracy %", "TPF", "tokens/s", *names], table))
    scores = pareto.aup_report(rows, args.aup_y_max)
    print("\nPareto front (accuracy %, TPF): " + ", ".join(
        f"{rows[i]['mode']} {rows[i]['block_size']}" + (f"/{rows[i]['threshold']:g}" if rows[i]["threshold"] else "")
        + f" ({100 * rows[i]['accuracy']:.1f}, {rows[i]['tpf']:.2f})"
        for i in sorted(front, key=lambda i: rows[i]["tpf"])))
    print(f"\nAUP (d3LLM's accuracy under parallelism, clover/eval/pareto.py; y_max {scores['y_max']:.1f}): "
          f"{scores['front']:.1f} on the Pareto front; per curve with ar: "
          + ", ".join(f"{k} {v:.1f}" for k, v in scores["per_curve"].items()))
    if args.plot:
        print(f"\n![accuracy against tokens per forward and tokens/s]({args.plot})")
    write_json(args, dict(model=described, prompts=len(exs), per_task=args.per_task, batch=args.batch, results=rows,
                          pareto_front=sorted(front), aup=scores))
    return 0
