"""`clover eval`: lm-evaluation-harness with the `clover` model and the shipped task YAMLs.

    clover eval --tasks clover_suite --model_args pretrained=DIR,block_size=32,threshold=0.95 [lm-eval run flags]
    clover eval --build-suite DIR      # write the offline suite's seeded JSONL files
    clover eval --list-tasks           # the shipped task names

Everything after our own flags goes to `lm-eval run` unchanged, so the usual flags work
(--limit, --num_fewshot, --output_path, --log_samples, --apply_chat_template, --gen_kwargs, ...).
Defaults added when absent: `--model clover`, `--device auto` for it (cuda when available) and `--include_path <clover/eval/tasks>`. Tasks that
need the Hugging Face hub (clover_gsm8k, clover_math500) are skipped with one line when the hub is
unreachable (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, or no connection).
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import sys
from urllib.parse import urlparse

from . import UserError
from .options import add_threads_arg


def register(sub) -> None:
    p = sub.add_parser("eval", help="lm-evaluation-harness with the clover model and the offline task suite",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-suite", metavar="DIR", help="write the offline suite's JSONL files to DIR and exit")
    p.add_argument("--list-tasks", action="store_true", help="list the shipped task YAMLs and exit")
    add_threads_arg(p)
    p.set_defaults(func=run, lm_eval_args=[])
    parse_known = p.parse_known_args

    def keep_unknown(arg_strings=None, namespace=None):  # every flag we do not know goes to lm-eval, in order
        ns, extra = parse_known(arg_strings, namespace)
        ns.lm_eval_args = list(ns.lm_eval_args) + extra
        return ns, []

    p.parse_known_args = keep_unknown


def hub_offline() -> str | None:
    """Why the Hugging Face hub cannot be reached (None when it can)."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]}"
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError as e:
        return f"cannot reach {host}: {e.__class__.__name__}"
    return None


def split_tasks(rest: list[str]) -> tuple[list[str], list[str]]:
    """(task names, the other arguments) from lm-eval's --tasks/-t (space or comma separated)."""
    tasks, other, i = [], [], 0
    while i < len(rest):
        a = rest[i]
        if a in ("--tasks", "-t"):
            i += 1
            while i < len(rest) and not rest[i].startswith("-"):
                tasks += [t for t in rest[i].split(",") if t]
                i += 1
            continue
        if a.startswith("--tasks="):
            tasks += [t for t in a.split("=", 1)[1].split(",") if t]
        else:
            other.append(a)
        i += 1
    return tasks, other


def check_model_args(argv: list[str]) -> None:
    """Fail in one line, before lm-eval starts, on clover model_args that cannot work."""
    from ..engine import DecodeConfig
    from ..eval.lm import LIKELIHOODS

    kv = {}
    for i, a in enumerate(argv):
        if a in ("--model_args", "-a"):
            for tok in argv[i + 1:]:
                if tok.startswith("-"):
                    break
                kv.update(p.split("=", 1) for p in tok.split(",") if "=" in p)
    try:  # built as the lm-eval model builds it (clover/eval/lm.py)
        DecodeConfig.from_settings(**{k: kv.get(k) for k in ("mode", "block_size", "threshold", "steps")})
    except ValueError as e:
        raise UserError(f"--model_args: {e}") from None
    if kv.get("likelihood", "ar") not in LIKELIHOODS:
        raise UserError(f"--model_args: likelihood must be one of {', '.join(LIKELIHOODS)}, got {kv['likelihood']!r}")


def run(args) -> int:
    from ..eval import HUB_TASKS, TASKS_DIR

    if args.list_tasks:
        for f in sorted(TASKS_DIR.glob("*.yaml")):
            print(f.stem + ("  (Hugging Face hub)" if f.stem in HUB_TASKS else ""))
        return 0
    if args.build_suite:
        from ..eval.suite import build_suite

        print(build_suite(args.build_suite))
        return 0
    from ..eval import HAVE_LM_EVAL

    if not HAVE_LM_EVAL:
        raise UserError("lm-eval is not installed: pip install 'clover-dllm[eval]'")
    rest = [a for a in args.lm_eval_args if a != "--"]
    tasks, other = split_tasks(rest)
    if not tasks:
        raise UserError("name tasks with --tasks (e.g. --tasks clover_suite; `clover eval --list-tasks`)")
    hub = [t for t in tasks if t in HUB_TASKS]
    if hub:
        why = hub_offline()
        if why:
            print(f"clover eval: skipping {', '.join(hub)}: the Hugging Face hub is unreachable ({why})", file=sys.stderr)
            tasks = [t for t in tasks if t not in HUB_TASKS]
            if not tasks:
                return 0
    if not any(a in ("--model", "-M") or a.startswith("--model=") for a in other):
        other += ["--model", "clover"]
    ours = "clover" in [other[i + 1] for i, a in enumerate(other[:-1]) if a in ("--model", "-M")] + \
        [a.split("=", 1)[1] for a in other if a.startswith("--model=")]
    if ours:
        check_model_args(other)
    if ours and not any(a == "--device" or a.startswith("--device=") for a in other):
        other += ["--device", "auto"]  # lm-eval's default is cuda; ours is cuda when available
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in other):
        other += ["--include_path", str(TASKS_DIR)]
    return run_lm_eval(["--tasks", ",".join(tasks), *other])


def quiet_git_hash() -> str | None:
    """lm-eval's get_git_commit_hash without git's "fatal: not a git repository" on stderr outside a repo."""
    import subprocess

    try:
        r = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def run_lm_eval(argv: list[str]) -> int:
    """lm-eval's own CLI (`lm-eval run ARGV`) in this process, so the `clover` model is registered."""
    import lm_eval.evaluator
    import lm_eval.tasks
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.utils import setup_logging

    from ..eval import TASKS_DIR
    from ..eval.lm import CloverLM

    setup_logging()
    CloverLM.last = None
    tasks = argv[argv.index("--tasks") + 1].split(",")
    ours = {f.stem for f in TASKS_DIR.glob("*.yaml")} | {"clover_suite_generation", "clover_suite_multiple_choice"}
    cli = HarnessCLI()
    parser = cli._subparsers.choices["run"]

    def error(message):
        raise UserError(f"lm-eval: {message}")

    parser.error = error
    saved, manager, git_hash = sys.argv, lm_eval.tasks.TaskManager, lm_eval.evaluator.get_git_commit_hash
    sys.argv = ["lm-eval", "run", *argv]
    lm_eval.evaluator.get_git_commit_hash = quiet_git_hash
    if set(tasks) <= ours:  # only our tasks: skip indexing lm-eval's thousands of YAMLs (slow on a small CPU)
        lm_eval.tasks.TaskManager = functools.partial(manager, include_defaults=False)
    try:
        cli.execute(cli.parse_args())
    except KeyError as e:
        raise UserError(f"lm-eval: {e.args[0] if e.args else e}") from None
    finally:
        sys.argv, lm_eval.tasks.TaskManager, lm_eval.evaluator.get_git_commit_hash = saved, manager, git_hash
    lm = CloverLM.last
    if lm is not None and lm.stats["forward_passes"]:
        s = lm.stats
        print(f"\nclover generation: {s['generated_tokens']} tokens in {s['forward_passes']} forwards per row "
              f"(tokens per forward {s['generated_tokens'] / s['forward_passes']:.2f}); mode {lm.mode}, "
              f"block {lm.block_size}, threshold {lm.threshold}; likelihood {lm.likelihood}")
    return 0
