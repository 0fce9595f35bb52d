"""The chat template: how a conversation (OpenAI-style messages, tools, tool calls, tool results) becomes
the prompt text, in the Qwen3 convention, compact.

* Tools are one signature line each in the system turn (`tools.render_tools`).
* An assistant tool call is a `<tool_call>` block (`calls.format_tool_call`), several calls one block
  each (parallel calls).
* Tool results go back as a user turn of `<tool_response>\\n...\\n</tool_response>` blocks, one per
  consecutive `tool` message.
* Assistant turns whose content does not open a <think> block get the empty one (`think.EMPTY_THINK`),
  exactly what the non-thinking generation prompt writes, so history looks like what the model itself
  produced.

`CHAT_TEMPLATE` is the Jinja template saved with Clover's tokenizer (it honours `enable_thinking`,
default on as in Qwen3); `normalize_messages` / `render_chat` are its pure-Python twin (tested equal),
so training data, `apply_chat_template` and the server agree token for token. `encode` is how a
prompt (text or messages) becomes token ids.
"""

from __future__ import annotations

from typing import Callable

from .calls import format_tool_call
from .think import EMPTY_THINK, THINK_OPEN
from .tools import TOOLS_FOOTER, TOOLS_HEADER, render_tools

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

_J_HEADER = TOOLS_HEADER.replace("\n", "\\n")
CHAT_TEMPLATE = (
    # tools: one signature line each in the system turn (tools.render_tools)
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


def normalize_messages(messages: list[dict], tools: list | None = None) -> list[dict]:
    """OpenAI-style messages (+ tools) -> plain [{"role", "content"}] turns as the template renders them."""
    out: list[dict] = []
    msgs = list(messages)
    if tools:
        sys_text = render_tools(tools)
        if msgs and msgs[0].get("role") == "system":
            sys_text = (msgs[0].get("content") or "") + "\n\n" + sys_text
            msgs = msgs[1:]
        out.append({"role": "system", "content": sys_text})
    for m in msgs:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = "<tool_response>\n" + content + "\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
            continue
        if role == "assistant":
            calls = "\n".join(format_tool_call(c) for c in m.get("tool_calls") or [])
            content = content + ("\n" if content and calls else "") + calls
            if not content.startswith(THINK_OPEN):
                content = EMPTY_THINK + content
        out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def render_chat(messages: list[dict], add_generation_prompt: bool = False, enable_thinking: bool = True,
                tools: list | None = None) -> str:
    """Pure-Python twin of CHAT_TEMPLATE (tested equal), used by the data pipeline."""
    out = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in normalize_messages(messages, tools))
    if add_generation_prompt:
        out += f"{IM_START}assistant\n"
        if not enable_thinking:
            out += EMPTY_THINK
    return out


def encode(tokenizer, prompt: str | list[dict], chat: bool = False, think: bool = False) -> list[int]:
    """Token ids of a prompt; with chat (or a list of messages) through the chat template."""
    if chat or not isinstance(prompt, str):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template (drop --chat)")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=think)
        return tokenizer(prompt, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


def renders_tools(tokenizer) -> bool:
    """Does the tokenizer's own chat template render `tools` (models trained since tool use)?"""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def prompt_renderer(tokenizer) -> Callable[[list[dict], list[dict]], str]:
    """(messages, tools) -> the prompt text up to the non-thinking assistant generation prompt. A
    template that does not know tools gets the messages already normalised (`normalize_messages`), which is
    what the tool-aware template writes."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template: the agent benchmark needs a chat model")
    native = renders_tools(tokenizer)

    def render(messages, tools):
        kw = dict(add_generation_prompt=True, enable_thinking=False, tokenize=False)
        if native:
            return tokenizer.apply_chat_template(messages, tools=tools, **kw)
        return tokenizer.apply_chat_template(normalize_messages(messages, tools), **kw)
    return render
