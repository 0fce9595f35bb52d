"""OpenAI request bodies (pydantic) and the response / chunk / error shapes the server writes.

Unknown fields are accepted and ignored (clients send many), but for the sampling fields of OpenAI and
vLLM this server does not honour (`NOT_HONOURED`: penalties, logit_bias, top_logprobs, best_of, ...),
which are 400s unless they hold a value that changes nothing; known ones have strict types, as OpenAI
checks them (`max_tokens: "4"`, `n: true`, `stream: "yes"` are 400s naming the field). Clover's own
decoding parameters (`block_size`, `threshold`, `mode`, `steps`) and vLLM's `ignore_eos` are extra body fields
(`extra_body=` in the openai client). Function calling (`tools`, `tool_choice`, `parallel_tool_calls`)
is checked by `ChatRequest.tool_plan`; `ToolPlan` parses the reply (docs/serving.md)."""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..chat import ToolSpecError, function_spec, parse_tool_calls, text_before_call, validate_tools
from ..settings import SEED_MAX, SEED_MIN  # OpenAI's seed: a 64-bit signed integer


_SURROGATE = re.compile("[\ud800-\udfff]")


def bad_text(value, path: str = "") -> str | None:
    """The dotted path ("messages.0.content") of the first string in a decoded JSON body that holds a
    lone UTF-16 surrogate (JSON's "\\ud800" decodes to one; it is no Unicode text and no tokenizer
    takes it), "" for the body itself, None when all text is good. Keys are checked too; iterative, so
    a deeply nested body cannot exhaust the stack."""
    stack = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return where
            continue
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, (list, tuple)) else ()
        children = []
        for k, child in items:
            shown = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", k) if isinstance(k, str) else k
            at = f"{where}.{shown}" if where else str(shown)
            if isinstance(k, str) and shown != k:
                return at
            children.append((at, child))
        stack.extend(reversed(children))  # first string first
    return None


# OpenAI / vLLM request fields this server does not honour, with the values that change nothing: any other
# value is a 400 naming the field (`not_honoured`), never a reply that silently ignored it
NOT_HONOURED = {"presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "top_logprobs": (0,),
                "repetition_penalty": (1,), "min_p": (0,), "min_tokens": (0,), "stop_token_ids": ([],),
                "best_of": (1,), "suffix": ("",), "guided_json": (), "guided_regex": (), "guided_choice": (),
                "guided_grammar": ()}


def not_honoured(req: BaseModel) -> tuple[str, str] | None:
    """(field, why) of the first NOT_HONOURED field the request sets to a value that would matter."""
    extra = req.model_extra or {}
    for name, same in NOT_HONOURED.items():
        value = extra.get(name)
        if value is None or (value in same and not isinstance(value, bool)):
            continue
        if name.startswith("guided_"):
            return name, f"{name} is not supported: ask for structured output with response_format (json_schema)"
        if name == "top_logprobs":
            return name, "logprobs are not supported"
        return name, f"{name} is not supported: this server's decoding has no such setting (leave it out)"
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    # strict types, as OpenAI checks them: "4" or true is no max_tokens, "yes" no stream (400 naming the field)
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)  # greedy by default (deterministic serving)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Clover's own decoding parameters (extra body fields)
    block_size: int | None = Field(None, ge=1)
    threshold: float | None = Field(None, ge=0.0, le=1.0)
    mode: str | None = None
    steps: int | None = Field(None, ge=1)
    draft: str | None = None  # self_spec's drafts (settings.DRAFTS)
    edit_threshold: float | None = Field(None, ge=0.0, le=1.0)  # mode editing (LLaDA2.1)
    max_post_steps: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    clover_live: bool = False  # stream the denoising block view with every step (the playground)

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict = "{}"  # OpenAI clients send back the JSON string they were given


class ToolCall(BaseModel):
    """An assistant message's `tool_calls` entry sent back in the history."""
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns (content may then be null)
    tool_call_id: str | None = None  # tool turns: the call this result answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""

    def for_template(self) -> dict:
        """The message as the chat template reads it ({role, content} + tool_calls / tool_call_id)."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    chat_template_kwargs: dict | None = None
    # function calling: checked by tool_plan (400 in OpenAI's shape), not by the schema
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    response_format: Any = None  # checked by server.structured.format_plan

    def tool_plan(self) -> ToolPlan | None:
        """The request's function calling, checked: None without tools; APIError(400) for bad `tools`,
        a bad or unknown `tool_choice`, `tool_choice` without tools, a tool message without its id."""
        for i, m in enumerate(self.messages):
            if m.role == "tool" and not m.tool_call_id:
                raise APIError(400, f"messages[{i}]: a tool message needs tool_call_id",
                               param=f"messages.{i}.tool_call_id")
        if self.tools is None or self.tools == []:
            if self.tool_choice is not None:
                raise APIError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
            return None
        try:
            functions = validate_tools(self.tools)
        except ToolSpecError as e:
            raise APIError(400, str(e), param="tools")
        names = [f["name"] for f in functions]
        choice = "auto" if self.tool_choice is None else self.tool_choice
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type", "function") != "function" or not isinstance(name, str):
                raise APIError(400, 'tool_choice must be "auto", "none", "required" or '
                               '{"type": "function", "function": {"name": ...}}', param="tool_choice")
            if name not in names:
                raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                               f"({', '.join(names)})", param="tool_choice")
            choice = {"type": "function", "function": {"name": name}}
        elif choice not in ("auto", "none", "required"):
            raise APIError(400, f'tool_choice must be "auto", "none", "required" or a named function '
                           f"(got {choice!r})", param="tool_choice")
        return ToolPlan(self.tools, functions, choice, self.parallel_tool_calls)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): the token ids of `prompt` (as /v1/completions encodes it) or of `messages`
    with `tools` and `chat_template_kwargs` (as /v1/chat/completions renders them)."""
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: Any = None
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as each endpoint)


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): the text of token ids."""
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    tokens: list[int]


class DecideQuestion(BaseModel):
    """One question of POST /v1/decide: {"question", "options"} or {"question", "type", "max_tokens"}."""
    model_config = ConfigDict(extra="forbid", strict=True)

    question: str
    options: list[str] | None = None
    type: str | None = None
    max_tokens: int | None = Field(None, ge=1)


class DecideRequest(BaseModel):
    """POST /v1/decide: the fields of `clover decide` (joint decision mode, docs/decide.md)."""
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    material: str
    questions: list[DecideQuestion]
    mode: Literal["joint", "independent"] = "joint"
    threshold: float | None = Field(None, ge=0.0, le=1.0)  # None: the server's infill threshold
    block_size: int | None = Field(None, ge=2)  # None: 32, a public family's published block size
    split: bool = False


# ---- responses -------------------------------------------------------------------------------------
_ids = random.Random()  # seeded from os.urandom once: an id costs no system call


def new_id(prefix: str) -> str:
    return f"{prefix}-{_ids.getrandbits(96):024x}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    """A request the server refuses: answered as `error_body` with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


# ---- function calling: parsing the reply -------------------------------------------------------------
def forced_name(tool_choice, tools: list[dict]) -> str | None:
    """The function a reply must call: the named one, or the only tool under "required"."""
    if isinstance(tool_choice, dict):
        return tool_choice["function"]["name"]
    if tool_choice == "required" and len(tools) == 1:
        return function_spec(tools[0])["name"]
    return None


@dataclass
class ToolPlan:
    """One request's function calling: the tools as sent (for the chat template), their function
    specs, tool_choice ("auto", "none", "required" or {"type": "function", "function": {"name"}}) and
    parallel_tool_calls."""
    tools: list
    functions: list[dict]
    choice: str | dict = "auto"
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.choice != "none"  # "none": tools are rendered, the reply is never parsed (as vLLM)

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")

    def reply(self, generated: str, finish: str | None) -> tuple[str | None, list[dict], str | None]:
        """(content, tool_calls, finish_reason) of a finished reply. Calls found: content is the text
        around them or None, finish_reason "tool_calls". Malformed calls stay in the content. (Forced
        calls are infilled whole, server/structured.py.)"""
        if not self.parses:
            return generated, [], finish
        content, calls, _ = parse_tool_calls(generated, self.functions)
        name = forced_name(self.choice, self.functions)
        if name is not None:
            calls = [c for c in calls if c["function"]["name"] == name][:1]
        if not self.parallel:
            calls = calls[:1]
        if not calls:
            return content, [], finish
        return content or None, calls, "tool_calls"

    def streamable(self, generated: str) -> str:
        """The content that may be streamed while the reply is still running: the text before the first
        <tool_call> (held back from there on, and a possible start of one at the end), stripped as the
        final content is."""
        return text_before_call(generated).strip()
