"""`clover train`: train a Clover model (objective `ar`, `block_diffusion` or `distill`: self-distillation
on the model's own greedy answers, clover/training/distill.py).

Options come from a TOML config file (`--config`, keys = TrainConfig fields) and flags; flags win.
List/dict options take JSON on the command line, e.g. --block-schedule '[[0.2,[1]],[1.0,[4,8]]]'.

Across processes: `torchrun --nproc-per-node N -m clover train --config ...` shards the model with
FSDP2 and each rank trains on its rows of every global batch (`batch_size` stays the global batch);
checkpoints are sharded (torch.distributed.checkpoint) and resume on any number of processes;
only rank 0 prints and writes metrics (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
import typing

from ..distributed.flags import add_launch_flag
from . import UserError, print_json


def _fields():
    from ..training.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    return TrainConfig, [(f, hints[f.name]) for f in dataclasses.fields(TrainConfig)]


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model (ar, block_diffusion or distill objective)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML file with TrainConfig keys")
    p.add_argument("--resume", action="store_true", help="continue from <out_dir>/checkpoints/latest")
    add_field_args(p)  # TrainConfig is torch-free (clover/training/config.py)
    add_launch_flag(p)
    p.set_defaults(func=run)


def add_field_args(p) -> None:
    _, fields = _fields()
    for f, typ in fields:
        flag = "--" + f.name.replace("_", "-")
        if typ is bool:
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        elif typ in (int, float, str):
            p.add_argument(flag, dest=f.name, type=typ, default=None)
        else:
            p.add_argument(flag, dest=f.name, type=str, default=None, metavar="JSON")


def build_config(args):
    TrainConfig, fields = _fields()
    values = {}
    if args.config:
        try:
            with open(args.config, "rb") as fh:
                values.update(tomllib.load(fh))
        except tomllib.TOMLDecodeError as e:
            raise UserError(f"{args.config}: {e}") from None
    for f, typ in fields:
        v = getattr(args, f.name, None)
        if v is None:
            continue
        if typ in (list, dict) or typing.get_origin(typ) in (list, dict):
            try:
                v = json.loads(v)
            except json.JSONDecodeError:
                if f.name.endswith("_files"):
                    v = [s for s in v.split(",") if s]
                else:
                    raise UserError(f"--{f.name.replace('_', '-')}: not valid JSON: {v!r}") from None
        values[f.name] = v
    cfg = TrainConfig.from_dict(values)
    cfg.validate()
    cfg.check_files()
    return cfg


def run(args) -> int:
    cfg = build_config(args)  # option mistakes are one line before torch loads
    from ..training.config import RunStopped, resume_point

    resume_point(cfg, args.resume)  # checkpoint mistakes too (under torchrun: from rank 0 alone, before the group)
    from ..distributed import runtime
    from ..training.trainer import Trainer

    d = runtime.from_env(cfg.device)  # None unless launched by torchrun with several processes
    try:
        summary = Trainer(cfg, resume=args.resume, dist=d).fit()
    except RunStopped as e:  # stop_after reached while the teacher was answering: its finished parts are kept
        summary = {"step": 0, "stopped": True, "reason": str(e)}
    finally:
        if d is not None:
            runtime.shutdown(d)
    if d is None or d.main:
        print_json(summary)
    return 0
