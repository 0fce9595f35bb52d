"""`clover` command line: one entry point, one module per subcommand.

Each subcommand module defines `register(subparsers)`, which adds its parser and sets
`func=run`. register() imports nothing heavy (no torch / transformers: `clover --help` and argument
errors answer at once); run() imports what the command needs. User mistakes raise `UserError` (or a
ValueError / FileNotFoundError from validation) and end as one line on stderr with exit code 2, never
a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

COMMANDS = ["info", "generate", "chat", "serve", "convert", "quantize", "train", "train_tokenizer", "bench", "decide", "eval", "export_gguf", "tune"]

from ..errors import UserError  # noqa: F401 - its home is clover/errors.py; `clover.cli.UserError` stays


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=float))


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (exit 2), not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="clover", description="Block-diffusion language models: run, make, serve.")
    parser.add_argument("--version", action="version", version=f"clover {__import__('clover').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"clover.cli.{name}")
        except ModuleNotFoundError as e:  # a subcommand not built yet
            if e.name != f"clover.cli.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from .options import setup_process

    launching = getattr(args, "nproc_per_node", None) is not None and "LOCAL_RANK" not in os.environ
    if not launching:
        setup_process(args)
    try:
        if launching:
            return launched(args, argv)
        rc = int(args.func(args) or 0)
    except (UserError, ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        if os.environ.get("CLOVER_DEBUG"):
            raise
        if not quiet_rank():
            print(f"clover {args.command}: error: {e}", file=sys.stderr)
        else:
            let_rank_0_report()
        return 2
    except KeyboardInterrupt:
        print(f"clover {args.command}: interrupted", file=sys.stderr)
        return 130
    if argv is None:  # the program itself (in-process callers keep their own Ctrl-C)
        finished()
    return rc


def launched(args, argv: list[str] | None) -> int:
    """`--nproc-per-node N`: the same command on N local ranks (clover/distributed/launch.py)."""
    if args.nproc_per_node < 1:
        raise UserError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    from ..distributed.launch import launch, without_flag

    return launch(args.nproc_per_node, without_flag(list(sys.argv[1:] if argv is None else argv)))


def quiet_rank() -> bool:
    """Under torchrun, a rank other than 0 before its process group started: every rank checks the same
    arguments, so rank 0 alone reports a mistake (one line, not one per process). Once the group runs,
    each rank reports its own."""
    from ..distributed.flags import is_worker

    if not is_worker():
        return False
    dist = sys.modules.get("torch.distributed")
    return not (dist is not None and dist.is_available() and dist.is_initialized())


def let_rank_0_report(seconds: float = 30.0) -> None:
    """A quiet rank's exit must not come first: torchrun stops the other ranks as soon as one fails, and
    could stop rank 0 before it has printed the line. So this rank waits (torchrun ends it once rank 0
    has exited 2; the bound only guards a rank 0 that somehow never fails)."""
    import time

    time.sleep(seconds)


def finished() -> None:
    """The command's work is done and its output complete: a Ctrl-C from here on (while the interpreter
    tears torch down) no longer turns a finished run into a signal exit status."""
    import signal
    import threading

    sys.stdout.flush()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
