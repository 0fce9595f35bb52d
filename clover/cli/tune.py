"""`clover tune`: measure this machine's step cost per window size and the model's low_confidence
speed per (block size, threshold) on the held-out task prompts; store the fastest setting for the
model and machine (clover/engine/tuning.py), which `--block-size auto` then uses."""

from __future__ import annotations

import sys

from . import UserError, print_json
from .options import RUNNER_CHOICES, add_model_args


SIZES = "4,8,16,32"  # the defaults (engine/tuning.py is imported only when a tune runs: torch stays out of --help)
THRESHOLDS = "0.7,0.75,0.8,0.85,0.9,0.95"
ROUNDS = 3


def register(sub) -> None:
    decodes = 1 + len(SIZES.split(",")) * len(THRESHOLDS.split(","))  # ar + the grid (block 32 / 0.95 is on it)
    p = sub.add_parser("tune", help="choose the block size and threshold for this model on this machine",
                       description="Decode the held-out task prompts with ar and with low_confidence at every --sizes x "
                                   "--thresholds setting (plus block 32 / 0.95, the accuracy reference, when not on "
                                   f"the grid), --rounds times, interleaved. The defaults are {decodes} decodes x {ROUNDS} "
                                   "rounds of 280 prompts: tens of minutes on a 2-core CPU, longer the first time with "
                                   "--runner compiled (each shape compiles once); --sizes, --thresholds, --rounds and "
                                   "--per-task narrow it.")
    add_model_args(p)  # --model, --device, --threads: the same checks as every model command
    p.add_argument("--sizes", default=SIZES, help=f"block sizes to try (default {SIZES})")
    p.add_argument("--thresholds", default=THRESHOLDS,
                   help=f"low_confidence thresholds to try (default {THRESHOLDS}; a setting that loses "
                        "more than 2 points of accuracy against block 32 / 0.95 is not chosen)")
    p.add_argument("--per-task", type=int, default=None, metavar="N",
                   help="calibration prompts per task (default: every held-out task prompt, 280; a 2-point accuracy "
                        "check needs many: on a few, one prompt is several points)")
    p.add_argument("--runner", default="eager", choices=RUNNER_CHOICES, help="runner to tune for")
    p.add_argument("--rounds", type=int, default=ROUNDS, metavar="N",
                   help=f"interleaved rounds over all settings; each keeps its median speed (default {ROUNDS})")
    p.add_argument("--dry-run", action="store_true", help="measure and print, store nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _numbers(text: str, kind, flag: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise UserError(f"{flag}: nothing to try")
    return values


def run(args) -> int:
    sizes = _numbers(args.sizes, int, "--sizes")
    thresholds = _numbers(args.thresholds, float, "--thresholds")
    if any(not 1 < b <= 64 for b in sizes):
        raise UserError("--sizes: block sizes must be in [2, 64]")
    if any(not 0 < t < 1 for t in thresholds):
        raise UserError("--thresholds: thresholds must be in (0, 1)")
    if args.per_task is not None and args.per_task < 1:
        raise UserError("--per-task must be >= 1")
    if args.rounds < 1:
        raise UserError("--rounds must be >= 1")

    from tqdm import tqdm

    from ..api import DEFAULT_MODEL, encode, eos_ids, load
    from ..data.tasks import plain_prompt
    from ..engine import tuning
    from ..eval import pareto

    model, tokenizer = load(args.model, args.device)
    exs = pareto.examples(args.per_task or 0)  # 0: all
    jobs = [(encode(tokenizer, plain_prompt(ex)), ex["budget"]) for ex in exs]

    def score(i, ids):  # the task suite's exact match of the output's stripped first line
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return text.strip().split("\n")[0].strip() == exs[i]["answer"]

    with tqdm(desc="tune", unit="decode", leave=False, file=sys.stderr, disable=None) as bar:  # on terminals only
        def progress(done, total):
            bar.total = total
            bar.update(done - bar.n)

        entry = tuning.tune(model, jobs, eos_ids(model, tokenizer), sizes, thresholds, args.runner, score, args.rounds,
                            progress)
    keys = tuning.model_key(args.model or DEFAULT_MODEL), tuning.machine_key(str(model.device))
    path = None if args.dry_run else tuning.store(*keys, entry)
    if args.json:
        print_json(dict(model=keys[0], machine=keys[1], stored=str(path) if path else None, **entry))
        return 0
    ar = entry["ar"]["tokens_per_second"]
    print(f"{keys[1]}, {len(jobs)} task prompts, {entry['rounds']} interleaved rounds (medians); ar {ar:.1f} tokens/s, "
          f"{entry['step_ms']['1']:.2f} ms per AR step")
    ref = entry["reference"]
    print(f"accuracy: ar {entry['ar']['accuracy']:.3f}, low_confidence at block {ref['block_size']} / "
          f"{ref['threshold']} {ref['accuracy']:.3f} (a setting may lose {tuning.ACCURACY_SLACK:.2f})")
    print("| block | threshold | TPF | tokens/s | vs ar | accuracy | step ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in entry["curve"]:
        print(f"| {r['block_size']} | {r['threshold']} | {r['tpf']:.2f} | {r['tokens_per_second']:.1f} | "
              f"{r['tokens_per_second'] / ar:.2f}x | {r['accuracy']:.3f} | {entry['step_ms'][str(r['block_size'])]:.2f} |")
    eager = {(r["block_size"], r["threshold"]): r.get("eager_calls", 0) for r in [entry["ar"], *entry["curve"]]}
    if any(eager.values()):  # a compiled runner past dynamo's recompile limit: those speeds are partly eager
        print("warning: model calls ran eagerly (no compiled graph) in "
              + ", ".join(f"{'ar' if b == 1 else f'{b} / {t}'} ({n})" for (b, t), n in eager.items() if n)
              + ": those speeds are not the compiled runner's")
    print(f"best: block {entry['block_size']}, threshold {entry['threshold']}"
          + (f" (stored in {path})" if path else " (not stored: --dry-run)"))
    return 0
