"""Flags shared by the subcommands that run a model (--model, --device, --threads, --seed) and the
process set-up they imply. Nothing here imports torch: `--help` and argument errors stay instant."""

from __future__ import annotations

import argparse
import os
import sys

from ..api import SEED_MAX, SEED_MIN  # light (no torch); one home for the bounds the server checks too


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


def add_model_args(p) -> None:
    p.add_argument("--model", help="model folder (default: the shipped default model)")
    p.add_argument("--device", type=device_type, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    add_threads_arg(p)


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
    an explicit OMP_WAIT_POLICY wins), and `--threads` where the command has it."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    threads = getattr(args, "threads", None)
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # read when torch loads
        if "torch" in sys.modules:  # already loaded (the CLI called in-process, e.g. by tests)
            sys.modules["torch"].set_num_threads(threads)
