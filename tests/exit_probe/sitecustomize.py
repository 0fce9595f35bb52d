"""Put on PYTHONPATH by tests/distributed_utils.py (EXIT_PROBE_ENV): with CLOVER_EXIT_PROBE set, a torchrun
worker reports at exit, after clover's own exit handler ran (handlers run last-registered first),
how many of gloo's threads are still alive. Left alive, they end during interpreter finalisation,
where a rank could abort with SIGABRT after its work was done."""

import atexit
import os
import sys


def _report() -> None:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    gloo = sum("gloo" in n for n in names)
    print(f"[exit probe] rank {os.environ.get('RANK')}: gloo threads at exit: {gloo}", file=sys.stderr)


if os.environ.get("CLOVER_EXIT_PROBE") and os.path.isdir("/proc/self/task"):
    atexit.register(_report)
