"""`clover convert SRC DST`: a Hugging Face Qwen3-Next / Qwen3.5-MoE checkpoint -> a Clover checkpoint."""

from __future__ import annotations

import re

from . import UserError, print_json
from .options import add_threads_arg

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'2GB', '500MiB', '123456' -> bytes (decimal units as in transformers' max_shard_size)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in UNITS:
        raise UserError(f"--max-shard-size: cannot read {text!r} (e.g. 2GB, 500MB, 1048576)")
    return max(1, int(float(m.group(1)) * UNITS[m.group(2).upper()]))


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert a Hugging Face AR checkpoint folder into a Clover checkpoint")
    p.add_argument("src", metavar="SRC", help="Qwen3-Next / Qwen3.5-MoE checkpoint folder (safetensors)")
    p.add_argument("dst", metavar="DST", help="output folder (must not exist unless --force)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast weights (default: keep the source dtype)")
    p.add_argument("--max-shard-size", default="2GB", help="largest output shard (default 2GB)")
    p.add_argument("--mask-token-id", type=int, help="use this token id as the mask (default: add <|mask|>)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    add_threads_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..utils.checkpoint import check_folder

    check_folder(args.src, clover=False)  # a bad source: one line naming the file, before torch is imported

    from ..convert.convert import convert_checkpoint

    if args.mask_token_id is not None and args.mask_token_id < 0:
        raise UserError(f"--mask-token-id must be >= 0, got {args.mask_token_id}")
    summary = convert_checkpoint(
        args.src, args.dst, dtype=args.dtype, max_shard_bytes=parse_size(args.max_shard_size),
        mask_token_id=args.mask_token_id, force=args.force, progress=False if args.json else None,
    )
    if args.json:
        print_json(summary)
    else:
        print(f"wrote {summary['dst']}: {summary['num_params']:,} parameters in {len(summary['shards'])} "
              f"shard(s), vocab {summary['vocab_size']}, mask token id {summary['mask_token_id']}")
    return 0
