"""Argparse flags for running a command across processes (argparse only: no torch here)."""

from __future__ import annotations

import os


def is_worker() -> bool:
    """Under torchrun, a rank other than 0: it serves rank 0's model calls (no torch needed to ask)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) > 0


def add_launch_flag(p) -> None:
    """--nproc-per-node: start the command's ranks here, as torchrun would (clover/distributed/launch.py)."""
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="run on N local processes, as `torchrun --standalone --nproc-per-node N -m clover ...` "
                        "does, but a mistake in the arguments is one line and exit code 2")


def add_parallel_flags(p) -> None:
    """--tp / --ep of the commands that run a model (`clover train` takes `ep` from TrainConfig)."""
    g = p.add_argument_group("parallelism (under torchrun; docs/distributed.md)")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallel over N processes: attention / GDN heads, shared expert and expert "
                        "columns split, one all-reduce per block output (default 1)")
    g.add_argument("--ep", type=int, default=1, metavar="N",
                   help="expert parallel over N processes: the routed experts split across them (default 1)")
