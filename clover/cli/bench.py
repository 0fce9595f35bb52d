"""`clover bench NAME`: the flags of each benchmark; the benchmarks themselves are clover/benchmarks/.

Each benchmark is an entry in BENCHMARKS: a function adding its flags, and the module of
clover.benchmarks whose `run(args)` measures and prints a markdown table. Add one by writing its module
and one line here; `--json FILE` writes the results there, a bare `--json` prints them as one object on
stdout (`clover.benchmarks.report.write_json`).
"""

from __future__ import annotations

import contextlib
import importlib
import sys

from ..settings import INFILL_THRESHOLD
from . import UserError
from .options import add_decode_args, add_model_args, add_threads_arg, fill_decode_defaults


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (markdown tables; --json for programs)")
    benches = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    for name, (add_flags, module, help_text) in BENCHMARKS.items():
        q = benches.add_parser(name, help=help_text)
        q.add_argument("--json", nargs="?", const="-", metavar="FILE",
                       help="also write the results as JSON to FILE; bare --json prints one JSON object on stdout "
                            "(the table then goes to stderr)")
        add_threads_arg(q)
        add_flags(q)
        q.set_defaults(func=_json_on_stdout(module))
    p.set_defaults(func=lambda args: (_ for _ in ()).throw(UserError(f"name a benchmark: {', '.join(BENCHMARKS)}")))


def _json_on_stdout(module: str):
    """The benchmark's run; with bare --json its prints go to stderr and stdout gets only the JSON object."""
    def go(args) -> int:
        run = importlib.import_module(f"clover.benchmarks.{module}").run
        fill_decode_defaults(args, *DECODE_FLAGS.get(module, ()))
        if args.json != "-":
            return run(args)
        args.json_stream = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            return run(args)
    return go


def add_model_flags(p) -> None:
    add_model_args(p, threads=False)  # --threads: every benchmark has it (register)


# ---- decode -----------------------------------------------------------------------------------------
def add_decode_flags(p) -> None:
    src = p.add_mutually_exclusive_group()
    add_model_args(p, threads=False, model_group=src)
    src.add_argument("--preset", help="a random-weight preset instead (default when no default model exists)")
    p.add_argument("--workload", choices=("story", "tasks", "long"), default="story",
                   help="story: one free-text prompt, EOS ignored, exactly --max-new-tokens per run; tasks: the "
                        "held-out synthetic task prompts the default model is evaluated on (--per-task of each task), "
                        "decoded one by one until EOS or the task's answer budget; long: --prompts held-out play "
                        "passages, exactly --max-new-tokens each (EOS ignored; use 256 or more), ar / self_spec / "
                        "low_confidence at every --thread-counts, interleaved")
    p.add_argument("--prompt-tokens", type=int, default=64, help="story, long: prompt length")
    p.add_argument("--prompts", type=int, default=8, metavar="N", help="long: prompts (default 8)")
    p.add_argument("--thread-counts", default="1,2", metavar="LIST",
                   help="long: thread counts, interleaved in one run (default 1,2)")
    add_decode_args(p, "max_new_tokens", "block_size", "runner", help=dict(max_new_tokens="story, long: tokens per run (default: story 128, long 256)"))
    p.add_argument("--per-task", type=int, default=2, metavar="N", help="tasks: prompts per synthetic task (default 2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")


def add_infill_flags(p) -> None:
    """The infilling decoders' commit threshold (the one infill default) and block size."""
    p.add_argument("--threshold", type=float, default=INFILL_THRESHOLD)
    add_decode_args(p, "block_size")


# ---- decide -----------------------------------------------------------------------------------------
def add_decide_flags(p) -> None:
    add_model_flags(p)
    p.add_argument("--groups", type=int, default=500, help="held-out groups (default 500)")
    p.add_argument("--seed", type=int, default=0, help="benchmark seed (clover.data.tasks.decision_benchmark)")
    add_infill_flags(p)


# ---- pareto ------------------------------------------------------------------------------------------
def add_pareto_flags(p) -> None:
    add_model_flags(p)
    p.add_argument("--thresholds", default="0.5,0.7,0.8,0.9,0.95,0.99", help="low_confidence thresholds (comma list)")
    p.add_argument("--block-sizes", default="4,8,16,32", help="block sizes of low_confidence and self_spec (comma list)")
    p.add_argument("--modes", default="ar,self_spec,low_confidence",
                   help="decoding modes (comma list of ar, self_spec, low_confidence; default all three)")
    p.add_argument("--per-task", type=int, default=8, metavar="N",
                   help="first N prompts of each synthetic task (0 = all 40; default 8)")
    p.add_argument("--batch", type=int, default=64, metavar="N", help="rows decoded together (default 64)")
    p.add_argument("--plot", default=None, metavar="PNG", help="also draw the curve into this .png (none by default)")
    p.add_argument("--aup-y-max", type=float, metavar="PCT",
                   help="accuracy (%%) AUP's weight is relative to (default: the best setting of this run); give "
                        "the same value to compare models")
    p.add_argument("--no-ar", action="store_true", help="skip the ar reference point (= --modes without ar)")


# ---- calibration -------------------------------------------------------------------------------------
def add_calibration_flags(p) -> None:
    add_model_flags(p)
    p.add_argument("--thresholds", default="0.8,0.9,0.95", help="low_confidence thresholds (comma list)")
    p.add_argument("--block-size", type=int, default=8, help="block size (default 8)")
    p.add_argument("--per-task", type=int, default=0, metavar="N",
                   help="first N prompts of each synthetic task (default 0 = all 40: 280 prompts)")
    p.add_argument("--batch", type=int, default=64, metavar="N", help="rows decoded together (default 64)")


# ---- agent -------------------------------------------------------------------------------------------
def add_agent_flags(p) -> None:
    add_model_flags(p)
    p.add_argument("--n", type=int, default=70, help="held-out cases, cycling over the 7 kinds (default 70)")
    p.add_argument("--seed", type=int, default=1000, help="benchmark seed (default 1000; training uses 3 and 4)")
    p.add_argument("--mode", default="low_confidence",
                   help="decoding mode, or a comma list to compare (e.g. low_confidence,ar; default low_confidence)")
    add_decode_args(p, "threshold", "block_size", "max_new_tokens",
                    help=dict(max_new_tokens="budget of each assistant turn"))
    p.add_argument("--batch", type=int, default=1, metavar="N",
                   help="episodes advanced together (default 1: seconds per case are per-case latency)")
    p.add_argument("--records", metavar="JSONL", help="write every case's record (transcript included) as JSONL")


# ---- structured ----------------------------------------------------------------------------------
def add_structured_flags(p) -> None:
    add_model_flags(p)
    p.add_argument("--n", type=int, default=10, help="cases of each of the 7 kinds (default 10)")
    p.add_argument("--seed", type=int, default=1000, help="benchmark seed (default 1000)")
    add_infill_flags(p)
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
    p.add_argument("--random-weights", type=int, metavar="SEED",
                   help="--corpus: the model's config and tokenizer with weights drawn at random (seed SEED), "
                        "e.g. to check that an untrained model's replies are valid too")


# the shared decoding flags (clover/cli/options.py) each benchmark reads, DecodeConfig's defaults when not given
DECODE_FLAGS = {"decode": ("block_size", "runner"),  # max_new_tokens: by workload (benchmarks/decode.py) "decide": ("block_size",),
                "agent": ("threshold", "block_size", "max_new_tokens"), "structured": ("block_size",)}

BENCHMARKS = {
    "decode": (add_decode_flags, "decode", "tokens/s and tokens per forward of each decoding mode vs transformers"),
    "decide": (add_decide_flags, "decide", "joint vs independent decision mode: accuracy, forwards, seconds per group"),
    "pareto": (add_pareto_flags, "pareto", "accuracy vs parallelism: ar, self_spec, low_confidence accuracy and tokens per forward, Pareto front, "
               "AUP (PNG + table)"),
    "calibration": (add_calibration_flags, "calibration",
                    "committed-in-parallel tokens that differ from ar's choice, per threshold, against 1 - threshold"),
    "agent": (add_agent_flags, "agent", "tool use on the seeded toolbox: call accuracy (AST), irrelevance, real episodes"),
    "structured": (add_structured_flags, "structured",
                   "schema-guided JSON: infill vs free generation, valid and exact rates, forwards, seconds"),
}
