"""The OpenAI-compatible HTTP server (FastAPI), assembled: settings, the API-key / body-size gate,
errors in OpenAI's shape, the routes (server/routes.py; response shapes in server/shapes.py, the
text of a choice in server/choice.py). All decoding happens in `Scheduler`'s thread; prompt encoding
(chat template, tokenizer) in one worker thread, so the event loop (and `/health`) never waits on a
large prompt."""

from __future__ import annotations

import hmac
import importlib
from dataclasses import dataclass, fields

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..settings import DEFAULTS, INFILL_THRESHOLD, DecodeConfig
from .choice import Choice
from .metrics import Metrics
from .protocol import APIError, error_body
from .routes import Routes
from .scheduler import STREAM_INTERVAL_S, Scheduler
from .shapes import tool_call_deltas
from .structured import MAX_TOOL_CALLS

__all__ = ["Choice", "Settings", "create_app", "tool_call_deltas", "warm_up"]

ENDPOINTS = ("/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/decide")
MAX_BODY_BYTES = 4 * 2**20  # default request-body limit: many times what fills a 32k-token context
DRAIN_BYTES = 64 * 2**20  # of a body over the limit, read (and dropped) this much more before the 413
# imported by the first request otherwise (anyio's backend, at a request's first disconnect check):
# an import holds the GIL, so the decode running beside it waits too
FIRST_REQUEST_IMPORTS = ("anyio._backends._asyncio",)


@dataclass(init=False)
class Settings:
    """The server's settings. `decode`: every request's decoding defaults (a request's own fields
    override them); built from flat settings too (`Settings(block_size=4, threshold=0.5)`, as
    DecodeConfig.from_settings). `infill_threshold`: what slots commit at (structured replies, forced
    calls, /v1/decide) unless a request says: the threshold given here, else INFILL_THRESHOLD."""

    model_id: str = "clover"
    aliases: tuple[str, ...] = ()  # more names clients may ask for (`--served-model-name A B ...`)
    api_key: str | None = None
    max_batch: int = 32
    max_queue: int = 256
    decode: DecodeConfig = DEFAULTS
    infill_threshold: float = INFILL_THRESHOLD
    default_max_tokens: int = 512  # chat requests without max_tokens (capped by the context)
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies get 413
    max_tool_calls: int = MAX_TOOL_CALLS  # calls in one reply under tool_choice "required" + parallel_tool_calls
    stream_interval: float = STREAM_INTERVAL_S  # a running row's next tokens wait up to this long, joined (scheduler.Pacer)

    def __init__(self, decode: DecodeConfig | None = None, infill_threshold: float | None = None, **settings):
        own = {f.name for f in fields(self)}
        for f in fields(self):
            setattr(self, f.name, settings.pop(f.name, f.default))
        self.decode = DecodeConfig.from_settings(decode, **{k: v for k, v in settings.items() if k not in own})
        given = settings.get("threshold")
        self.infill_threshold = next(t for t in (infill_threshold, given, INFILL_THRESHOLD) if t is not None)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.model_id, *(a for a in self.aliases if a != self.model_id))


class _Gate:
    """ASGI middleware: the Bearer key on /v1/* (constant-time compare), the body-size limit (413; a
    body over it is never kept) and request counting."""

    def __init__(self, app, api_key: str | None, metrics: Metrics, max_body_bytes: int = MAX_BODY_BYTES):
        self.app, self.key, self.metrics, self.max_body = app, (api_key or "").encode(), metrics, max_body_bytes

    async def _bounded(self, scope, receive):
        """The whole body (at most max_body bytes) and a `receive` that replays it; None when too large.
        The rest of a body over the limit is read and dropped (up to DRAIN_BYTES more), so that the client,
        still sending, reads the 413 instead of a broken connection; beyond that the connection is closed."""
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body + DRAIN_BYTES:
            return None
        chunks, size, message = [], 0, None
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client gone: the app sees the disconnect
                break
            body = message.get("body", b"")
            size += len(body)
            if size <= self.max_body:
                chunks.append(body)
            elif size > self.max_body + DRAIN_BYTES:
                return None
            if not message.get("more_body", False):
                message = None
                break
        if size > self.max_body:
            return None
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        if message is not None:
            pending.append(message)

        async def replay():
            return pending.pop(0) if pending else await receive()
        return replay

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
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                replay = await self._bounded(scope, receive)
                if replay is None:
                    body = error_body(f"the request body is larger than this server's limit of {self.max_body} bytes "
                                      "(clover serve --max-body-bytes)", param=None, code="request_too_large")
                    return await JSONResponse(body, status_code=413, headers={"Connection": "close"})(
                        scope, receive, counted_send)
                receive = replay
            await self.app(scope, receive, counted_send)
        finally:
            self.metrics.count_request(endpoint, status[0])


def create_app(model, tokenizer, settings: Settings, eos_token_ids: tuple[int, ...] = (),
               prepared: bool = False) -> FastAPI:
    """The app; `prepared`: the caller has already run `utils.startup.prepare` on the model (as
    `clover serve`'s load does), else it is run here."""
    from contextlib import asynccontextmanager

    from ..utils.startup import prepare

    if not prepared:
        prepare(model)  # the C++ CPU kernels and int4 packing before the first request, never inside one
    import_ahead()
    metrics = Metrics()
    scheduler = Scheduler(model, eos_token_ids, settings.max_batch, settings.max_queue, metrics,
                          settings.decode.runner, settings.stream_interval)
    routes = Routes(model, tokenizer, settings, scheduler, metrics)

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.stop()
        routes.encoder.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="Clover", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.settings = scheduler, metrics, settings
    app.add_middleware(_Gate, api_key=settings.api_key, metrics=metrics, max_body_bytes=settings.max_body_bytes)
    add_error_handlers(app)
    routes.register(app)
    return app


def import_ahead() -> None:
    """The modules a server's first request would import (FIRST_REQUEST_IMPORTS), imported now."""
    for name in FIRST_REQUEST_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # another anyio layout: its first request imports what it needs
            pass


def warm_up(app: FastAPI, tokenizer) -> None:
    """One short decode of the server's default settings before it serves, as its engines run them:
    what a process's first forward does once (allocations, lazily read weights, library set-up) is
    not paid by the first request; under `--runner compiled` its shapes are queued for the compiling
    child from the start."""
    import torch

    from ..engine import Engine

    scheduler, decode = app.state.scheduler, app.state.settings.decode
    config = scheduler.config(decode.engine_key(), max_new_tokens=2 * decode.block_size)
    ids = tokenizer("Hello")["input_ids"] or [0]
    with torch.inference_mode():
        Engine(scheduler.model, config, defer_compile=True).generate([ids])


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape."""
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
        return JSONResponse(error_body(message, param=param, code="invalid_value"), status_code=400)  # as OpenAI

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return JSONResponse(error_body(message, code="not_found" if exc.status_code == 404 else None),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)
