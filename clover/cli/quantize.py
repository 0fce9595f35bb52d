"""`clover quantize SRC DST`: group-wise INT4 weight-only quantisation (RTN or GPTQ), streamed
layer by layer; the result loads transparently with from_pretrained / clover generate / serve."""

from __future__ import annotations

from . import UserError, print_json
from .options import add_threads_arg


def register(sub) -> None:
    p = sub.add_parser("quantize", help="int4 weight-only quantisation of a checkpoint (RTN or GPTQ)")
    p.add_argument("src", metavar="SRC", nargs="?", help="Clover checkpoint folder (bf16 or fp32), or a public "
                   "block-diffusion family's (SDAR, LLaDA2, Fast-dLLM v2; rtn only)")
    p.add_argument("dst", metavar="DST", nargs="?", help="output folder (must not exist unless --force)")
    p.add_argument("--model", metavar="DIR", help="SRC as a flag")
    p.add_argument("--out", metavar="DIR", help="DST as a flag")
    p.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128],
                   help="input columns sharing one scale / zero point (default 128)")
    p.add_argument("--method", choices=["rtn", "gptq"], default="rtn",
                   help="rtn: round to nearest; gptq: error-compensating, needs calibration text (default rtn)")
    p.add_argument("--calib", metavar="FILE", help="gptq calibration data: .jsonl (text / messages / input_ids) "
                   "or .txt (default: the default model's held-out slice)")
    p.add_argument("--calib-samples", type=int, default=64, help="calibration rows (default 64)")
    p.add_argument("--calib-seq-len", type=int, default=256, help="tokens per calibration row (default 256)")
    p.add_argument("--activations", choices=["float32", "int8"], default="float32",
                   help="int8: the products round activations to int8 per block of 32 (as llama.cpp's q4_0), on "
                        "clover's int4 x int8 CPU kernel; float32: exact activations (default)")
    p.add_argument("--quantize-head", action="store_true", help="also quantise lm_head (default: kept bf16)")
    p.add_argument("--max-shard-size", default="2GB", help="largest output shard (default 2GB)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    add_threads_arg(p)
    p.set_defaults(func=run)


def folders(args) -> tuple[str, str]:
    """(SRC, DST), each given once: positionally or as --model / --out."""
    pairs = (("SRC", args.src, "--model", args.model), ("DST", args.dst, "--out", args.out))
    for what, positional, flag, value in pairs:
        if positional and value:
            raise UserError(f"give {what} once: positionally or as {flag}")
        if not (positional or value):
            raise UserError(f"missing {what} (or {flag} DIR)")
    return args.src or args.model, args.dst or args.out


def run(args) -> int:
    from ..utils.checkpoint import check_folder, families_module

    args.src, args.dst = folders(args)
    check_folder(args.src)  # a bad source: one line naming the file, before torch is imported

    from ..api import check_checkpoint
    from ..convert.quantize import QuantizationError, quantize_checkpoint
    from .convert import parse_size

    if not families_module().is_family_folder(args.src):  # a family's shapes: checked as it is read
        check_checkpoint(args.src)  # and its shapes against its config, before anything is written
    quiet = {"notice": lambda msg: None} if args.json else {}
    try:
        summary = quantize_checkpoint(
            args.src, args.dst, group_size=args.group_size, method=args.method, calib=args.calib,
            calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len, quantize_head=args.quantize_head,
            force=args.force, max_shard_bytes=parse_size(args.max_shard_size), activations=args.activations, **quiet,
        )
    except QuantizationError as e:
        raise UserError(str(e)) from None
    if args.json:
        print_json(summary)
    else:
        ratio = summary["quantized_bytes"] / max(1, summary["src_bytes_quantized"])
        print(f"wrote {summary['dst']}: {summary['quantized_params']:,} parameters in int4 ({args.method}, group "
              f"{args.group_size}; {ratio:.3f}x their source size), {summary['kept_params']:,} kept in bf16")
    return 0
