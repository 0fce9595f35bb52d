"""OpenAI response shapes, built once: a whole completion / chat completion body, the SSE chunks of a
stream (a choice's delta or text, its finish, the closing usage chunk, `[DONE]`) and a finished
choice's tool calls as stream deltas. Routes (server/routes.py) fill them; nothing else writes them."""

from __future__ import annotations

import json

from .protocol import new_id, now

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"


_dumps = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps(x, ensure_ascii=False), without its call per value


def sse(body: dict, ensure_ascii: bool = True) -> str:
    return f"data: {json.dumps(body, ensure_ascii=ensure_ascii)}\n\n"


class Reply:
    """One response's id, object name and creation time, and the shapes that carry them."""

    def __init__(self, model_id: str, chat: bool, include_usage: bool = False):
        self.model_id, self.chat, self.include_usage = model_id, chat, include_usage
        self.id, self.created = new_id("chatcmpl" if chat else "cmpl"), now()
        # every chunk's JSON up to its choice, and what follows the choice without `clover`: each chunk
        # serialises only its own choice (the bytes of `sse` on the whole body)
        self._open = json.dumps(self._head(self.chunk_object), ensure_ascii=False)[:-1] + ', "choices": ['
        self._close = '], "usage": null' if include_usage else "]"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id}

    def whole(self, choices: list[dict], use: dict, clover: dict | None = None) -> dict:
        """The non-streamed body."""
        body = self._head("chat.completion" if self.chat else "text_completion") | {"choices": choices, "usage": use}
        if clover is not None:
            body["clover"] = clover
        return body

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, i: int, delta: dict | None = None, text: str = "", finish: str | None = None,
              clover: dict | None = None) -> str:
        """One SSE chunk of choice i: a chat delta or a completion's text, its finish reason. Sent for
        every step of every stream: the choice's JSON is written around its one free value (the text or
        the delta), as `json.dumps` of the whole choice writes it, instead of serialising a dict."""
        body = f'"delta": {_dumps(delta or {})}' if self.chat else f'"text": {_dumps(text)}'
        tail = self._close if clover is None else f'{self._close}, "clover": {_dumps(clover)}'
        return (f'data: {self._open}{{"index": {int(i)}, {body}, "logprobs": null, "finish_reason": '
                f'{"null" if finish is None else _dumps(finish)}}}{tail}}}\n\n')

    def end(self, use: dict) -> list[str]:
        """The stream's last events: the usage chunk (when asked for) and [DONE]."""
        tail = [sse(self._head(self.chunk_object) | {"choices": [], "usage": use})] if self.include_usage else []
        return tail + [DONE]


def tool_call_deltas(calls: list[dict]) -> list[dict]:
    """A finished choice's tool calls as stream deltas: each call's head (id, name), then its arguments."""
    out = []
    for k, call in enumerate(calls):
        head = {"name": call["function"]["name"], "arguments": ""}
        out.append({"tool_calls": [{"index": k, "id": call["id"], "type": "function", "function": head}]})
        out.append({"tool_calls": [{"index": k, "function": {"arguments": call["function"]["arguments"]}}]})
    return out
