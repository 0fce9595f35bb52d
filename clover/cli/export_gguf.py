"""`clover export-gguf MODEL_DIR OUT.gguf`: the model as a GGUF for llama.cpp (its qwen3next
architecture; block size 1 is the causal LM, so stock llama.cpp runs it as an AR model), with the
tokenizer, chat template and the block-diffusion additions as `clover.*` keys (docs/llamacpp.md)."""

from __future__ import annotations

from . import UserError, print_json

OUTTYPES = ("f32", "bf16", "q8_0", "q4_0", "q4_k")  # clover.backends.gguf_export.OUTTYPES (argparse only here)


def register(sub) -> None:
    p = sub.add_parser("export-gguf", help="write a model as GGUF for llama.cpp", description=__doc__)
    p.add_argument("model_dir", metavar="MODEL_DIR", help="Clover checkpoint folder (bf16 or fp32)")
    p.add_argument("out", metavar="OUT.gguf", help="output file (written to a temp file, then renamed)")
    p.add_argument("--outtype", choices=OUTTYPES, default="bf16",
                   help="tensor type of the weight matrices (default bf16; norms, conv and routers stay f32; "
                        "q4_k uses llama.cpp's quantizer and needs `make llamacpp`)")
    p.add_argument("--llamacpp", metavar="DIR", help="llama.cpp build folder for q4_k (default: build/llamacpp "
                   "or $CLOVER_LLAMACPP)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from ..utils.checkpoint import check_folder

    check_folder(args.model_dir)  # the checks every command makes, one line naming the file, before torch
    if args.outtype == "q4_k":  # llama.cpp's quantizer: its build is needed, known before any weight is read
        from ..backends.llamacpp import LlamaCppError, require_build

        try:
            require_build(args.llamacpp)
        except LlamaCppError as e:
            raise UserError(str(e)) from None
    try:
        from ..backends.gguf_export import ExportError, export_gguf
    except ModuleNotFoundError as e:
        if e.name == "gguf":
            raise UserError("export-gguf needs the gguf package: pip install 'gguf>=0.19,<0.20'") from None
        raise
    if not args.out.endswith(".gguf"):
        raise UserError(f"{args.out}: the output name must end in .gguf")
    if Path(args.out).exists() and not args.force:
        raise UserError(f"{args.out} exists (pass --force to replace it)")
    try:
        summary = export_gguf(args.model_dir, args.out, args.outtype, lib_dir=args.llamacpp)
    except ExportError as e:
        raise UserError(str(e)) from None
    if args.json:
        print_json(summary)
    else:
        types = ", ".join(f"{n} {k}" for k, n in sorted(summary["tensor_types"].items()))
        print(f"wrote {summary['path']} ({summary['bytes'] / 1e6:.1f} MB, {summary['arch']}, {types})")
    return 0
