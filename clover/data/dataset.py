"""Training data: plain text, JSONL ({"text": ...}) and chat JSONL ({"messages": [...]}).

Every document becomes token ids plus a loss mask (1 = this token is a training target). Plain text
and "text" records train on every token; chat records are rendered with the chat template
(`clover.chat.render_chat`) and train on the assistant turns only (their content and <|im_end|>).
Each document ends with end-of-text (a target too). Documents are concatenated and cut into rows of
`seq_len` tokens (`pack`).

`chat_eos_pad` (training only) appends that many more end-of-text targets to each chat record, as
LLaDA's SFT pads replies with |EOS|. Why: in a packed row the first targets after a reply's end are
often the next record's assistant turn (its system and user parts are not targets), so a masked
position a few tokens past a finished answer learns "some other record's reply", such as a tool call;
padding teaches end-of-text there instead (recipes/default/README.md has what it changed).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from clover.chat import EMPTY_THINK, IM_END, IM_START, normalize_messages

from .tokenizer import EOS


def read_records(path: str | Path) -> list[dict]:
    """A .txt file is one document per blank-line-separated paragraph block; .jsonl one per line."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no such data file: {p}")
    if p.suffix == ".jsonl":
        out = []
        with p.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    rec = json.loads(line)
                    if not isinstance(rec, dict) or not ("text" in rec or "messages" in rec):
                        raise ValueError(f"{p}:{n}: a record needs 'text' or 'messages'")
                    out.append(rec)
        return out
    text = p.read_text(encoding="utf-8")
    return [{"text": t} for t in text.split("\n\n\n") if t.strip()]


def encode_record(rec: dict, tok, chat_eos_pad: int = 0) -> tuple[list[int], list[int]]:
    eos = tok.convert_tokens_to_ids(EOS)
    if "messages" in rec:
        ids, mask = [], []
        for m in normalize_messages(rec["messages"], rec.get("tools")):
            head = tok.encode(f"{IM_START}{m['role']}\n", add_special_tokens=False)
            body = tok.encode(f"{m['content']}{IM_END}", add_special_tokens=False)
            tail = tok.encode("\n", add_special_tokens=False)
            train = m["role"] == "assistant"
            if train and m["content"].startswith(EMPTY_THINK):
                # the empty think block is part of the non-thinking generation prompt: not a target
                pre = tok.encode(EMPTY_THINK, add_special_tokens=False)
                rest = tok.encode(m["content"][len(EMPTY_THINK):] + IM_END, add_special_tokens=False)
                ids += head + pre + rest + tail
                mask += [0] * (len(head) + len(pre)) + [1] * len(rest) + [0] * len(tail)
                continue
            ids += head + body + tail
            mask += [0] * len(head) + [int(train)] * len(body) + [0] * len(tail)
        return ids + [eos] * (1 + chat_eos_pad), mask + [1] * (1 + chat_eos_pad)
    ids = tok.encode(rec["text"], add_special_tokens=False)
    return ids + [eos], [1] * (len(ids) + 1)


def encode_files(paths, tok, chat_eos_pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = [], []
    for p in paths:
        for rec in read_records(p):
            a, b = encode_record(rec, tok, chat_eos_pad)
            ids += a
            mask += b
    if not ids:
        raise ValueError(f"no training data in {', '.join(map(str, paths))}")
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def pack(ids: torch.Tensor, mask: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the token stream into [N, seq_len] rows (the tail shorter than a row is dropped, unless
    the stream is shorter than one row: then it is repeated)."""
    if ids.numel() < seq_len:
        reps = -(-seq_len // ids.numel())
        ids, mask = ids.repeat(reps), mask.repeat(reps)
    n = ids.numel() // seq_len
    return ids[: n * seq_len].view(n, seq_len), mask[: n * seq_len].view(n, seq_len)
