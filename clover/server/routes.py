"""The server's routes: request checks, prompt encoding (off the event loop), submission to the
scheduler, and the replies (whole or streamed, in the shapes of server/shapes.py). `Routes.register`
adds them to an app (server/app.py assembles it)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

from ..chat import call_frame_ids
from ..engine.sampling import Draw
from ..engine.slots import Task
from ..settings import MODES, DecodeConfig, absolute_blocks
from .choice import Choice
from .protocol import (APIError, ChatRequest, CompletionRequest, DecideRequest, DetokenizeRequest, TokenizeRequest,
                       ToolPlan, bad_text, not_honoured, now, usage)
from .scheduler import Cancelled, Live, QueueFull, RowJob, Ticket
from .shapes import DONE, SSE_HEADERS, Reply, sse, tool_call_deltas
from .structured import (Infilled, Lane, Progress, Sent, completion_tokens, format_plan, infill_format_task,
                         infill_tool_call_task)

STATIC = Path(__file__).parent / "static"
POLL_S = 0.25  # how often a waiting request checks whether its client is still there
STREAM_S = 0.02  # how often a structured stream reads what its reply has committed so far
INLINE_BODY_BYTES = 4096  # request bodies up to this size are encoded on the event loop (Routes.encode_off_loop)


@dataclass
class Delta:
    """Text of choice `index` not sent yet, after it committed `new_tokens` (filled at `steps`)."""

    index: int
    reasoning: str
    content: str
    new_tokens: list[int]
    steps: list[int]


@dataclass
class Finished:
    index: int


def queued_tokens(queue: asyncio.Queue, ahead: deque, index: int):
    """The next event, taken from `ahead` (else from the queue, without waiting, into `ahead`) when it
    is a tokens event of choice `index`; else None (it stays in `ahead`)."""
    if not ahead:
        try:
            ahead.append(queue.get_nowait())
        except asyncio.QueueEmpty:
            return None
    if ahead[0] is None or ahead[0].kind != "tokens" or ahead[0].index != index:
        return None
    return ahead.popleft()


class CleanStream(StreamingResponse):
    """A streaming response that always runs `on_close` when it ends, however it ends (client gone)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class Routes:
    def __init__(self, model, tokenizer, settings, scheduler, metrics):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.scheduler, self.metrics = scheduler, metrics
        self.ctx = model.config.max_position_embeddings
        self.no_tools = call_frame_ids(tokenizer, model.config.vocab_size)  # never generated when a chat offers no tools
        # prompt encoding (chat template + tokenizer: CPU work that grows with the prompt) runs here, off the
        # event loop; one thread, so the tokenizer is never used by two encodings at once
        self.encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clover-encode")
        self.longest: list[int] = []  # characters of the vocabulary's longest token, found when first needed

    def register(self, app: FastAPI) -> None:
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        app.get("/v1/models")(self.models)
        app.get("/", response_class=HTMLResponse)(self.playground)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/decide")(self.decide)
        app.post("/tokenize")(self.tokenize_route)
        app.post("/detokenize")(self.detokenize)

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.encoder, partial(fn, *args))

    async def encode_off_loop(self, request: Request, fn, *args):
        """`fn(*args)` (prompt checks and encoding) in the encoder thread, or here on the event loop
        for a request body of at most INLINE_BODY_BYTES: encoding that is shorter than two hand-offs
        between threads."""
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) <= INLINE_BODY_BYTES:
            return fn(*args)
        return await self.off_loop(fn, *args)

    # ---- small endpoints ----------------------------------------------------------------------------
    async def health(self):
        return {"status": "ok", "model": self.settings.model_id, "running_rows": self.metrics.running_rows,
                "queue_length": self.metrics.queue_length}

    async def prometheus(self):
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self):
        return {"object": "list", "data": [{"id": name, "object": "model", "created": now(), "owned_by": "clover",
                                            "max_model_len": self.ctx} for name in self.settings.names]}

    async def playground(self):
        return HTMLResponse((STATIC / "playground.html").read_text())

    # ---- shared request handling ----------------------------------------------------------------------
    def check_model(self, req) -> None:
        names = self.settings.names
        if req.model is not None and req.model not in names:
            served = ", ".join(repr(n) for n in names)
            raise APIError(404, f"the model {req.model!r} does not exist (this server has {served})",
                           param="model", code="model_not_found")

    @staticmethod
    def check_text(req) -> None:
        """Text that is not Unicode (a lone UTF-16 surrogate such as "\\ud800") anywhere in the body: 400."""
        where = bad_text(req.model_dump(exclude_none=True))
        if where is not None:
            raise APIError(400, f"{where or 'body'}: the text contains a lone UTF-16 surrogate, which is not valid "
                           "Unicode (send UTF-8 text, or a surrogate pair for characters beyond U+FFFF)",
                           param=where or None, code="invalid_value")

    def check_common(self, req, suppress: tuple[int, ...] = ()) -> DecodeConfig:
        """The request's decoding (the server's defaults, the request's fields over them) as an engine key."""
        self.check_model(req)
        if getattr(req, "logprobs", None):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if getattr(req, "echo", False):
            raise APIError(400, "echo is not supported", param="echo")
        refused = not_honoured(req)
        if refused is not None:
            raise APIError(400, refused[1], param=refused[0])
        mode = req.mode or self.settings.decode.mode
        if mode not in MODES:
            raise APIError(400, f"unknown mode {mode!r} (known: {', '.join(MODES)})", param="mode")
        try:
            cfg = DecodeConfig.from_settings(
                self.settings.decode, mode=mode, block_size=req.block_size or None, threshold=req.threshold,
                steps=req.steps, draft=req.draft, edit_threshold=req.edit_threshold, max_post_steps=req.max_post_steps,
                temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                seed=req.seed if req.temperature > 0 else None, ignore_eos=req.ignore_eos, suppress=suppress)
            self.scheduler.config(cfg)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split()[0] if str(e).split()[0] in
                           ("block_size", "threshold", "steps", "draft", "edit_threshold", "max_post_steps", "temperature",
                            "top_p", "top_k", "mode") else None)
        return cfg.engine_key()

    def infill_threshold(self, req) -> float:
        """What a request's slots (structured replies, forced calls, decide) commit at: its own threshold,
        else the server's infill threshold; for a public family, whose structured replies decode in its
        blocks as its free replies do, the server's decoding threshold (the family's published one unless
        `clover serve --threshold`)."""
        if req.threshold is not None:
            return req.threshold
        return self.settings.decode.threshold if absolute_blocks(self.model) else self.settings.infill_threshold

    def check_rows(self, rows: int, param: str) -> None:
        """A request of more rows (prompts x n) than the queue holds can never run: 400, not a 503 to retry."""
        if rows > self.settings.max_queue:
            raise APIError(400, f"the request asks for {rows} completions (prompts x n), more than this server ever "
                           f"queues at once ({self.settings.max_queue}, clover serve --max-queue): split it",
                           param=param, code="invalid_value")

    def budget(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        ctx = self.ctx
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(prompt_ids) >= ctx:
            raise APIError(400, f"the prompt ({len(prompt_ids)} tokens) fills the model's context of {ctx} tokens",
                           param="messages", code="context_length_exceeded")
        if max_tokens is None:
            return min(self.settings.default_max_tokens, ctx - len(prompt_ids))
        if len(prompt_ids) + max_tokens > ctx:
            raise APIError(400, f"the prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                           f"model's context of {ctx} tokens", param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def submit(self, request: Request, req, prompts: list[list[int]], max_tokens: int | None, key: DecodeConfig):
        ticket = Ticket(asyncio.get_running_loop())
        self.check_rows(len(prompts) * req.n, "n")
        budgets = [self.budget(p, max_tokens) for p in prompts]  # every check before any work
        jobs = [RowJob(ticket, i * req.n + k, p, b, key, live=req.clover_live and req.stream)
                for i, (p, b) in enumerate(zip(prompts, budgets)) for k in range(req.n)]
        try:
            self.scheduler.submit(jobs)
        except QueueFull as e:
            raise APIError(503, f"{e}; retry later", "server_error", code="queue_full", headers={"Retry-After": "1"})
        return ticket, jobs

    async def drive(self, request: Request, ticket: Ticket, jobs: list[RowJob], choices: list[Choice], merge: bool = True):
        """Scheduler events -> Delta / Live / Finished; ends when every choice is done. A client that
        goes away cancels its jobs: it is looked for at a tick (a None the request's one timer puts
        in its queue every POLL_S, also while events keep coming; no timer per event). `merge`: the
        tokens events of a choice already queued right behind one (posted while the event loop was
        behind) update the choice one by one, as they would alone, and give one Delta together (one
        chunk to send instead of one each)."""
        scheduler, queue, ahead, loop = self.scheduler, ticket.queue, deque(), asyncio.get_running_loop()
        tick = loop.call_later(POLL_S, queue.put_nowait, None)
        try:
            while not all(c.done for c in choices):
                item = ahead.popleft() if ahead else await queue.get()
                if item is None:
                    if await request.is_disconnected():
                        scheduler.cancel(jobs)
                        return
                    tick = loop.call_later(POLL_S, queue.put_nowait, None)
                    continue
                choice = choices[item.index]
                if choice.done:
                    continue
                if item.kind == "error":
                    scheduler.cancel(jobs)
                    raise APIError(500, item.message, "server_error")
                if item.kind == "live":
                    yield item
                    continue
                choice.stats, new_tokens, steps = item.stats, item.new_tokens, item.steps
                stopped = choice.update(item.token_ids, item.finish_reason)
                while merge and not choice.done and (more := queued_tokens(queue, ahead, item.index)) is not None:
                    choice.stats, new_tokens, steps = more.stats, new_tokens + more.new_tokens, steps + more.steps
                    stopped = choice.update(more.token_ids, more.finish_reason)
                if stopped:
                    scheduler.cancel([jobs[item.index]], "stop")
                r, c = choice.deltas()
                yield Delta(item.index, r, c, new_tokens, steps)
                if choice.done:
                    yield Finished(item.index)
        finally:
            tick.cancel()

    def live_fields(self, event: Delta | Live) -> dict:
        decode = self.tokenizer.decode
        if isinstance(event, Live):
            return {"block": [[None if t is None else decode([t]), s] for t, s in event.view], **event.stats}
        pieces = [decode([t], skip_special_tokens=False) for t in event.new_tokens]
        return {"committed": [[p, s] for p, s in zip(pieces, event.steps)]}

    async def respond(self, request: Request, req, prompts: list[list[int]], max_tokens, chat: bool, think: bool,
                      tools: ToolPlan | None = None):
        key = self.check_common(req, self.no_tools if chat and tools is None else ())
        ticket, jobs = self.submit(request, req, prompts, max_tokens, key)
        choices = [Choice(self.tokenizer, req.stop_list(), think, tools) for _ in jobs]
        n_prompt = sum(len(prompts[j.index // req.n]) for j in jobs[:: req.n]) if jobs else 0
        reply = Reply(self.settings.model_id, chat, bool(req.stream_options and req.stream_options.include_usage))
        total_usage = lambda: usage(n_prompt, sum(len(c.token_ids) for c in choices))  # noqa: E731
        unfinished = lambda: [j for j, c in zip(jobs, choices) if not c.done]  # noqa: E731
        if not req.stream:
            try:
                async for _ in self.drive(request, ticket, jobs, choices):
                    pass
            finally:
                self.scheduler.cancel(unfinished())
            out = []
            for i, c in enumerate(choices):
                c.deltas()
                if chat:
                    out.append({"index": i, "message": c.message(), "logprobs": None, "finish_reason": c.finish_reason})
                else:
                    out.append({"index": i, "text": c.content, "logprobs": None, "finish_reason": c.finish_reason})
            return JSONResponse(reply.whole(out, total_usage()))
        events = self.stream_events(request, req, reply, ticket, jobs, choices, total_usage)
        return CleanStream(events, on_close=lambda: self.scheduler.cancel(unfinished()),
                           media_type="text/event-stream", headers=SSE_HEADERS)

    async def stream_events(self, request, req, reply: Reply, ticket, jobs, choices, total_usage):
        if reply.chat:
            for i in range(len(choices)):
                yield reply.chunk(i, {"role": "assistant", "content": ""})
        try:
            async for ev in self.drive(request, ticket, jobs, choices, merge=not req.clover_live):
                i = ev.index
                if isinstance(ev, Finished):
                    for delta in tool_call_deltas(choices[i].tool_calls):
                        yield reply.chunk(i, delta)
                    extra = dict(choices[i].stats) if req.clover_live else {}
                    yield reply.chunk(i, finish=choices[i].finish_reason, clover=extra or None)
                    continue
                extra = self.live_fields(ev) if req.clover_live else None
                if isinstance(ev, Live):
                    yield reply.chunk(i, clover=extra)
                    continue
                r, c = ev.reasoning, ev.content
                if not (r or c or extra):
                    continue
                delta = {}
                if r:
                    delta["reasoning_content"] = r
                if c or not r:
                    delta["content"] = c
                yield reply.chunk(i, delta, text=c, clover=extra)
        except APIError as e:
            yield sse(e.body())
        for line in reply.end(total_usage()):
            yield line

    # ---- the two generation endpoints -------------------------------------------------------------------
    def tokenize(self, text: str, param: str, **kw) -> list[int]:
        """Token ids of a text; a text too long to fit the context whatever it says (it needs at least
        len / longest-token tokens) is refused before the tokenizer spends seconds on it."""
        tokenizer, ctx, longest = self.tokenizer, self.ctx, self.longest
        if len(text) > ctx:
            if not longest:
                longest.append(max(len(tokenizer.decode([i])) for i in range(len(tokenizer))))
            if len(text) // max(longest[0], 1) >= ctx:
                raise APIError(400, f"the prompt ({len(text)} characters, at least {len(text) // longest[0]} tokens) "
                               f"fills the model's context of {ctx} tokens", param=param,
                               code="context_length_exceeded")
        return tokenizer(text, **kw).input_ids

    def encode_completion(self, req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        self.check_rows(len(prompts) * req.n, "prompt" if req.n == 1 else "n")
        ids = []
        vocab = self.model.config.vocab_size
        for p in prompts:
            if isinstance(p, str):
                ids.append(self.tokenize(p, "prompt"))
            else:
                if any(not 0 <= t < vocab for t in p):
                    raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
                ids.append(list(p))
        return ids

    async def completions(self, req: CompletionRequest, request: Request):
        self.check_model(req)
        await self.encode_off_loop(request, self.check_text, req)  # walks every string of the body: off the loop too
        ids = await self.encode_off_loop(request, self.encode_completion, req)
        return await self.respond(request, req, ids, req.max_tokens, chat=False, think=False)

    def chat_text(self, messages: list[dict], tools, kwargs: dict) -> str:
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False, **kwargs)
        except Exception as e:  # a template that rejects these messages (or these chat_template_kwargs)
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages")
        if not isinstance(text, str):
            raise APIError(400, "chat_template_kwargs must not change what the template returns (text)",
                           param="chat_template_kwargs")
        return text

    def encode_text(self, text: str) -> list[int]:
        return self.tokenize(text, "messages", add_special_tokens=False)

    async def encode_chat(self, messages: list[dict], plan: ToolPlan | None, kwargs: dict, run=None) -> list[int]:
        """The chat prompt's token ids (templating and encoding by `run`, default `off_loop`). A prompt
        that fills the context only with the tools' definitions rendered into it (a huge enum) is blamed
        on `tools`, not on `messages`."""
        run = run or self.off_loop
        text = await run(self.chat_text, messages, plan.tools if plan else None, kwargs)
        try:
            ids = await run(self.encode_text, text)
            if plan is not None and len(ids) >= self.ctx:
                self.budget(ids, None)  # raises: the context is full
            return ids
        except APIError as e:
            if plan is None or e.code != "context_length_exceeded":
                raise
            bare = await self.off_loop(self.chat_text, messages, None, kwargs)
            try:
                n = len(await self.off_loop(self.encode_text, bare))
            except APIError:
                raise e from None
            if n >= self.ctx:
                raise
            raise APIError(400, f"the tools' definitions, rendered into the prompt, make it longer than the model's "
                           f"context of {self.ctx} tokens (the messages alone are {n} tokens): send fewer or smaller "
                           "tools (a long enum?)", param="tools", code="context_length_exceeded") from None

    async def chat_completions(self, req: ChatRequest, request: Request):
        """A request that may be structured is on its way to the scheduler from here (`Scheduler.arriving`)."""
        if req.response_format is None and not (req.tools and req.tool_choice not in (None, "auto", "none")):
            return await self.chat_reply(req, request)
        with self.scheduler.arriving() as request.state.arrival:
            return await self.chat_reply(req, request)

    async def chat_reply(self, req: ChatRequest, request: Request):
        tokenizer = self.tokenizer
        run = partial(self.encode_off_loop, request)
        arrived = time.perf_counter()
        self.check_model(req)
        await run(self.check_text, req)  # walks every string of the body: off the loop too (unless small)
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
        ids = await self.encode_chat(messages, plan, kwargs, run)
        max_tokens = req.max_completion_tokens or req.max_tokens
        if infill:
            return await self.structured_reply(request, req, ids, plan if fmt is None else fmt, max_tokens, arrived)
        return await self.respond(request, req, [ids], max_tokens, chat=True, think=think, tools=plan)

    @staticmethod
    def check_structured(req, tools: bool) -> None:
        """What a structured reply cannot honour, as a 400 naming the field: stop strings in forced tool
        calls (they would cut the arguments to invalid JSON). Sampling is honoured under the grammars
        (temperature, top_p, top_k, seed; n > 1 independent samples); stop strings cut a response_format
        reply, as vLLM's."""
        if tools and req.stop_list():
            raise APIError(400, "stop strings are not applied to forced tool calls (they would cut the arguments to "
                           "invalid JSON): leave stop out", param="stop", code="invalid_value")

    async def structured_reply(self, request: Request, req, ids: list[int], plan, max_tokens, arrived: float):
        """A response_format reply (`plan` a FormatPlan) or forced tool calls (a ToolPlan), whole or streamed:
        greedy, one task whose reply every choice copies; sampled, a task per choice (`Draw.each`)."""
        model, tokenizer = self.model, self.tokenizer
        key = self.check_common(req)
        self.check_structured(req, isinstance(plan, ToolPlan))
        room, threshold = self.budget(ids, max_tokens), self.infill_threshold(req)
        draws, lanes = Draw.each(key.sampling, req.n), []
        for k, draw in enumerate(draws):
            progress = Progress() if req.stream else None
            steps = (infill_tool_call_task(model, tokenizer, ids, plan, threshold, key.block_size, room,
                                           self.settings.max_tool_calls, progress, draw) if isinstance(plan, ToolPlan)
                     else infill_format_task(model, tokenizer, ids, plan, threshold, key.block_size, room, progress,
                                             draw))
            task = await self.start_task(steps, getattr(request.state, "arrival", None))
            lanes.append(Lane(task, progress, range(req.n) if draw is None else [k]))

        def finished(dones: list[Infilled]) -> None:
            self.metrics.structured_done(len(ids) * req.n, completion_tokens(lanes, dones),
                                         sum(d.info.get("forward_passes", 0) for d in dones), req.n,
                                         time.perf_counter() - arrived)

        if req.stream:
            return await self.stream_structured(request, req, len(ids), lanes, finished)
        try:
            for lane in lanes:
                async for _ in self.ticks(request, lane.task, POLL_S):
                    pass
            dones = [(await self.outcome(lane.task)).stopped(req.stop_list()) for lane in lanes]
        finally:
            self.cancel_lanes(lanes)
        finished(dones)
        return self.respond_infilled(req, len(ids), lanes, dones)

    async def start_task(self, steps, arrival=None) -> Task:
        """A task (engine/slots.py) planned up to its first job off the event loop, its jobs then run by
        the scheduler (batched with other requests'). The public families (blocks at absolute positions)
        decode under the grammar in their own block layout (engine/family_grammar.py). `arrival`: the
        request's `Scheduler.arriving`, which the submission ends."""
        task = Task(steps)
        await self.off_loop(task.resume)
        if task.job is not None:
            self.scheduler.submit([task], arrival)
        return task

    async def ticks(self, request: Request, task: Task, every: float):
        """Yields every `every` seconds until the task ends; a client that goes away (looked for every
        POLL_S) cancels it at once and ends the ticks."""
        future, checked = asyncio.wrap_future(task.future), time.monotonic()
        while True:
            done, _ = await asyncio.wait({future}, timeout=every)
            if done:
                return
            if every >= POLL_S or time.monotonic() - checked >= POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    self.cancel_task(task)
                    return
            yield

    def cancel_task(self, task: Task) -> None:
        if not task.future.done():
            self.scheduler.cancel([task])

    def cancel_lanes(self, lanes: list[Lane]) -> None:
        for lane in lanes:
            self.cancel_task(lane.task)

    @staticmethod
    async def outcome(task: Task):
        """The task's reply; ValueError -> 400, cancelled (its client gone) -> 499."""
        try:
            return await asyncio.wrap_future(task.future)
        except Cancelled as e:  # nobody reads this any more
            raise APIError(499, str(e), "server_error", code="cancelled")
        except ValueError as e:
            raise APIError(400, str(e))

    async def structured(self, request: Request, steps):
        """A task's reply (decisions): ValueError -> 400; a client that goes away cancels it at once."""
        task = await self.start_task(steps)
        async for _ in self.ticks(request, task, POLL_S):
            pass
        return await self.outcome(task)

    def respond_infilled(self, req, n_prompt: int, lanes: list[Lane], dones: list[Infilled]):
        """A whole structured reply in OpenAI's shape: each lane's reply as its choices."""
        reply, choices, infos = Reply(self.settings.model_id, True), [], []
        for lane, done in zip(lanes, dones):
            message = {"role": "assistant", "content": done.content}
            if done.tool_calls:
                message["tool_calls"] = done.tool_calls
            choices += [{"index": i, "message": message, "logprobs": None, "finish_reason": done.finish}
                        for i in lane.choices]
            infos += [done.info] * len(lane.choices)
        use = usage(n_prompt * req.n, completion_tokens(lanes, dones))
        return JSONResponse(reply.whole(choices, use, {"structured": infos}))

    async def stream_structured(self, request: Request, req, n_prompt: int, lanes: list[Lane], finished):
        """A structured reply streamed as it decodes (`structured_events`). Until its first text the
        response has not started: a request that fails before it is refused with its status."""
        first = lanes[0]
        async for _ in self.ticks(request, first.task, STREAM_S):
            if any(call_id or text for call_id, _, text in first.progress.read()):
                break
        if first.task.future.done():
            try:
                await self.outcome(first.task)  # raises the task's error as the response
            except APIError:
                self.cancel_lanes(lanes)
                raise
        reply = Reply(self.settings.model_id, True, bool(req.stream_options and req.stream_options.include_usage))
        events = self.structured_events(request, req, reply, n_prompt, lanes, finished)
        return CleanStream(events, on_close=lambda: self.cancel_lanes(lanes), media_type="text/event-stream",
                           headers=SSE_HEADERS)

    async def structured_events(self, request: Request, req, reply: Reply, n_prompt: int, lanes: list[Lane],
                                finished):
        """The role chunk, the text (or each call's head, then its arguments) as the tasks commit it,
        the finish chunk (with the verdict), usage when asked for, [DONE]. Each lane's text goes to its
        choices (greedy: one lane, every choice the same)."""
        sents = [Sent(req.stop_list()) for _ in lanes]
        for i in range(req.n):
            yield reply.chunk(i, {"role": "assistant", "content": ""})
        for lane in lanes:
            async for _ in self.ticks(request, lane.task, STREAM_S):
                for other, sent in zip(lanes, sents):
                    for chunk in other.chunks(reply, sent.deltas(other.progress.read())):
                        yield chunk
        try:
            dones = [(await self.outcome(lane.task)).stopped(req.stop_list()) for lane in lanes]
        except APIError as e:
            yield sse(e.body())
            yield DONE
            return
        for lane, sent, done in zip(lanes, sents, dones):
            for chunk in lane.chunks(reply, sent.deltas(done.view(), final=True)):
                yield chunk
        if any(sent.broken for sent in sents):  # a retry under the schema replaced text already sent
            yield sse(APIError(500, "the structured reply was decoded again after part of it was streamed and no "
                               "longer extends what was sent: request it without stream", "server_error").body())
            yield DONE
            return
        finished(dones)
        for lane, done in zip(lanes, dones):
            for chunk in lane.chunks(reply, [{}], finish=done.finish, clover={"structured": done.info}):
                yield chunk
        for line in reply.end(usage(n_prompt * req.n, completion_tokens(lanes, dones))):
            yield line

    # ---- vLLM's tokenizer endpoints ----------------------------------------------------------------------
    async def tokenize_route(self, req: TokenizeRequest):
        """{"count", "max_model_len", "tokens"} of a prompt or chat messages, encoded as the generation
        endpoints encode them (a prompt longer than the context is counted, not refused)."""
        self.check_model(req)
        await self.off_loop(self.check_text, req)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt" if req.prompt is None else "messages")
        text, special = req.prompt, req.add_special_tokens is not False
        if req.messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise APIError(400, "this model's tokenizer has no chat template: tokenize a prompt", param="messages")
            tools = ChatRequest(messages=req.messages, tools=req.tools).tool_plan() if req.tools else None
            kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "tools"}
            kwargs["enable_thinking"] = bool(kwargs.get("enable_thinking", False))
            text = await self.off_loop(self.chat_text, [m.for_template() for m in req.messages],
                                       tools.tools if tools else None, kwargs)
            special = bool(req.add_special_tokens)
        ids = await self.off_loop(lambda: self.tokenizer(text, add_special_tokens=special).input_ids)
        return {"count": len(ids), "max_model_len": self.ctx, "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest):
        self.check_model(req)
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": await self.off_loop(self.tokenizer.decode, req.tokens)}

    # ---- joint decision mode (docs/decide.md) ------------------------------------------------------------
    async def decide(self, req: DecideRequest, request: Request):
        from ..decision import parse_questions
        from ..decision.decide import decide_task

        self.check_model(req)
        self.check_text(req)
        questions = [q.model_dump(exclude_none=True) for q in req.questions]
        if not req.material.strip():
            raise APIError(400, "material is empty", param="material")
        try:
            parse_questions(questions, req.split)
        except ValueError as e:
            raise APIError(400, str(e), param="questions")
        # a public family's rows decode in its blocks as its free replies do: the server's block size unless asked
        block_size = req.block_size or (self.settings.decode.block_size if absolute_blocks(self.model) else None)
        result = await self.structured(request, decide_task(self.model, self.tokenizer, req.material, questions,
                                                            req.mode, self.infill_threshold(req), block_size,
                                                            req.split))
        return result.to_dict()
