"""Launching a command on several processes from a test: torchrun (gloo on CPU), bounded in time,
the whole process group killed on timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, args: list[str], timeout: float = 240, cwd=None, env=None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node nproc -m clover ARGS...`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "clover", *args]
    return run_bounded(cmd, timeout, cwd, env)


def run_bounded(cmd: list[str], timeout: float = 240, cwd=None, env=None) -> subprocess.CompletedProcess:
    """Run `cmd` in its own session; raises on timeout (after killing every process it started) and
    on a non-zero exit, with the output in the message."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{err[-3000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"exited {proc.returncode}: {' '.join(cmd)}\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
