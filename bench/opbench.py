"""The start that the op micro-benchmarks (bench/linear.py, bench/moe_dispatch.py) share: their flags,
the torch threads, and the model config whose dims give the shapes timed."""

from __future__ import annotations

import argparse

import torch


def parse(doc: str, sizes_flag: str, sizes_default: str, what: str):
    """(args, config): --model, --threads, `sizes_flag` (a comma list) and --repeats parsed, threads set."""
    from clover.api import DEFAULT_MODEL
    from clover.models import CloverConfig

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help=f"model folder whose config gives the {what}")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(sizes_flag, default=sizes_default)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args, CloverConfig.from_pretrained(args.model)
