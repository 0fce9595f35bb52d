"""`clover bench calibration`: per low_confidence threshold, the share of tokens committed in parallel
that differ from ar's choice, against the bound 1 - threshold (clover.eval.calibration says how)."""

from __future__ import annotations

from ..errors import UserError
from .report import load_checked, markdown_table, write_json


def run(args) -> int:
    try:
        thresholds = [float(x) for x in args.thresholds.split(",") if x]
    except ValueError as e:
        raise UserError(f"--thresholds: {e}") from None
    if not thresholds or any(not 0 < t <= 1 for t in thresholds) or args.batch < 1 or args.per_task < 0:
        raise UserError("need thresholds in (0, 1], --batch >= 1, --per-task >= 0")
    import torch

    from ..api import eos_ids
    from ..eval import pareto
    from ..eval.calibration import calibration

    model, tokenizer = load_checked(args, [args.block_size], low=2)
    exs = pareto.examples(args.per_task)
    with torch.inference_mode():
        rows = calibration(model, tokenizer, exs, args.block_size, thresholds, args.batch, eos_ids(model, tokenizer))
    described = args.model or "default model"
    print(f"Calibration: {described}; {len(exs)} held-out task prompts ({args.per_task or 'all'} per task), "
          f"low_confidence at block {args.block_size}, greedy. Parallel = tokens committed in a forward that "
          f"committed more than one; error = share of those that differ from ar's choice after the same prefix "
          f"(calibrated: error <= 1 - threshold); vs ar output = position-wise against the ar decode.\n")
    table = [[f"{r['threshold']:g}", r["tokens"], r["parallel"], f"{100 * r['parallel_share']:.1f}",
              f"{100 * r['error_rate']:.1f}", f"{100 * r['bound']:.1f}", "yes" if r["calibrated"] else "NO",
              f"{100 * r['error_rate_vs_ar_output']:.1f}", f"{r['tpf']:.2f}"] for r in rows]
    print(markdown_table(["threshold", "tokens", "parallel", "parallel %", "error %", "bound %", "calibrated",
                          "vs ar output %", "TPF"], table))
    write_json(args, dict(model=described, prompts=len(exs), per_task=args.per_task, results=rows))
    return 0
