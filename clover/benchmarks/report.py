"""What every benchmark writes: a markdown table on stdout, the results as JSON (`--json`), progress
on stderr; and the torch threads a run uses."""

from __future__ import annotations

import json
import os
import sys


def set_threads(threads: int | None) -> None:
    """torch threads for a benchmark run: the flag's, else one per core."""
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)


def load_checked(args, block_sizes, low: int = 1, flag: str = "--block-size"):
    """Set the threads, load --model and check each block size against it (a one-line UserError
    naming `flag`): the start every model benchmark shares. Returns (model, tokenizer)."""
    from ..api import load
    from ..errors import UserError
    from ..settings import check_block_size

    set_threads(args.threads)
    model, tokenizer = load(args.model, args.device)
    try:
        for b in block_sizes:
            check_block_size(b, model, low=low)
    except ValueError as e:
        raise UserError(f"{flag}: {e}") from None
    return model, tokenizer


def write_json(args, obj) -> None:
    """The results as JSON: to --json FILE, or to stdout for a bare --json; nothing without --json."""
    if not args.json:
        return
    if args.json == "-":
        args.json_stream.write(json.dumps(obj, indent=2, default=float) + "\n")
        return
    with open(args.json, "w") as f:
        json.dump(obj, f, indent=2, default=float)


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def progress(total: int, desc: str):
    """A progress bar on stderr (silent unless stderr is a terminal), usable as a context manager."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, disable=not sys.stderr.isatty())


def progress_iter(items, desc):
    """`items` with a progress bar on stderr (silent unless stderr is a terminal)."""
    from tqdm import tqdm

    return tqdm(items, desc=desc, file=sys.stderr, leave=False, disable=not sys.stderr.isatty())
