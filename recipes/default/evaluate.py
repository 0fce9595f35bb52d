"""Evaluate a model on the held-out synthetic tasks with the decoding engine (clover.generate).

* plain prompts ("<prompt>\\n", answer = first generated line), decoded with `low_confidence`
  (threshold 0.95, block 32) and with `ar` (the same model at block size 1): accuracy per task,
  tokens per forward (all generated tokens / all forward passes);
* chat prompts on the arithmetic tasks with thinking on vs off (`low_confidence`), to show that
  `enable_thinking` changes what the model does.

    python recipes/default/evaluate.py [--model DIR] --tasks runs/default/data/eval_tasks.jsonl --out eval.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch


def score(examples, gens, chat: bool) -> dict:
    from clover.engine.trajectory import filled_in_order

    per, tok, fwd, in_order = defaultdict(lambda: [0, 0]), 0, 0, 0
    q_right = q_total = 0
    for ex, g in zip(examples, gens):
        text = g.text.strip()
        pred = text.split("\n")[0].strip() if not chat else text.strip().split("\n")[-1].strip()
        per[ex["task"]][0] += int(pred == ex["answer"])
        per[ex["task"]][1] += 1
        if ex["task"] == "group":  # per question: the "A<i>: <answer>" pieces
            got = {}
            for part in (" " + pred).split(" A")[1:]:
                k, _, v = part.partition(": ")
                got[k] = v.strip()
            q_right += sum(got.get(str(i + 1)) == a for i, a in enumerate(ex["answers"]))
            q_total += len(ex["answers"])
        tok += len(g.token_ids)
        fwd += g.forward_passes
        in_order += sum(filled_in_order(g.trajectory))
    right = sum(r for r, _ in per.values())
    total = sum(n for _, n in per.values())
    return {"accuracy": right / max(total, 1), "n": total, "tokens_per_forward": tok / max(fwd, 1),
            "generated_tokens": tok, "forward_passes": fwd, "filled_in_order": in_order / max(tok, 1),
            "per_task": {k: r / n for k, (r, n) in sorted(per.items())},
            **({"group_questions": q_right / q_total} if q_total else {})}


@torch.no_grad()
def heldout_losses(model, tok, path, rows, block, seq_len=128, batch=8) -> dict:
    """Per-token held-out losses of the (bf16) model in fp32: AR (block 1) and block diffusion at
    `block` (masked-diffusion ELBO, fixed noise seed), over the first `rows` packed rows."""
    from clover.data.dataset import encode_files, pack
    from clover.training.objectives import block_diffusion_loss

    ids, mask = encode_files([path], tok)
    ids, mask = pack(ids, mask, seq_len)
    ids, mask = ids[:rows], mask[:rows]
    m = model.float()
    gen = torch.Generator().manual_seed(1234)
    out = {"rows": int(ids.shape[0]), "seq_len": seq_len, "file": str(path)}
    for b in (1, block):
        num, den = 0.0, 0
        for i in range(0, ids.shape[0], batch):
            loss, n = block_diffusion_loss(m, ids[i:i + batch], mask[i:i + batch], b, generator=gen)
            num, den = num + float(loss) * n, den + n
        out["ar" if b == 1 else f"bd{b}"] = num / max(den, 1)
    return out


def run(model, tok, examples, mode, chat=False, think=False, block_size=32, threshold=0.95, max_new_tokens=48,
        batch=40):
    import clover
    from clover.data.tasks import plain_prompt

    gens = []
    for i in range(0, len(examples), batch):
        chunk = examples[i:i + batch]
        prompts = [ex["prompt"] for ex in chunk] if chat else [plain_prompt(ex) for ex in chunk]
        gens += clover.generate(model, tok, prompts, max_new_tokens=max_new_tokens, block_size=block_size,
                                threshold=threshold, mode=mode, chat=chat, think=think, trajectory=True)
    return gens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the shipped model)")
    ap.add_argument("--tasks", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--per-task", type=int, default=40, help="use only the first N prompts of each task (0 = all)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heldout", default=None, help="held-out JSONL for the losses (default: heldout.jsonl "
                    "beside --tasks, if present)")
    ap.add_argument("--heldout-rows", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import clover

    model, tok = clover.load(args.model, device="cpu")
    examples = [json.loads(line) for line in Path(args.tasks).read_text().splitlines() if line.strip()]
    if args.per_task:
        seen = defaultdict(int)
        keep = []
        for ex in examples:
            if seen[ex["task"]] < args.per_task:
                keep.append(ex)
                seen[ex["task"]] += 1
        examples = keep
    res = {"model": args.model or "clover/assets/default", "command": "python " + " ".join(sys.argv),
           "block_size": args.block_size, "threshold": args.threshold}
    heldout = Path(args.heldout) if args.heldout else Path(args.tasks).with_name("heldout.jsonl")
    if heldout.exists():
        res["heldout_loss"] = heldout_losses(model, tok, heldout, args.heldout_rows, args.block_size)
        print("heldout_loss", json.dumps(res["heldout_loss"]), flush=True)
    for mode in ("low_confidence", "ar"):
        t0 = time.time()
        gens = run(model, tok, examples, mode, block_size=args.block_size, threshold=args.threshold)
        res[mode] = {**score(examples, gens, chat=False), "seconds": time.time() - t0}
        print(mode, json.dumps(res[mode]), flush=True)
    arith = [ex for ex in examples if ex["task"] in ("add", "sub")]
    for think in (False, True):
        t0 = time.time()
        gens = run(model, tok, arith, "low_confidence", chat=True, think=think, block_size=args.block_size,
                   threshold=args.threshold, max_new_tokens=96 if think else 32)
        key = "chat_think" if think else "chat_no_think"
        res[key] = {**score(arith, gens, chat=True), "seconds": time.time() - t0,
                    "sample": gens[0].to_dict(token_ids=False) if gens else None}
        print(key, json.dumps({k: v for k, v in res[key].items() if k != "sample"}), flush=True)
    res["accuracy_gap_points"] = 100 * (res["ar"]["accuracy"] - res["low_confidence"]["accuracy"])
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
