"""`clover bench NAME`: benchmarks that print a markdown table (and can write JSON).

Each benchmark is a pair in BENCHMARKS: `register(parser)` adding its flags and `run(args)`.
Add one (e.g. `pareto`) by writing those two functions and one line in BENCHMARKS; `--json FILE`
writes the results there, a bare `--json` prints them as one object on stdout (`write_json`). Timings follow
clover/utils/timing.py: warm up, run candidates alternately in one process, report medians.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from . import UserError
from .generate import block_size_arg, resolve_auto_block_size


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (markdown tables; --json for programs)")
    benches = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    for name, (add_flags, run, help_text) in BENCHMARKS.items():
        q = benches.add_parser(name, help=help_text)
        q.add_argument("--json", nargs="?", const="-", metavar="FILE",
                       help="also write the results as JSON to FILE; bare --json prints one JSON object on stdout "
                            "(the table then goes to stderr)")
        q.add_argument("--threads", type=int, help="torch threads (default: all cores)")
        add_flags(q)
        q.set_defaults(func=_json_on_stdout(run))
    p.set_defaults(func=lambda args: (_ for _ in ()).throw(UserError(f"name a benchmark: {', '.join(BENCHMARKS)}")))


def _json_on_stdout(run):
    """With bare --json the run's prints go to stderr and stdout gets only the JSON object."""
    def go(args) -> int:
        if args.json != "-":
            return run(args)
        args.json_stream = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            return run(args)
    return go


def write_json(args, obj) -> None:
    """The results as JSON: to --json FILE, or to stdout for a bare --json; nothing without --json."""
    if not args.json:
        return
    if args.json == "-":
        args.json_stream.write(json.dumps(obj, indent=2, default=float) + "\n")
        return
    with open(args.json, "w") as f:
        json.dump(obj, f, indent=2, default=float)


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def add_model_flags(p) -> None:
    p.add_argument("--model", help="model folder (default: the shipped default model)")
    p.add_argument("--device", default=None)


# ---- decode -----------------------------------------------------------------------------------------
def add_decode_flags(p) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model folder (default: the shipped default model)")
    src.add_argument("--preset", help="a random-weight preset instead (default when no default model exists)")
    p.add_argument("--device", default=None)
    p.add_argument("--workload", choices=("story", "tasks"), default="story",
                   help="story: one free-text prompt, EOS ignored, exactly --max-new-tokens per run; tasks: the "
                        "held-out synthetic task prompts the default model is evaluated on (--per-task of each task), "
                        "decoded one by one until EOS or the task's answer budget")
    p.add_argument("--prompt-tokens", type=int, default=64, help="story: prompt length")
    p.add_argument("--max-new-tokens", type=int, default=128, help="story: tokens per run")
    p.add_argument("--per-task", type=int, default=2, metavar="N", help="tasks: prompts per synthetic task (default 2)")
    p.add_argument("--block-size", type=block_size_arg, default=32,
                   help="block size, or auto: the one `clover tune` stored for this model and machine")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")


def decode_workload(args):
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


def run_decode(args) -> int:
    import torch
    from tqdm import tqdm

    from ..engine import DecodeConfig, Engine
    from ..utils.timing import time_alternately

    for flag in ("prompt_tokens", "max_new_tokens", "repeats", "per_task"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    resolve_auto_block_size(args)
    model, jobs, eos, described, random_weights = decode_workload(args)
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
        cfg = cfg.with_(block_size=args.block_size, eos_token_ids=eos)
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
        # tokens/s = TPF / (s per forward), so 3x ar's tokens/s takes TPF = 3 x (s per forward) / ar's
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
    print(f"Decode speed: {described}; {shape}, block {args.block_size}, "
          f"{model.device} {str(model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} alternating runs.\n")
    if random_weights:
        print("Note: random weights (no trained default model yet): confidences are low, so low_confidence fills "
              "about one token per step and self_spec drafts are rarely accepted; TPF targets need the trained model.\n")
    print(markdown_table(["mode", "tokens", "forwards", "TPF", "median s", "tokens/s", "ms / forward", "TPF for 3x ar",
                          "vs ar", "vs transformers"], rows))
    print("\nTPF for 3x ar: the tokens per forward a mode would need, at its measured time per forward, for 3x "
          "the tokens/s of ar (tokens/s = TPF / time per forward).")
    write_json(args, dict(model=described, random_weights=random_weights, workload=args.workload,
                          prompts=len(jobs), prompt_tokens=sum(len(p) for p, _ in jobs),
                          max_new_tokens=sum(n for _, n in jobs), block_size=args.block_size,
                          threads=torch.get_num_threads(), results=results))
    return 0


# ---- decide -----------------------------------------------------------------------------------------
def add_decide_flags(p) -> None:
    add_model_flags(p)
    p.add_argument("--groups", type=int, default=500, help="held-out groups (default 500)")
    p.add_argument("--seed", type=int, default=0, help="benchmark seed (clover.data.tasks.decision_benchmark)")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=32)


def _spoken(value) -> str:
    return ("yes" if value else "no") if isinstance(value, bool) else str(value)


def run_decide(args) -> int:
    """Joint vs independent decision mode on the held-out split of the decision benchmark."""
    import torch
    from tqdm import tqdm

    from ..api import DEFAULT_MODEL, load
    from ..data.tasks import decision_benchmark
    from ..decide import decide

    if args.groups < 1:
        raise UserError("--groups must be >= 1")
    if not args.model and not (DEFAULT_MODEL / "config.json").is_file():
        raise UserError(f"no default model at {DEFAULT_MODEL} (build it with `make model`) and no --model given")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
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
    from ..decide import parse_question

    def allowed(q, spec) -> int:
        parsed = parse_question({"question": q, **spec})
        return len(parsed.options) if parsed.options else 10 ** parsed.max_tokens

    odds = [[1 / allowed(q, s) for q, s in zip(g["questions"], g["specs"])] for g in groups]
    chance_q = 100 * sum(map(sum, odds)) / questions
    chance_g = 100 * sum(__import__("math").prod(o) for o in odds) / n
    rows.append(["chance (uniform over allowed answers)", f"{chance_q:.1f}%", f"{chance_g:.1f}%", "-", "-", "-", "-"])
    described = args.model or "default model"
    print(f"Joint decision mode: {described}; held-out split of the decision benchmark (seed {args.seed}), {n} groups / "
          f"{questions} questions (2-8 linked questions each); threshold {args.threshold}, block {args.block_size}, "
          f"{model.device} {str(model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads.\n")
    print("Forward passes = per-row decoding forwards summed over the group's rows (independent: one row per "
          "question, batched; prefill not counted); model calls = batched forwards; prompt tokens = tokens prefilled "
          "(independent reads the material once per question).\n")
    print(markdown_table(["mode", "questions right", "groups all right", "forward passes / group",
                          "model calls / group", "prompt tokens / group", "s / group"], rows))
    write_json(args, dict(model=described, seed=args.seed, groups=n, questions=questions, threshold=args.threshold,
                          chance=dict(questions_right=chance_q, groups_all_right=chance_g),
                          block_size=args.block_size, threads=torch.get_num_threads(), results=results))
    return 0


# ---- pareto ------------------------------------------------------------------------------------------
def add_pareto_flags(p) -> None:
    add_model_flags(p)
    p.add_argument("--thresholds", default="0.5,0.7,0.8,0.9,0.95,0.99", help="low_confidence thresholds (comma list)")
    p.add_argument("--block-sizes", default="8,16,32,64", help="block sizes (comma list)")
    p.add_argument("--per-task", type=int, default=8, metavar="N",
                   help="first N prompts of each synthetic task (0 = all 40; default 8)")
    p.add_argument("--batch", type=int, default=64, metavar="N", help="rows decoded together (default 64)")
    p.add_argument("--plot", default="bench/pareto.png", metavar="PNG", help="where to write the plot")
    p.add_argument("--no-ar", action="store_true", help="skip the ar reference point")


def run_pareto(args) -> int:
    import torch

    from ..api import eos_ids, load
    from ..eval import pareto

    try:
        thresholds = [float(x) for x in args.thresholds.split(",") if x]
        blocks = [int(x) for x in args.block_sizes.split(",") if x]
    except ValueError as e:
        raise UserError(f"--thresholds / --block-sizes: {e}") from None
    if not thresholds or not blocks or args.batch < 1 or args.per_task < 0:
        raise UserError("need at least one threshold and block size, --batch >= 1, --per-task >= 0")
    if not str(args.plot).endswith(".png"):
        raise UserError(f"--plot must name a .png file, got {args.plot}")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    model, tokenizer = load(args.model, args.device)
    if max(blocks) > model.config.max_block_size or min(blocks) < 2:
        raise UserError(f"block sizes must be in [2, {model.config.max_block_size}]")
    exs = pareto.examples(args.per_task)
    eos = eos_ids(model, tokenizer)
    settings = [("low_confidence", b, t) for b in blocks for t in thresholds] + ([] if args.no_ar else [("ar", 1, 0.0)])
    rows = []
    with torch.inference_mode():
        pareto.evaluate(model, tokenizer, exs[:2], "low_confidence", blocks[0], thresholds[0], args.batch, eos)  # warm-up
        for mode, b, t in tqdm_or_list(settings, "bench pareto"):
            rows.append(pareto.evaluate(model, tokenizer, exs, mode, b, t, args.batch, eos))
    described = args.model or "default model"
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
    print(f"\n![accuracy against tokens per forward and tokens/s]({args.plot})")
    write_json(args, dict(model=described, prompts=len(exs), per_task=args.per_task, batch=args.batch, results=rows))
    return 0


# ---- agent -------------------------------------------------------------------------------------------
def add_agent_flags(p) -> None:
    add_model_flags(p)
    p.add_argument("--n", type=int, default=70, help="held-out cases, cycling over the 7 kinds (default 70)")
    p.add_argument("--seed", type=int, default=1000, help="benchmark seed (default 1000; training uses 3 and 4)")
    p.add_argument("--mode", default="low_confidence",
                   help="decoding mode, or a comma list to compare (e.g. low_confidence,ar; default low_confidence)")
    p.add_argument("--threshold", type=float, default=0.95)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128, help="budget of each assistant turn (default 128)")
    p.add_argument("--batch", type=int, default=1, metavar="N",
                   help="episodes advanced together (default 1: seconds per case are per-case latency)")
    p.add_argument("--records", metavar="JSONL", help="write every case's record (transcript included) as JSONL")


def _pct_cell(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def run_agent(args) -> int:
    """Tool-call accuracy (AST), irrelevance, and real multi-turn episodes on the seeded toolbox."""
    import torch

    from ..agent.bench import MAX_ROUNDS, run_benchmark
    from ..api import load
    from ..engine import MODES, DecodeConfig

    modes = [m for m in args.mode.split(",") if m]
    if not modes:
        raise UserError("--mode: name at least one decoding mode")
    for m in modes:
        if m not in MODES:
            raise UserError(f"--mode: unknown mode {m!r} (known: {', '.join(MODES)})")
        DecodeConfig(mode=m, block_size=args.block_size, threshold=args.threshold,
                     max_new_tokens=args.max_new_tokens).validate()
    if args.n < 1 or args.batch < 1:
        raise UserError("--n and --batch must be >= 1")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    model, tokenizer = load(args.model, args.device)
    if not 1 <= args.block_size <= model.config.max_block_size:
        raise UserError(f"--block-size must be in [1, {model.config.max_block_size}]")
    from tqdm import tqdm

    bar = tqdm(total=args.n * len(modes), desc="bench agent", file=sys.stderr, leave=False,
               disable=not sys.stderr.isatty())
    runs = []
    for m in modes:
        bar.set_postfix_str(m)
        runs.append(run_benchmark(model, tokenizer, args.n, args.seed, m, args.threshold, args.block_size,
                                  args.max_new_tokens, args.batch, progress=bar.update))
    bar.close()
    described = args.model or "default model"
    print(f"Agent benchmark: {described}; {args.n} held-out toolbox cases (seed {args.seed}, 7 kinds, requests unseen "
          f"in training except weather/weather2/age), greedy, max {args.max_new_tokens} tokens a turn, up to "
          f"{MAX_ROUNDS} tool rounds, {model.device} {str(model.dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads. Call accuracy = first turn's calls AST-match the expected ones "
          f"(BFCL-style); irrelevance = no call where no tool helps; episode = final reply after real tool results "
          f"(exact / contains every value); valid = parsable calls to offered tools / call attempts; forwards and "
          f"seconds summed over an episode's turns (prefill not counted in forwards). docs/agent.md.\n")
    if not runs[0]["template_renders_tools"]:
        print("Note: this model's chat template does not render tools (it predates tool-use training); tools were "
              "rendered by clover.agent.tool_format.normalize_messages, as the tool-aware template writes them.\n")
    rows = []
    for r in runs:
        setting = r["mode"] if r["mode"] == "ar" else f"{r['mode']} b={r['block_size']} t={r['threshold']:g}"
        for kind, g in [*r["per_kind"].items(), ("overall", r["overall"])]:
            rows.append([setting, f"**{kind}**" if kind == "overall" else kind, g["cases"], _pct_cell(g["call_accuracy"]),
                         _pct_cell(g["irrelevance_accuracy"]), _pct_cell(g["episode_exact"]),
                         _pct_cell(g["episode_values"]), _pct_cell(g["call_validity"]),
                         f"{g['forward_passes_per_case']:.1f}", f"{g['seconds_per_case']:.3f}"])
    print(markdown_table(["decoding", "kind", "cases", "call acc %", "irrelevance %", "episode exact %",
                          "episode values %", "valid calls %", "forwards / case", "s / case"], rows))
    if args.records:
        with open(args.records, "w") as f:
            for r in runs:
                for rec in r["records"]:
                    f.write(json.dumps(dict(mode=r["mode"], **rec)) + "\n")
    write_json(args, dict(model=described, n=args.n, seed=args.seed, threads=torch.get_num_threads(),
                          runs=[{k: v for k, v in r.items() if k != "records"} for r in runs]))
    return 0


# ---- structured ----------------------------------------------------------------------------------
def add_structured_flags(p) -> None:
    add_model_flags(p)
    p.add_argument("--n", type=int, default=10, help="cases of each of the 7 kinds (default 10)")
    p.add_argument("--seed", type=int, default=1000, help="benchmark seed (default 1000)")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64, help="budget of free generation (default 64)")
    p.add_argument("--records", metavar="JSONL", help="write every case's record (every method) as JSONL")
    p.add_argument("--corpus", action="store_true",
                   help="instead: coverage on the real-world schema corpus (clover/structured/corpus.py), per "
                        "source and per method, as the server answers a json_schema response_format")
    p.add_argument("--per-file", type=int, default=6,
                   help="--corpus: SchemaStore definitions taken per document (default 6; 0: roots only)")
    p.add_argument("--max-tokens", type=int, default=600, help="--corpus: token budget of a reply (default 600)")
    p.add_argument("--only", metavar="IDS", help="--corpus: just the entries whose id contains one of these "
                                                 "comma-separated substrings")


def _rate_cell(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _kinds_and_overall(summary: dict) -> list[tuple[str, dict]]:
    """(label, metrics) for each kind, then the bold overall row."""
    return [*summary["per_kind"].items(), ("**overall**", summary["overall"])]


def _progress(total: int, desc: str):
    """A progress bar on stderr (silent unless stderr is a terminal), usable as a context manager."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, disable=not sys.stderr.isatty())


def run_structured(args) -> int:
    """Schema-guided infilling vs free generation + validation on seeded JSON requests."""
    import torch

    from ..api import load
    from ..structured.bench import KINDS, METHODS, run_benchmark

    if args.n < 1 or args.max_new_tokens < 1:
        raise UserError("--n and --max-new-tokens must be >= 1")
    if args.corpus:
        return run_structured_corpus(args)
    if not 0 <= args.threshold <= 1:
        raise UserError("--threshold must be in [0, 1]")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    model, tokenizer = load(args.model, args.device)
    if not 2 <= args.block_size <= model.config.max_block_size:
        raise UserError(f"--block-size must be in [2, {model.config.max_block_size}]")
    with _progress(args.n * len(KINDS), "bench structured") as bar:
        out = run_benchmark(model, tokenizer, args.n, args.seed, args.threshold, args.block_size,
                            args.max_new_tokens, progress=bar.update)
    described = args.model or "default model"
    print(f"Structured output: {described}; {args.n} seeded cases of each of {len(KINDS)} kinds (seed {args.seed}), "
          f"threshold {args.threshold:g}, block {args.block_size}, {model.device} "
          f"{str(model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads. infill = generate_json "
          f"(tool kinds: infill_json inside the <tool_call> frame, as the server's forced calls); grammar = the same "
          f"schema decoded left to right under its xgrammar mask (method='grammar'); free = the same "
          f"prompt generated freely (low_confidence, up to {args.max_new_tokens} tokens), then parsed and validated. "
          f"Valid = parses and validates; exact = valid and every field equals the ground truth; fields = share of "
          f"fields right; forwards after the prompt prefill. docs/structured.md.\n")
    rows = [[m, kind, g["cases"], *(_rate_cell(g[k]) for k in ("valid_rate", "exact_rate", "field_rate")),
             f"{g['forward_passes_per_case']:.1f}", f"{g['seconds_per_case']:.3f}"]
            for m in METHODS for kind, g in _kinds_and_overall(out["results"][m])]
    print(markdown_table(["method", "kind", "cases", "valid %", "exact %", "fields %", "forwards / case", "s / case"],
                         rows))
    if args.records:
        with open(args.records, "w") as f:
            for rec in out["records"]:
                f.write(json.dumps(rec) + "\n")
    write_json(args, dict(model=described, threads=torch.get_num_threads(),
                          **{k: v for k, v in out.items() if k != "records"}))
    return 0


def run_structured_corpus(args) -> int:
    """Coverage (valid / total) of the schema corpus: every entry infilled, decoded under its grammar
    or refused; 0 invalid replies is the guarantee, coverage the share answered validly."""
    import torch

    from ..api import load
    from ..structured import corpus

    if args.per_file < 0 or args.max_tokens < 1:
        raise UserError("--per-file must be >= 0 and --max-tokens >= 1")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    entries = corpus.load(per_file=args.per_file, only=args.only)
    if not entries:
        raise UserError(f"--only {args.only!r} matches no corpus entry")
    model, tokenizer = load(args.model, args.device)
    records = []
    with _progress(len(entries), "bench structured --corpus") as bar, torch.inference_mode():
        for e in entries:
            records.append(corpus.answer(model, tokenizer, e, args.max_tokens, args.threshold, args.block_size))
            bar.update(1)
    out = corpus.summarize(records)
    described = args.model or "default model"
    print(f"Structured output on the schema corpus: {described}; {len(entries)} schemas (SchemaStore documents via "
          f"check-jsonschema with {args.per_file} definitions each, JSON Schema meta-schemas, pydantic models, "
          f"BFCL-style functions, OpenAPI/Kubernetes payloads), each answered as a json_schema response_format "
          f"(normalised, then infilled or decoded under its grammar, or refused: a 400 naming the keyword), "
          f"up to {args.max_tokens} tokens, {model.device}, {torch.get_num_threads()} threads. valid = json.loads + "
          f"jsonschema accept the returned text; coverage = valid / total; invalid = complete replies that fail "
          f"(never returned by the server); cut = max_tokens ran out (finish_reason length). docs/structured.md.\n")
    header = ["", "schemas", "valid", "coverage %", "refused", "invalid", "cut", "forwards / reply", "s / reply"]

    def row(label, g):
        return [label, g["total"], g["valid"], _rate_cell(g["coverage"]), g["refused"], g["invalid"] - g["incomplete"],
                g["incomplete"], f"{g['forward_passes_per_reply']:.1f}", f"{g['seconds_per_reply']:.2f}"]
    print(markdown_table(["source"] + header[1:], [row(k, g) for k, g in out["per_source"].items()]
                         + [row("**overall**", out["overall"])]))
    print()
    print(markdown_table(["method"] + header[1:], [row(k, g) for k, g in out["per_method"].items()]))
    refused = {}
    for r in records:
        if r["method"] == "refused":
            refused[r["keyword"]] = refused.get(r["keyword"], 0) + 1
    if refused:
        print("\nRefused, by keyword: " + ", ".join(f"`{k}` {v}" for k, v in sorted(refused.items(), key=lambda kv: -kv[1])))
    if args.records:
        with open(args.records, "w") as f:
            for rec in records:
                f.write(json.dumps(rec, default=str) + "\n")
    write_json(args, dict(model=described, threads=torch.get_num_threads(), schemas=len(entries), **out))
    return 0


def tqdm_or_list(items, desc):
    from tqdm import tqdm

    return tqdm(items, desc=desc, file=sys.stderr, leave=False, disable=not sys.stderr.isatty())


BENCHMARKS = {
    "decode": (add_decode_flags, run_decode, "tokens/s and tokens per forward of each decoding mode vs transformers"),
    "decide": (add_decide_flags, run_decide, "joint vs independent decision mode: accuracy, forwards, seconds per group"),
    "pareto": (add_pareto_flags, run_pareto, "speed-quality curve: suite accuracy vs tokens per forward and tokens/s (PNG + table)"),
    "agent": (add_agent_flags, run_agent, "tool use on the seeded toolbox: call accuracy (AST), irrelevance, real episodes"),
    "structured": (add_structured_flags, run_structured,
                   "schema-guided JSON: infill vs free generation, valid and exact rates, forwards, seconds"),
}
