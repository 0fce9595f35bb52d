"""The OpenAI-compatible HTTP layer (FastAPI): request validation, prompt encoding, OpenAI response /
SSE chunk shapes, stop strings, thinking-mode splitting and tool calls, errors in OpenAI's shape,
API-key gate, Prometheus metrics and the playground page. All decoding happens in `Scheduler`'s thread."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import MODES
from .metrics import Metrics
from .protocol import APIError, ChatRequest, CompletionRequest, DecideRequest, ToolPlan, error_body, new_id, now, usage
from .scheduler import EngineKey, Job, QueueFull, Scheduler, Ticket
from .structured import Infilled, format_plan, infill_format, infill_tool_call

STATIC = Path(__file__).parent / "static"
POLL_S = 0.25  # how often a waiting request checks whether its client is still there
ENDPOINTS = ("/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/decide")


@dataclass
class Settings:
    model_id: str = "clover"
    api_key: str | None = None
    max_batch: int = 32
    max_queue: int = 256
    block_size: int = 32
    threshold: float = 0.95
    mode: str = "low_confidence"
    default_max_tokens: int = 512  # chat requests without max_tokens (capped by the context)


# ---- text of one choice: decoding, thinking split, stop strings, tool calls, what may be sent yet -------
class Choice:
    def __init__(self, tokenizer, stops: list[str], think: bool, tools: ToolPlan | None = None):
        self.tokenizer, self.stops, self.think = tokenizer, stops, think
        self.tools = tools if tools is not None and tools.parses else None  # parse the reply's tool calls
        self.token_ids: list[int] = []
        self.reasoning = self.content = ""
        self.sent_reasoning = self.sent_content = 0
        self.finish_reason: str | None = None
        self.tool_calls: list[dict] = []  # OpenAI tool_calls, once done
        self.stats: dict = {}

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def update(self, token_ids: list[int], finish_reason: str | None) -> bool:
        """New state from the scheduler; True when a stop string ended the choice here."""
        self.token_ids = token_ids
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        self.reasoning, self.content = self._split(text)
        hits = [i for i in (self.content.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.content, self.finish_reason = self.content[: min(hits)], "stop"
        elif finish_reason:
            self.finish_reason = "stop" if finish_reason == "stop" else "length"
        if self.done and self.tools:
            content, self.tool_calls, self.finish_reason = self.tools.reply(self.content, self.finish_reason)
            self.content = content or ""
        return bool(hits)

    def message(self) -> dict:
        """The finished choice as a chat.completion message."""
        message = {"role": "assistant", "content": (self.content or None) if self.tool_calls else self.content}
        if self.think:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message

    def _split(self, text: str) -> tuple[str, str]:
        if not self.think:
            return "", text
        head, sep, tail = text.partition("</think>")
        reasoning = head.replace("<think>", "", 1).lstrip()
        return (reasoning.rstrip(), tail.lstrip()) if sep else (reasoning, "")

    def deltas(self) -> tuple[str, str]:
        """(reasoning, content) not sent yet; while running, hold back what could be the start of a
        stop string or half a UTF-8 character."""
        reasoning, content = self.reasoning, self.content
        if not self.done:
            hold = max((len(s) for s in self.stops), default=1) - 1
            content = content[: len(content) - hold] if hold else content
            reasoning, content = reasoning.rstrip("\ufffd"), content.rstrip("\ufffd")
            if self.tools:  # tool calls are sent whole when the choice ends (app's stream)
                content = self.tools.streamable(content)
        r, c = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = max(self.sent_reasoning, len(reasoning)), max(self.sent_content, len(content))
        return r, c


def tool_call_deltas(calls: list[dict]) -> list[dict]:
    """A finished choice's tool calls as stream deltas: each call's head (id, name), then its arguments."""
    out = []
    for k, call in enumerate(calls):
        head = {"name": call["function"]["name"], "arguments": ""}
        out.append({"tool_calls": [{"index": k, "id": call["id"], "type": "function", "function": head}]})
        out.append({"tool_calls": [{"index": k, "function": {"arguments": call["function"]["arguments"]}}]})
    return out


class _CleanStream(StreamingResponse):
    """A streaming response that always runs `on_close` when it ends, however it ends (client gone)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class _Gate:
    """ASGI middleware: the Bearer key on /v1/* (constant-time compare) and request counting."""

    def __init__(self, app, api_key: str | None, metrics: Metrics):
        self.app, self.key, self.metrics = app, (api_key or "").encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        status = [500]

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.key and path.startswith("/v1/"):
                auth = dict(scope["headers"]).get(b"authorization", b"")
                scheme, _, given = auth.partition(b" ")
                if not (scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key)):
                    body = error_body("invalid or missing API key (Authorization: Bearer KEY)",
                                      "invalid_request_error", None, "invalid_api_key")
                    return await JSONResponse(body, status_code=401)(scope, receive, counted_send)
            await self.app(scope, receive, counted_send)
        finally:
            self.metrics.count_request(endpoint, status[0])


def create_app(model, tokenizer, settings: Settings, eos_token_ids: tuple[int, ...] = ()) -> FastAPI:
    from contextlib import asynccontextmanager

    metrics = Metrics()
    scheduler = Scheduler(model, eos_token_ids, settings.max_batch, settings.max_queue, metrics)
    ctx = model.config.max_position_embeddings

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="Clover", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.settings = scheduler, metrics, settings
    app.add_middleware(_Gate, api_key=settings.api_key, metrics=metrics)

    # ---- errors in OpenAI's shape -------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        bad_json = [e for e in errors if e.get("type") == "json_invalid"]
        if bad_json:
            return JSONResponse(error_body(f"the body is not valid JSON: {bad_json[0].get('msg', '')}"), status_code=400)
        first = errors[0] if errors else {}
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return JSONResponse(error_body(message, param=param, code="invalid_value"), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return JSONResponse(error_body(message, code="not_found" if exc.status_code == 404 else None),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)

    # ---- small endpoints ----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": settings.model_id, "running_rows": metrics.running_rows,
                "queue_length": metrics.queue_length}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_id, "object": "model", "created": now(),
                                            "owned_by": "clover", "max_model_len": ctx}]}

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse((STATIC / "playground.html").read_text())

    # decisions and infilled replies run one at a time, in a worker thread beside the scheduler's
    exclusive = asyncio.Lock()

    # ---- shared request handling ----------------------------------------------------------------------
    def check_common(req) -> EngineKey:
        if req.model is not None and req.model != settings.model_id:
            raise APIError(404, f"the model {req.model!r} does not exist (this server has {settings.model_id!r})",
                           param="model", code="model_not_found")
        if getattr(req, "logprobs", None):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if getattr(req, "echo", False):
            raise APIError(400, "echo is not supported", param="echo")
        mode = req.mode or settings.mode
        if mode not in MODES:
            raise APIError(400, f"unknown mode {mode!r} (known: {', '.join(MODES)})", param="mode")
        key = EngineKey(mode=mode, block_size=req.block_size or settings.block_size,
                        threshold=settings.threshold if req.threshold is None else req.threshold, steps=req.steps,
                        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                        seed=req.seed if req.temperature > 0 else None, ignore_eos=req.ignore_eos)
        try:
            scheduler.config(key)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split()[0] if str(e).split()[0] in
                           ("block_size", "threshold", "steps", "temperature", "top_p", "top_k") else None)
        return key

    def budget(prompt_ids: list[int], max_tokens: int | None) -> int:
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(prompt_ids) >= ctx:
            raise APIError(400, f"the prompt ({len(prompt_ids)} tokens) fills the model's context of {ctx} tokens",
                           param="messages", code="context_length_exceeded")
        if max_tokens is None:
            return min(settings.default_max_tokens, ctx - len(prompt_ids))
        if len(prompt_ids) + max_tokens > ctx:
            raise APIError(400, f"the prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                           f"model's context of {ctx} tokens", param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def submit(request: Request, req, prompts: list[list[int]], max_tokens: int | None, key: EngineKey):
        ticket = Ticket(asyncio.get_running_loop())
        budgets = [budget(p, max_tokens) for p in prompts]  # every check before any work
        jobs = [Job(ticket, i * req.n + k, p, b, key, live=req.clover_live and req.stream)
                for i, (p, b) in enumerate(zip(prompts, budgets)) for k in range(req.n)]
        try:
            scheduler.submit(jobs)
        except QueueFull as e:
            raise APIError(503, f"{e}; retry later", "server_error", code="queue_full", headers={"Retry-After": "1"})
        return ticket, jobs

    async def drive(request: Request, ticket: Ticket, jobs: list[Job], choices: list[Choice]):
        """Scheduler events -> ("delta", i, reasoning, content, extra) / ("live", i, view, stats) /
        ("finish", i); ends when every choice is done. A client that goes away cancels its jobs."""
        while not all(c.done for c in choices):
            try:
                item = await asyncio.wait_for(ticket.queue.get(), POLL_S)
            except (asyncio.TimeoutError, TimeoutError):
                if await request.is_disconnected():
                    scheduler.cancel(jobs)
                    return
                continue
            kind, i = item[0], item[1]
            choice = choices[i]
            if choice.done:
                continue
            if kind == "error":
                scheduler.cancel(jobs)
                raise APIError(500, item[2], "server_error")
            if kind == "live":
                yield "live", i, item[2], item[3]
                continue
            _, _, token_ids, new_tokens, steps, finish_reason, stats = item
            choice.stats = stats
            if choice.update(token_ids, finish_reason):
                scheduler.cancel([jobs[i]], "stop")
            r, c = choice.deltas()
            yield "delta", i, r, c, (new_tokens, steps)
            if choice.done:
                yield "finish", i

    def pieces(tokens: list[int]) -> list[str]:
        return [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]

    def live_fields(event) -> dict:
        if event[0] == "live":
            view, stats = event[2], event[3]
            return {"block": [[None if t is None else tokenizer.decode([t]), s] for t, s in view], **stats}
        new_tokens, steps = event[4]
        return {"committed": [[p, s] for p, s in zip(pieces(new_tokens), steps)]}

    async def respond(request: Request, req, prompts: list[list[int]], max_tokens, chat: bool, think: bool,
                      tools: ToolPlan | None = None):
        key = check_common(req)
        ticket, jobs = submit(request, req, prompts, max_tokens, key)
        choices = [Choice(tokenizer, req.stop_list(), think, tools) for _ in jobs]
        rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
        obj = "chat.completion.chunk" if chat else "text_completion"
        n_prompt = sum(len(prompts[j.index // req.n]) for j in jobs[:: req.n]) if jobs else 0

        def total_usage():
            return usage(n_prompt, sum(len(c.token_ids) for c in choices))

        if not req.stream:
            try:
                async for _ in drive(request, ticket, jobs, choices):
                    pass
            finally:
                scheduler.cancel([j for j, c in zip(jobs, choices) if not c.done])
            out = []
            for i, c in enumerate(choices):
                c.deltas()
                if chat:
                    out.append({"index": i, "message": c.message(), "logprobs": None, "finish_reason": c.finish_reason})
                else:
                    out.append({"index": i, "text": c.content, "logprobs": None, "finish_reason": c.finish_reason})
            body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                    "model": settings.model_id, "choices": out, "usage": total_usage()}
            return JSONResponse(body)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(i, delta=None, text="", finish=None, clover=None) -> str:
            choice = {"index": i, "delta": delta or {}} if chat else {"index": i, "text": text}
            choice |= {"logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": settings.model_id, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            if clover is not None:
                body["clover"] = clover
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        async def events():
            if chat:
                for i in range(len(choices)):
                    yield chunk(i, {"role": "assistant", "content": ""})
            try:
                async for ev in drive(request, ticket, jobs, choices):
                    i = ev[1]
                    if ev[0] == "finish":
                        for delta in tool_call_deltas(choices[i].tool_calls):
                            yield chunk(i, delta)
                        extra = dict(choices[i].stats) if req.clover_live else {}
                        yield chunk(i, finish=choices[i].finish_reason, clover=extra or None)
                        continue
                    extra = live_fields(ev) if req.clover_live else None
                    if ev[0] == "live":
                        yield chunk(i, clover=extra)
                        continue
                    r, c = ev[2], ev[3]
                    if not (r or c or extra):
                        continue
                    delta = {}
                    if r:
                        delta["reasoning_content"] = r
                    if c or not r:
                        delta["content"] = c
                    yield chunk(i, delta, text=c, clover=extra)
            except APIError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
            if include_usage:
                body = {"id": rid, "object": obj, "created": created, "model": settings.model_id, "choices": [],
                        "usage": total_usage()}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

        return _CleanStream(events(), on_close=lambda: scheduler.cancel([j for j, c in zip(jobs, choices) if not c.done]),
                            media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- the two generation endpoints -------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        ids = []
        vocab = model.config.vocab_size
        for p in prompts:
            if isinstance(p, str):
                ids.append(tokenizer(p).input_ids)
            else:
                if any(not 0 <= t < vocab for t in p):
                    raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
                ids.append(list(p))
        return await respond(request, req, ids, req.max_tokens, chat=False, think=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
        plan = req.tool_plan()
        fmt = None if plan and plan.forced else format_plan(req.response_format)
        # forced tool calls and response_format replies are structured (server/structured.py: infilled or
        # decoded under the schema's grammar); with tool_choice "auto" and a response_format the reply is the JSON
        infill = bool((plan and plan.forced) or fmt)
        kwargs = dict(req.chat_template_kwargs or {})
        kwargs.pop("tools", None)
        # a forced tool call or an infilled JSON starts the reply: no reasoning block before it
        think = bool(kwargs.get("enable_thinking", False)) and not infill and not (plan and plan.forced)
        kwargs["enable_thinking"] = think
        messages = [m.for_template() for m in req.messages]
        try:
            text = tokenizer.apply_chat_template(messages, tools=plan.tools if plan else None,
                                                 add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as e:  # a template that rejects these messages
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages")
        max_tokens = req.max_completion_tokens or req.max_tokens
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if infill:
            key = check_common(req)
            room = budget(ids, max_tokens)
            job = (partial(infill_tool_call, model, tokenizer, ids, plan, key.threshold, key.block_size, room)
                   if fmt is None else partial(infill_format, model, tokenizer, ids, fmt, key.threshold,
                                               key.block_size, room))
            async with exclusive:
                try:
                    done = await asyncio.to_thread(job)
                except ValueError as e:
                    raise APIError(400, str(e))
            return respond_infilled(req, len(ids), done)
        return await respond(request, req, [ids], max_tokens, chat=True, think=think, tools=plan)

    def respond_infilled(req, n_prompt: int, done: Infilled):
        """An infilled reply (deterministic: every one of the n choices is the same) in OpenAI's shape."""
        rid, created = new_id("chatcmpl"), now()
        finish = done.finish
        message = {"role": "assistant", "content": done.content}
        if done.tool_calls:
            message["tool_calls"] = done.tool_calls
        use = usage(n_prompt * req.n, done.completion_tokens * req.n)
        clover = {"structured": [done.info] * req.n}
        if not req.stream:
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": settings.model_id,
                                 "choices": [{"index": i, "message": message, "logprobs": None, "finish_reason": finish}
                                             for i in range(req.n)], "usage": use, "clover": clover})
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(i, delta, finish_reason=None, extra=None) -> str:
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": settings.model_id,
                    "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
            if include_usage:
                body["usage"] = None
            if extra:
                body["clover"] = extra
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def events():
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
                if done.content is not None:
                    yield chunk(i, {"content": done.content})
                for delta in tool_call_deltas(done.tool_calls):
                    yield chunk(i, delta)
                yield chunk(i, {}, finish, {"structured": done.info})
            if include_usage:
                body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": settings.model_id,
                        "choices": [], "usage": use}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- joint decision mode (docs/decide.md) ------------------------------------------------------------

    @app.post("/v1/decide")
    async def decide_route(req: DecideRequest):
        from ..decide import decide, parse_questions

        if req.model is not None and req.model != settings.model_id:
            raise APIError(404, f"the model {req.model!r} does not exist (this server has {settings.model_id!r})",
                           param="model", code="model_not_found")
        questions = [q.model_dump(exclude_none=True) for q in req.questions]
        if not req.material.strip():
            raise APIError(400, "material is empty", param="material")
        try:
            parse_questions(questions, req.split)
        except ValueError as e:
            raise APIError(400, str(e), param="questions")
        async with exclusive:
            try:
                result = await asyncio.to_thread(decide, model, tokenizer, req.material, questions, req.mode,
                                                 req.threshold, req.block_size, req.split)
            except ValueError as e:
                raise APIError(400, str(e))
        return result.to_dict()

    return app
