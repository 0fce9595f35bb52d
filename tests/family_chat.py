"""Random-weight family folders (tests/test_families.py's published layout) with a tokenizer that can
spell JSON and tool calls, and a chat template that renders tools in each family's published style:
Qwen3 / Qwen2.5's for SDAR and Fast-dLLM v2 (ChatML turns, the tools as JSON lines between <tools>
tags in the system turn, `<tool_call>` JSON blocks, results as `<tool_response>` blocks in a user
turn), Ling 2.0's for LLaDA2 (`<role>SYSTEM</role>` ... `<|role_end|>` turns, the same `<tool_call>`
JSON blocks, results in an OBSERVATION turn). Written here in that style; no template is copied."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from test_families import MASK, VOCAB, write_family

TOOLS_INTRO = ("# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
               "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>")
TOOLS_OUTRO = ("\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
               "\\\"arguments\\\": <args-json-object>}\\n</tool_call>")
# one assistant tool call, as both styles write it
CALLS = ("{%- for tc in (m.tool_calls or []) -%}{%- set f = tc.function if tc.function is defined else tc -%}"
         "{%- if m.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
         "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' -}}"
         "{%- if f.arguments is string -%}{{- f.arguments -}}{%- else -%}{{- f.arguments | tojson -}}{%- endif -%}"
         "{{- '}\\n</tool_call>' -}}{%- endfor -%}")
TOOL_LIST = "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"

QWEN_TOOLS_TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '" + TOOLS_INTRO + "' -}}" + TOOL_LIST + "{{- '" + TOOLS_OUTRO + "<|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' + (m.content or '') -}}" + CALLS +
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")

LING_TOOLS_TEMPLATE = (
    "{{- '<role>SYSTEM</role>' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n' -}}{%- endif -%}"
    "{%- if tools -%}{{- '" + TOOLS_INTRO + "' -}}" + TOOL_LIST + "{{- '" + TOOLS_OUTRO + "\\n' -}}{%- endif -%}"
    "{{- 'detailed thinking off<|role_end|>' -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'user' -%}{{- '<role>HUMAN</role>' + m.content + '<|role_end|>' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<role>OBSERVATION</role>' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|role_end|>' -}}{%- endif -%}"
    "{%- elif m.role == 'assistant' -%}{{- '<role>ASSISTANT</role>' + (m.content or '') -}}" + CALLS +
    "{{- '<|role_end|>' -}}"
    "{%- else -%}{{- '<role>SYSTEM</role>' + m.content + '<|role_end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<role>ASSISTANT</role>' -}}{%- endif -%}")

CHARS = string.ascii_letters + string.digits + " \n.,!?:;'-()\"{}[]_<>/|="


def chat_tokenizer(model_type: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with the family's specials (its end of turn at id 2, the config's
    EOS), atomic `<tool_call>` / `</tool_call>`, and every character JSON needs."""
    ling = model_type == "llada2_moe"
    end = "<|role_end|>" if ling else "<|im_end|>"
    specials = ["<|endoftext|>", "<role>" if ling else "<|im_start|>", end, MASK[model_type], "<tool_call>",
                "</tool_call>"]
    tokens = specials + list(CHARS)
    assert len(tokens) <= VOCAB
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=end, pad_token="<|endoftext|>",
                                   additional_special_tokens=[specials[1], MASK[model_type]])
    fast.add_tokens(["<tool_call>", "</tool_call>"])  # atomic, kept by decode (as the published tokenizers)
    fast.chat_template = LING_TOOLS_TEMPLATE if ling else QWEN_TOOLS_TEMPLATE
    return fast


def write_chat_family(folder, model_type: str, seed: int = 0) -> None:
    """A random-weight folder of the family (published layout) whose tokenizer speaks JSON and tools
    (a longer context: the tools' JSON, one character a token, fills hundreds)."""
    write_family(folder, model_type, seed, max_position_embeddings=2048)
    chat_tokenizer(model_type).save_pretrained(folder)
