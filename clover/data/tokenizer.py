"""Byte-level BPE tokenizer for Clover models, trained with HF `tokenizers`.

Digits are always single tokens (so arithmetic is learnable); the special tokens Clover needs come
first (ids 0..N-1) and are never split. The saved folder loads with
`transformers.AutoTokenizer.from_pretrained` and carries Clover's chat template
(`clover.chat.CHAT_TEMPLATE`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from clover.chat import CALL_FRAME, CHAT_TEMPLATE, IM_END, IM_START, THINK_CLOSE, THINK_OPEN

EOS = "<|endoftext|>"
MASK = "<|mask|>"
PLAIN_ADDED = (THINK_OPEN, THINK_CLOSE) + CALL_FRAME  # atomic, but kept by decode
SPECIAL_TOKENS = [EOS, MASK, IM_START, IM_END, *PLAIN_ADDED, "<|pad|>"]


def build_bpe(texts: Iterable[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # <think>, </think>, <tool_call>, </tool_call> are atomic but not "special" (as in Qwen): decoding
    # with skip_special_tokens keeps them, so a reply's reasoning block stays visible.
    spec = json.loads(tok.to_str())
    for t in spec["added_tokens"]:
        if t["content"] in PLAIN_ADDED:
            t["special"] = False
    return Tokenizer.from_str(json.dumps(spec))


def save_tokenizer(tok, out_dir: str | Path, model_max_length: int = 4096) -> Path:
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token="<|pad|>", mask_token=MASK,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out))
    return out


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> Path:
    if vocab_size < len(SPECIAL_TOKENS) + 257:
        raise ValueError(f"vocab_size {vocab_size} is too small (need > {len(SPECIAL_TOKENS) + 257})")
    return save_tokenizer(build_bpe(texts, vocab_size), out_dir)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    p = Path(path)
    if not (p / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer.json in {p}")
    from ..utils.checkpoint import check_tokenizer

    check_tokenizer(p)  # a broken file: one line naming it
    return AutoTokenizer.from_pretrained(str(p))
