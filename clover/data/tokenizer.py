"""Byte-level BPE tokenizer for Clover models, trained with HF `tokenizers`.

Digits are always single tokens (so arithmetic is learnable); the special tokens Clover needs come
first (ids 0..N-1) and are never split. The saved folder loads with
`transformers.AutoTokenizer.from_pretrained` and carries a Qwen-style chat template that honours
`enable_thinking` (default on, as in Qwen3): with `enable_thinking=False` the generation prompt
ends with an empty "<think>\\n\\n</think>\\n\\n" block.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from clover.agent.tool_format import EMPTY_THINK, TOOLS_FOOTER, TOOLS_HEADER, normalize_messages

EOS = "<|endoftext|>"
MASK = "<|mask|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, MASK, IM_START, IM_END, "<think>", "</think>", "<tool_call>", "</tool_call>", "<|pad|>"]
PLAIN_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>")  # atomic, but kept by decode

_J_HEADER = TOOLS_HEADER.replace("\n", "\\n")
CHAT_TEMPLATE = (
    # tools: one signature line each in the system turn (clover.agent.tool_format)
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}{{- (messages[0].content or '') + '\\n\\n' -}}{%- endif -%}"
    "{{- '" + _J_HEADER + "' -}}"
    "{%- for t in tools -%}"
    "{%- set fn = t.function if t.function is defined else t -%}"
    "{%- set p = fn.parameters or {} -%}{%- set req = p.required or [] -%}"
    "{{- fn.name + '(' -}}"
    "{%- for k, v in (p.properties or {}).items() -%}"
    "{{- (', ' if not loop.first else '') + k + ('' if k in req else '?') + ': ' -}}"
    "{%- if v.enum is defined -%}{{- v.enum | map('tojson') | join('|') -}}"
    "{%- else -%}{{- (v.type or 'any') | string -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- ')' -}}{%- if fn.description -%}{{- ' - ' + fn.description -}}{%- endif -%}{{- '\\n' -}}"
    "{%- endfor -%}"
    "{{- '" + TOOLS_FOOTER + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if loop.first and tools and m.role == 'system' -%}"
    # consecutive tool results share one user turn
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user\\n' -}}{%- else -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_response>\\n' + (m.content or '') + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    # assistant turns without a <think> block get the empty one (what non-thinking generation writes)
    "{%- elif m.role == 'assistant' -%}"
    "{%- set c = m.content or '' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if not c.startswith('<think>') -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- c -}}"
    "{%- for tc in (m.tool_calls or []) -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{%- if c or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' -}}"
    "{%- if f.arguments is string -%}{{- f.arguments -}}"
    "{%- else -%}{{- (f.arguments if f.arguments is defined else {}) | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def render_chat(messages: list[dict], add_generation_prompt: bool = False, enable_thinking: bool = True,
                tools: list | None = None) -> str:
    """Pure-Python twin of CHAT_TEMPLATE (tested equal), used by the data pipeline."""
    out = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in normalize_messages(messages, tools))
    if add_generation_prompt:
        out += f"{IM_START}assistant\n"
        if not enable_thinking:
            out += EMPTY_THINK
    return out


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
    return AutoTokenizer.from_pretrained(str(p))
