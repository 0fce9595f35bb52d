"""OpenAI request bodies (pydantic) and the response / chunk / error shapes the server writes.

Unknown fields are accepted and ignored (clients send many); Clover's own decoding parameters
(`block_size`, `threshold`, `mode`, `steps`) and vLLM's `ignore_eos` are extra body fields
(`extra_body=` in the openai client)."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)  # greedy by default (deterministic serving)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    chat_template_kwargs: dict | None = None


class DecideQuestion(BaseModel):
    """One question of POST /v1/decide: {"question", "options"} or {"question", "type", "max_tokens"}."""
    model_config = ConfigDict(extra="forbid")

    question: str
    options: list[str] | None = None
    type: str | None = None
    max_tokens: int | None = Field(None, ge=1)


class DecideRequest(BaseModel):
    """POST /v1/decide: the fields of `clover decide` (joint decision mode, docs/decide.md)."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    material: str
    questions: list[DecideQuestion]
    mode: Literal["joint", "independent"] = "joint"
    threshold: float = Field(0.9, ge=0.0, le=1.0)
    block_size: int = Field(32, ge=2)
    split: bool = False


# ---- responses -------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


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
