"""`clover train-tokenizer`: train a byte-level BPE tokenizer with Clover's special tokens
(<|endoftext|>, <|mask|>, chat roles, <think>/</think>, <tool_call>/</tool_call>), single-digit
number tokens and a Qwen-style chat template (enable_thinking)."""

from __future__ import annotations

from pathlib import Path

from . import UserError, print_json


def register(sub) -> None:
    p = sub.add_parser("train-tokenizer", help="train a BPE tokenizer with Clover's special tokens",
                       description=__doc__)
    p.add_argument("files", nargs="+", help="text or JSONL ('text' / chat 'messages') files")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--out", required=True, help="output folder (tokenizer.json + tokenizer_config.json)")
    p.set_defaults(func=run)


def _texts(files):
    from ..data.dataset import read_records

    for f in files:
        for rec in read_records(f):
            if "messages" in rec:
                yield "\n".join(m["content"] for m in rec["messages"])
            else:
                yield rec["text"]


def run(args) -> int:
    from ..data.tokenizer import load_tokenizer, train_tokenizer

    for f in args.files:
        if not Path(f).exists():
            raise UserError(f"no such file: {f}")
    out = train_tokenizer(_texts(args.files), args.vocab_size, args.out)
    tok = load_tokenizer(out)
    print_json({"out": str(out), "vocab_size": len(tok), "mask_token_id": tok.mask_token_id,
                "eos_token_id": tok.eos_token_id})
    return 0
