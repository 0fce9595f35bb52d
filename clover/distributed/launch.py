"""`clover train|generate --nproc-per-node N`: the command's N local ranks started the way
`torchrun --standalone` starts them (torch's elastic launcher, c10d rendezvous on a free local port),
with one difference a user sees: a mistake every rank finds in its arguments is the one line rank 0
prints and exit code 2, where torchrun adds its own report of the failed workers, a traceback and
exit code 1 (the workers cannot change what torchrun prints)."""

from __future__ import annotations

import logging
import sys
import uuid


def without_flag(argv: list[str], flag: str = "--nproc-per-node") -> list[str]:
    """`argv` less `flag VALUE` / `flag=VALUE` (what each rank runs)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def launch(nproc: int, argv: list[str]) -> int:
    """Run `python -m clover ARGV` on `nproc` local ranks; the exit code: 0, 2 when the first rank to
    fail exited 2 (a user error, already said by rank 0), else 1 with one line naming that rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "clover", *argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()  # the others may have been stopped because of it
        if failure.exitcode == 2:
            return 2
        print(f"clover {argv[0]}: rank {rank} failed with exit code {failure.exitcode}", file=sys.stderr)
        return 1
    return 0
