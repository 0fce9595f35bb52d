"""Flags shared by the subcommands that run a model (--model, --device, --threads, --seed, the decoding
flags) and the process set-up they imply. Nothing here imports torch: `--help` and argument errors stay
instant. The decoding flags default to None ("not given"); `decode_config(args)` turns them into the
one settings object, DecodeConfig, whose own defaults fill what was not given and which checks them."""

from __future__ import annotations

import argparse
import os
import sys

from ..settings import SEED_MAX, SEED_MIN  # light (no torch); one home for the bounds the server checks too
from ..settings import DRAFTS, RUNNERS


def seed_type(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [{SEED_MIN}, {SEED_MAX}], got {text!r}") from None
    if not SEED_MIN <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (64-bit signed), got {value}")
    return value


def threads_type(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def device_type(text: str) -> str:
    from ..api import check_device_name, cpu_only_torch  # light: no torch

    try:
        device = check_device_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    cpu_build = cpu_only_torch()
    if device.startswith("cuda") and cpu_build:  # known without importing torch (the full check is at load)
        raise argparse.ArgumentTypeError(f"{device}: CUDA is not available (torch {cpu_build} is a CPU-only build); "
                                         f"use --device cpu")
    return device


def add_threads_arg(p) -> None:
    p.add_argument("--threads", type=threads_type, metavar="N",
                   help="torch CPU threads (default: torch's, one per core; OpenMP waits passively unless "
                        "OMP_WAIT_POLICY says otherwise)")


LINEAR_DTYPES = ("float32", "bfloat16")  # ops/linear/tiled.LINEAR_DTYPES (a test checks)


def add_model_args(p, threads: bool = True, model_group=None) -> None:
    """--model, --device, --linear-dtype and (with `threads`) --threads; `model_group` (a mutually
    exclusive group) takes --model when it has rivals (e.g. `bench decode --preset`)."""
    (model_group or p).add_argument("--model", help="model folder (default: the shipped default model)")
    p.add_argument("--device", type=device_type, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--linear-dtype", choices=LINEAR_DTYPES, help=(
        "what the compiled CPU runner's weight linears multiply in. float32 (default): exact. bfloat16: "
        "activations rounded to bf16 against bf16 weights, fp32 sums, as llama.cpp's bf16 matmuls (CPUs with "
        "AVX512-BF16 or AMX; elsewhere float32); attention and the delta rule stay fp32"))
    if threads:
        add_threads_arg(p)


# ---- decoding ------------------------------------------------------------------------------------------
MODE_HELP = "low_confidence (default), topk, entropy, margin, self_spec, ar or editing"  # engine.MODES (a test checks)
RUNNER_CHOICES = RUNNERS  # clover.settings (torch-free)


def block_size_arg(text: str):
    """argparse type of --block-size: a positive int or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {text!r}") from None


_DECODE_FLAGS = {  # DecodeConfig setting -> (flag, argparse keywords); defaults are DecodeConfig's
    "max_new_tokens": ("--max-new-tokens", dict(type=int, metavar="N", help="tokens to generate at most")),
    "block_size": ("--block-size", dict(type=block_size_arg, metavar="B", help=(
        "block size, or auto: the setting `clover tune` stored for this model and machine (block size and "
        "threshold; the defaults where nothing is tuned)"))),
    "threshold": ("--threshold", dict(type=float, metavar="T",
                                      help="low_confidence: fill every masked position with confidence > T")),
    "mode": ("--mode", dict(metavar="MODE", help=MODE_HELP)),
    "draft": ("--draft", dict(choices=DRAFTS, help=(
        "self_spec's drafts: diffusion (a diffusion step of the model, default) or lookup (what followed the "
        "context's latest repeat of its last words); either way the output is ar's"))),
    "steps": ("--steps", dict(type=int, metavar="S", help="topk/entropy/margin: steps per block (default B/4)")),
    "edit_threshold": ("--edit-threshold", dict(type=float, metavar="E", help=(
        "editing (LLaDA2.1): replace a decoded token whose prediction differs with probability > E (default 0.5; "
        "published Quality mode: --threshold 0.7 --edit-threshold 0.5, Speed mode: 0.5 / 0)"))),
    "max_post_steps": ("--max-post-steps", dict(type=int, metavar="N", help=(
        "editing: forwards after a block's last mask that only edit, until one changes nothing (default 16)"))),
    "temperature": ("--temperature", dict(type=float, metavar="X", help="0 = greedy (default)")),
    "top_p": ("--top-p", dict(type=float, metavar="P", help="nucleus sampling (default 1: off)")),
    "top_k": ("--top-k", dict(type=int, metavar="K", help="top-k sampling (default 0: off)")),
    "seed": ("--seed", dict(type=seed_type, metavar="S", help="sampling seed, a 64-bit signed integer")),
    "runner": ("--runner", dict(choices=RUNNER_CHOICES, help=(
        "eager (default) or compiled: torch.compile'd decode steps (compiles once per shape)"))),
}


def add_decode_args(p, *names: str, help: dict | None = None) -> None:
    """The shared decoding flags: the named DecodeConfig settings (all of them by default), each
    defined here once; `help` rewords a flag's help for a command (e.g. serve's per-request defaults)."""
    for name in names or _DECODE_FLAGS:
        flag, kw = _DECODE_FLAGS[name]
        p.add_argument(flag, **{**kw, "help": (help or {}).get(name, kw["help"])})


def add_generation_args(p) -> None:
    """`clover generate` / `clover chat`: every decoding flag, and --think."""
    add_decode_args(p)
    p.add_argument("--think", action="store_true", help="thinking mode (chat template); reasoning shown apart")


def resolve_auto_block_size(args) -> None:
    """--block-size auto -> the tuned block size (and threshold) for --model on this machine."""
    if getattr(args, "block_size", None) == "auto":
        from ..api import DEFAULT_MODEL
        from ..engine.tuning import resolve_block_size

        args.block_size, args.threshold = resolve_block_size("auto", args.model or DEFAULT_MODEL, args.device)


def decode_config(args, **settings):
    """The DecodeConfig of the decoding flags a command has (those not given keep DecodeConfig's
    defaults), with `settings` on top; --block-size auto resolved. Checked once, by DecodeConfig: a
    bad setting is a one-line UserError, before any model loads."""
    from ..settings import DecodeConfig
    from ..errors import UserError

    resolve_auto_block_size(args)
    given = {name: getattr(args, name) for name in _DECODE_FLAGS if hasattr(args, name)}
    if getattr(args, "model", None):  # a public family's published block size / threshold, unless given
        from ..utils.checkpoint import families_module

        defaults = families_module().decode_defaults(args.model)
        for name, value in defaults.items():
            if given.get(name) is None and name in given:
                given[name] = value
    try:
        cfg = DecodeConfig.from_settings(**given, **settings)
    except ValueError as e:
        raise UserError(str(e)) from None
    check_runner(args, cfg.runner)
    return cfg


def check_runner(args, runner: str | None) -> None:
    """--runner compiled compiles the PyTorch model's own steps, in one process (torch-free: a command
    checks it before anything loads, or starts a process group)."""
    from ..errors import UserError

    if runner == "compiled":
        if getattr(args, "backend", "torch") != "torch":
            raise UserError(f"--runner compiled needs --backend torch (got --backend {args.backend})")
        if max(getattr(args, "tp", 1), getattr(args, "ep", 1)) > 1:
            raise UserError("--runner compiled runs in one process: not with --tp / --ep")


def utf8(data: bytes, name: str) -> str:
    """Text from bytes a user gave, or a one-line error naming where they came from."""
    from ..errors import UserError

    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{name}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def setup_process(args) -> None:
    """Before a subcommand runs (and before it imports torch): OpenMP threads that wait passively
    instead of spinning (a spinning thread on a busy core slows every small forward many times over;
    an explicit OMP_WAIT_POLICY wins), `--threads` and `--linear-dtype` where the command has them."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    threads = getattr(args, "threads", None)
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # read when torch loads
        if "torch" in sys.modules:  # already loaded (the CLI called in-process, e.g. by tests)
            sys.modules["torch"].set_num_threads(threads)
    linear_dtype = getattr(args, "linear_dtype", None)
    if linear_dtype:
        os.environ["CLOVER_LINEAR_DTYPE"] = linear_dtype  # read when the kernels' module loads
        if "clover.ops.linear.tiled" in sys.modules:  # already loaded (in-process callers)
            sys.modules["clover.ops.linear.tiled"].use_bf16_activations(linear_dtype == "bfloat16")


def fill_decode_defaults(args, *names: str) -> None:
    """For the benchmarks, which read their flags themselves: --block-size auto resolved, and the named
    decoding flags that were not given set to DecodeConfig's defaults."""
    from ..settings import DEFAULTS

    resolve_auto_block_size(args)
    for name in names:
        if getattr(args, name, None) is None:
            setattr(args, name, getattr(DEFAULTS.sampling if name in ("temperature", "top_p", "top_k", "seed")
                                        else DEFAULTS, name))
