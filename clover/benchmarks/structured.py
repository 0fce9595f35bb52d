"""`clover bench structured`: schema-guided infilling vs the grammar path vs free generation on seeded
JSON requests, and (`--corpus`) coverage on the real-world schema corpus.

The seeded harness itself (cases, methods, scoring: `run_benchmark`, `KINDS`, `METHODS`) is still in
clover/structured/bench.py this round; it moves into this module (one home for benchmarks), which
then imports nothing from clover.structured but the decoding it measures."""

from __future__ import annotations

import json

from ..errors import UserError
from .report import markdown_table, progress, set_threads, write_json


def _rate_cell(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _kinds_and_overall(summary: dict) -> list[tuple[str, dict]]:
    """(label, metrics) for each kind, then the bold overall row."""
    return [*summary["per_kind"].items(), ("**overall**", summary["overall"])]


def run(args) -> int:
    """Schema-guided infilling vs free generation + validation on seeded JSON requests."""
    import torch

    from ..api import load
    from ..structured.bench import KINDS, METHODS, run_benchmark

    if args.n < 1 or args.max_new_tokens < 1:
        raise UserError("--n and --max-new-tokens must be >= 1")
    if args.corpus:
        return run_corpus(args)
    if not 0 <= args.threshold <= 1:
        raise UserError("--threshold must be in [0, 1]")
    set_threads(args.threads)
    model, tokenizer = load(args.model, args.device)
    if not 2 <= args.block_size <= model.config.max_block_size:
        raise UserError(f"--block-size must be in [2, {model.config.max_block_size}]")
    with progress(args.n * len(KINDS), "bench structured") as bar:
        out = run_benchmark(model, tokenizer, args.n, args.seed, args.threshold, args.block_size,
                            args.max_new_tokens, progress=bar.update)
    described = args.model or "default model"
    print(f"Structured output: {described}; {args.n} seeded cases of each of {len(KINDS)} kinds (seed {args.seed}), "
          f"threshold {args.threshold:g}, block {args.block_size}, {model.device} "
          f"{str(model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads. infill = generate_json "
          f"(tool kinds: infill_json inside the <tool_call> frame, as the server's forced calls); grammar = the same "
          f"schema decoded left to right under its xgrammar mask (method='grammar'); free = the same "
          f"prompt generated freely (low_confidence, up to {args.max_new_tokens} tokens), then parsed and validated. "
          f"Valid = parses and validates; exact = valid and every field equals the ground truth; fields = share of "
          f"fields right; forwards after the prompt prefill. docs/structured.md.\n")
    rows = [[m, kind, g["cases"], *(_rate_cell(g[k]) for k in ("valid_rate", "exact_rate", "field_rate")),
             f"{g['forward_passes_per_case']:.1f}", f"{g['seconds_per_case']:.3f}"]
            for m in METHODS for kind, g in _kinds_and_overall(out["results"][m])]
    print(markdown_table(["method", "kind", "cases", "valid %", "exact %", "fields %", "forwards / case", "s / case"],
                         rows))
    if args.records:
        with open(args.records, "w") as f:
            for rec in out["records"]:
                f.write(json.dumps(rec) + "\n")
    write_json(args, dict(model=described, threads=torch.get_num_threads(),
                          **{k: v for k, v in out.items() if k != "records"}))
    return 0


def run_corpus(args) -> int:
    """Coverage (valid / total) of the schema corpus: every entry infilled, decoded under its grammar
    or refused; 0 invalid replies is the guarantee, coverage the share answered validly."""
    import torch

    from ..api import load
    from ..structured import corpus

    if args.per_file < 0 or args.max_tokens < 1:
        raise UserError("--per-file must be >= 0 and --max-tokens >= 1")
    entries = corpus.load(per_file=args.per_file, only=args.only)
    if not entries:
        raise UserError(f"--only {args.only!r} matches no corpus entry")
    set_threads(args.threads)
    model, tokenizer = load(args.model, args.device)
    records = []
    with progress(len(entries), "bench structured --corpus") as bar, torch.inference_mode():
        for e in entries:
            records.append(corpus.answer(model, tokenizer, e, args.max_tokens, args.threshold, args.block_size))
            bar.update(1)
    out = corpus.summarize(records)
    described = args.model or "default model"
    print(f"Structured output on the schema corpus: {described}; {len(entries)} schemas (SchemaStore documents via "
          f"check-jsonschema with {args.per_file} definitions each, JSON Schema meta-schemas, pydantic models, "
          f"BFCL-style functions, OpenAPI/Kubernetes payloads), each answered as a json_schema response_format "
          f"(normalised, then infilled or decoded under its grammar, or refused: a 400 naming the keyword), "
          f"up to {args.max_tokens} tokens, {model.device}, {torch.get_num_threads()} threads. valid = json.loads + "
          f"jsonschema accept the returned text; coverage = valid / total; invalid = complete replies that fail "
          f"(never returned by the server); cut = max_tokens ran out (finish_reason length). docs/structured.md.\n")
    header = ["", "schemas", "valid", "coverage %", "refused", "invalid", "cut", "forwards / reply", "s / reply"]

    def row(label, g):
        return [label, g["total"], g["valid"], _rate_cell(g["coverage"]), g["refused"], g["invalid"] - g["incomplete"],
                g["incomplete"], f"{g['forward_passes_per_reply']:.1f}", f"{g['seconds_per_reply']:.2f}"]
    print(markdown_table(["source"] + header[1:], [row(k, g) for k, g in out["per_source"].items()]
                         + [row("**overall**", out["overall"])]))
    print()
    print(markdown_table(["method"] + header[1:], [row(k, g) for k, g in out["per_method"].items()]))
    refused = {}
    for r in records:
        if r["method"] == "refused":
            refused[r["keyword"]] = refused.get(r["keyword"], 0) + 1
    if refused:
        print("\nRefused, by keyword: " + ", ".join(f"`{k}` {v}" for k, v in sorted(refused.items(), key=lambda kv: -kv[1])))
    if args.records:
        with open(args.records, "w") as f:
            for rec in records:
                f.write(json.dumps(rec, default=str) + "\n")
    write_json(args, dict(model=described, threads=torch.get_num_threads(), schemas=len(entries), **out))
    return 0
