"""`clover serve`: an OpenAI-compatible server (FastAPI + uvicorn) with continuous batching,
streaming and a live denoising playground at `/`. Binds loopback unless told otherwise."""

from __future__ import annotations

import os
import socket
import sys

from ..distributed.flags import add_parallel_flags
from . import UserError
from .options import add_decode_args, add_model_args, decode_config

API_KEY_ENV = "CLOVER_API_KEY"


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server (/v1/completions, /v1/chat/completions, playground at /)")
    add_model_args(p)  # --model, --device, --threads: the same flags and checks as `clover generate`
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument("--api-key", metavar="KEY",
                   help=f"require `Authorization: Bearer KEY` on /v1/* (default: ${API_KEY_ENV} when set; "
                        "the environment keeps the key out of `ps`)")
    p.add_argument("--served-model-name", metavar="NAME", nargs="+",
                   help="the model id(s) clients may ask for; the first is the one responses name "
                        "(default: the folder name, clover-default for the shipped model)")
    p.add_argument("--max-batch", type=int, default=32, metavar="N", help="rows decoded together (default 32)")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="rows waiting for a slot before requests get 503 (default 256)")
    p.add_argument("--stream-interval-ms", type=float, metavar="MS",
                   help="a streamed reply's next tokens wait up to this long and go out as one chunk (its first and "
                        "last tokens never wait): fewer wake-ups of the HTTP side beside the decoding (default 8; "
                        "0: a chunk per decoding step)")
    add_decode_args(p, "block_size", "threshold", "mode", "draft", "edit_threshold", "max_post_steps", "runner", help=dict(  # per-request defaults (a request may override)
        block_size="default block size (default: the model's; auto: the one `clover tune` stored)",
        threshold="default low_confidence threshold",
        runner="eager (default) or compiled: every request's forwards (structured output and tool-call slot jobs "
               "too) as torch.compile'd graphs, one per shape (rows in buckets 1, 2, 4, 8, 16, 24, ...); a shape "
               "first met runs eagerly, is compiled in a background process and loaded while the server is idle "
               "(/metrics clover_graphs_deferred)"))
    p.add_argument("--compile-cache", metavar="DIR",
                   help="--runner compiled: where compiled graphs are kept across restarts (default: "
                        "$TORCHINDUCTOR_CACHE_DIR, else ~/.cache/clover/inductor)")
    p.add_argument("--default-max-tokens", type=int, default=512, metavar="N",
                   help="chat completion budget when a request gives none (default 512, capped by the context)")
    p.add_argument("--max-tool-calls", type=int, default=8, metavar="N",
                   help='most calls in one reply under tool_choice "required" with parallel_tool_calls (default 8)')
    p.add_argument("--max-body-bytes", type=int, metavar="N",
                   help="largest request body accepted; larger ones get 413 (default 4 MiB)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--backend", choices=["torch", "llamacpp"], default="torch",
                   help="llamacpp: decode in the patched llama.cpp build, every mode (make llamacpp; docs/llamacpp.md)")
    p.add_argument("--gguf", metavar="FILE", help="--backend llamacpp: the model's exported GGUF (default: export "
                   "the model folder to a temporary f32 file)")
    add_parallel_flags(p)  # under torchrun: rank 0 serves HTTP, the others hold their shards (docs/distributed.md)
    p.set_defaults(func=run)


def check_args(args):
    """The flags checked before anything loads; returns the default decoding (DecodeConfig)."""
    for name in ("max_batch", "max_queue", "default_max_tokens", "max_tool_calls", "max_body_bytes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.stream_interval_ms is not None and not 0 <= args.stream_interval_ms <= 1000:
        raise UserError(f"--stream-interval-ms must be in [0, 1000], got {args.stream_interval_ms:g}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    if args.served_model_name is not None and not all(n.strip() for n in args.served_model_name):
        raise UserError("--served-model-name: a name must not be empty")
    # the decoding flags as `clover generate` builds and checks them; without --block-size the model's own
    # is used, and the model's maximum block size is checked once it is loaded
    return decode_config(args)


def served_names(args) -> list[str]:
    """The model ids the server answers to: --served-model-name, else the folder's name."""
    if args.served_model_name:
        return list(args.served_model_name)
    return [args.model.rstrip("/").split("/")[-1] if args.model else "clover-default"]


def api_key(args) -> str | None:
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: {e.strerror}")
    family, _, proto, _, address = infos[0]
    # the protocol named (IPPROTO_TCP), not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # accepted sockets that say they are TCP, and with it on, every streamed chunk after the first waits for
    # the client's delayed ACK on a kept-alive connection
    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}")
    sock.listen(2048)
    return sock


def compile_cache(path: str | None):
    from ..compile.warm import cache_dir

    try:
        return cache_dir(path)
    except OSError as e:
        raise UserError(f"--compile-cache: cannot use {path or 'the default compile cache'}: {e.strerror}")


def run(args) -> int:
    from ..distributed.flags import is_worker

    cfg = check_args(args)
    if args.gguf and args.backend != "llamacpp":
        raise UserError("--gguf needs --backend llamacpp")
    if args.compile_cache and cfg.runner != "compiled":
        raise UserError("--compile-cache needs --runner compiled")
    from .generate import check_backend

    check_backend(args)  # a missing llama.cpp build: said before the port is taken or the model read
    # before anything compiles: every graph, and the compiling child's, lands there
    cache = compile_cache(args.compile_cache) if cfg.runner == "compiled" else None
    sock = None if is_worker() else bind(args.host, args.port)  # before loading: a busy port is a one-line error, fast
    import uvicorn

    from ..api import eos_ids
    from ..server import Settings, create_app
    from ..server.app import warm_up
    from .generate import load_model

    # clover.load in one process (ranks > 0 never return), or the llama.cpp runner for up to --max-batch rows
    if cache is not None:
        print(f"clover serve: compiled graphs cached in {cache}", flush=True)
    model, tokenizer = load_model(args, args.max_batch)
    cfg = cfg.with_(block_size=args.block_size or model.config.block_size)  # --block-size auto was resolved by check_args
    try:
        cfg.check(model)
    except ValueError as e:
        raise UserError(f"--{e}") from None
    name, *aliases = served_names(args)
    key = api_key(args)
    settings = Settings(model_id=name, aliases=tuple(aliases), api_key=key, max_batch=args.max_batch,
                        max_queue=args.max_queue, decode=cfg, infill_threshold=args.threshold,
                        default_max_tokens=args.default_max_tokens, max_tool_calls=args.max_tool_calls,
                        **({} if args.stream_interval_ms is None else {"stream_interval": args.stream_interval_ms / 1e3}))
    if args.max_body_bytes is not None:
        settings.max_body_bytes = args.max_body_bytes
    torch_backend = args.backend != "llamacpp"  # load_model ran `prepare` on a torch model
    app = create_app(model, tokenizer, settings, eos_ids(model, tokenizer), prepared=torch_backend)
    if args.backend != "llamacpp" and os.environ.get("WORLD_SIZE", "1") == "1":  # one process, torch
        warm_up(app, tokenizer)  # the process's first forward, before the port answers
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"clover serve: {name} on http://{shown}:{port} (playground at /, OpenAI API at /v1)", flush=True)
    if host not in ("127.0.0.1", "::1", "localhost") and not key:
        print(f"clover serve: warning: listening beyond this machine without --api-key (or ${API_KEY_ENV})",
              file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0
