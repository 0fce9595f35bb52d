"""`clover serve`: an OpenAI-compatible server (FastAPI + uvicorn) with continuous batching,
streaming and a live denoising playground at `/`. Binds loopback unless told otherwise."""

from __future__ import annotations

import os
import socket
import sys

from ..distributed.flags import add_parallel_flags
from . import UserError
from .options import add_model_args

API_KEY_ENV = "CLOVER_API_KEY"


def register(sub) -> None:
    from .generate import MODE_HELP, block_size_arg

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
    p.add_argument("--block-size", type=block_size_arg, metavar="B",
                   help="default block size (default: the model's), or auto: the one `clover tune` stored")
    p.add_argument("--threshold", type=float, default=0.95, metavar="T", help="default low_confidence threshold")
    p.add_argument("--mode", default="low_confidence", metavar="MODE", help=f"default mode: {MODE_HELP}")
    p.add_argument("--default-max-tokens", type=int, default=512, metavar="N",
                   help="chat completion budget when a request gives none (default 512, capped by the context)")
    p.add_argument("--max-body-bytes", type=int, metavar="N",
                   help="largest request body accepted; larger ones get 413 (default 4 MiB)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    add_parallel_flags(p)  # under torchrun: rank 0 serves HTTP, the others hold their shards (docs/distributed.md)
    p.set_defaults(func=run)


def check_args(args) -> None:
    from ..engine import DecodeConfig

    for name in ("max_batch", "max_queue", "default_max_tokens", "max_body_bytes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    if args.served_model_name is not None and not all(n.strip() for n in args.served_model_name):
        raise UserError("--served-model-name: a name must not be empty")
    from .generate import resolve_auto_block_size

    resolve_auto_block_size(args)  # --block-size auto: the tuned block size and threshold, as generate
    # the checks `clover generate` makes (DecodeConfig.validate); the model's own maximum block size is
    # checked once it is loaded
    DecodeConfig(mode=args.mode, block_size=1 if args.block_size is None else args.block_size,
                 threshold=args.threshold).validate()


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
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}")
    sock.listen(2048)
    return sock


def run(args) -> int:
    from ..distributed.flags import is_worker

    check_args(args)
    sock = None if is_worker() else bind(args.host, args.port)  # before loading: a busy port is a one-line error, fast
    import uvicorn

    from ..api import eos_ids
    from ..distributed.parallel import load as load_sharded
    from ..server import Settings, create_app

    model, tokenizer = load_sharded(args)  # clover.load in one process; ranks > 0 never return
    block_size = args.block_size or model.config.block_size
    if block_size > model.config.max_block_size:
        raise UserError(f"--block-size must be in [1, {model.config.max_block_size}], got {block_size}")
    name, *aliases = served_names(args)
    key = api_key(args)
    settings = Settings(model_id=name, aliases=tuple(aliases), api_key=key, max_batch=args.max_batch,
                        max_queue=args.max_queue, block_size=block_size, threshold=args.threshold, mode=args.mode,
                        default_max_tokens=args.default_max_tokens)
    if args.max_body_bytes is not None:
        settings.max_body_bytes = args.max_body_bytes
    app = create_app(model, tokenizer, settings, eos_ids(model, tokenizer))
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"clover serve: {name} on http://{shown}:{port} (playground at /, OpenAI API at /v1)", flush=True)
    if host not in ("127.0.0.1", "::1", "localhost") and not key:
        print(f"clover serve: warning: listening beyond this machine without --api-key (or ${API_KEY_ENV})",
              file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0
