"""Launching a command on several processes from a test: torchrun (gloo on CPU), bounded in time,
the whole process group killed on timeout."""

from __future__ import annotations

import json
import os
import random
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


def make_corpus(d: Path) -> Path:
    """A small task corpus (plain and chat records) and a 300-token tokenizer trained on it."""
    from clover.data import tasks
    from clover.data.tokenizer import train_tokenizer

    rng = random.Random(0)
    recs = []
    for i in range(120):
        ex = tasks.make_example(["copy", "add"][i % 2], rng)
        recs.append({"messages": tasks.chat_messages(ex, think=False)} if i % 3 == 0 else {"text": tasks.plain_text(ex)})
    (d / "train.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    train_tokenizer((r.get("text") or r["messages"][1]["content"] for r in recs), 300, d / "tok")
    return d


def train_toml(corpus: Path, path: Path, **kw) -> Path:
    """A `clover train` config on `corpus` exercising every part of a step (odd batch 5, gradient
    accumulation, complementary masking, self-spec samples, the confidence term, evaluation)."""
    base = dict(objective="block_diffusion", tokenizer=str(corpus / "tok"), preset="clover-tiny",
                train_files=[str(corpus / "train.jsonl")], eval_files=[str(corpus / "train.jsonl")], seq_len=24,
                batch_size=5, grad_accum=2, max_steps=20, warmup_steps=3, lr=3e-3, log_every=1, eval_every=10,
                eval_batches=1, ckpt_every=10, progress=False, threads=1, complementary=True, self_spec_frac=0.3,
                conf_weight=0.2, eval_block_size=8, block_schedule=[[0.2, [1]], [1.0, [4, 8]]])
    base.update(kw)
    lines = [f"{k} = {json.dumps(v)}" for k, v in base.items()]
    lines.append("model_overrides = { vocab_size = 300 }")
    path.write_text("\n".join(lines) + "\n")
    return path
