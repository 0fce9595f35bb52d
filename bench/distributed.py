"""Scale-out on torch.distributed (CPU, gloo, 2 processes): step time and bytes communicated, and the
35B-A3B memory plan.

    python bench/distributed.py [--preset clover-small] [--new-tokens 32] [--batch 2] [--train-steps 4]

* Inference: greedy `ar` and `low_confidence` decoding of a random `preset` model (batch `--batch`,
  `--new-tokens` each) in one process, under `--tp 2` and under `--ep 2`: ms per forward and bytes
  per forward / per generated token handed to the collectives (all-reduce of the block outputs;
  rank 0's step inputs broadcast before every forward).
* Training: block-diffusion steps of the same model in one process, under FSDP2 on 2 ranks and
  under FSDP2 with the experts split (`ep = 2`) on 2 ranks (global batch 4 x 128 tokens): s per
  step and bytes per step through all-gather, reduce-scatter, all-to-all and all-reduce.
Bytes are the buffers each rank hands to a collective (a ring moves (n-1)/n of an all-gather /
reduce-scatter buffer and 2(n-1)/n of an all-reduce buffer per rank); collectives are counted by
wrapping torch.distributed's functions in the worker. On 2 shared CPU cores the 2-process runs are
slower than one process (two processes share the cores, gloo goes through loopback TCP): the point
is the communication volume, which predicts GPU scaling, not the CPU times.
The memory plan table is `clover info --plan` (clover/sizes.py) for the real 35B-A3B dims.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]


# ------------------------------------------------------------------------------------------------
# worker side (also the 1-process baseline)
# ------------------------------------------------------------------------------------------------
class Counter:
    """Bytes handed to torch.distributed collectives, by kind (wraps the module's functions)."""

    NAMES = ("all_reduce", "broadcast", "all_gather_single", "reduce_scatter_single", "all_to_all_single")

    def __init__(self):
        import torch.distributed as dist

        self.bytes = dict.fromkeys(self.NAMES, 0)
        self.calls = dict.fromkeys(self.NAMES, 0)
        for name in self.NAMES:
            fn = getattr(dist, name)

            def wrapped(*args, _fn=fn, _name=name, **kw):
                ts = [a for a in (*args, *kw.values()) if isinstance(a, torch.Tensor)][:2]
                self.bytes[_name] += max(t.numel() * t.element_size() for t in ts)  # the unsharded buffer
                self.calls[_name] += 1
                return _fn(*args, **kw)

            setattr(dist, name, wrapped)

    def snapshot(self):
        return dict(self.bytes), dict(self.calls)


def infer(folder: str, kind: str, new_tokens: int, batch: int) -> dict:
    from clover.distributed import runtime
    from clover.distributed.parallel import attach, load_parallel
    from clover.engine import DecodeConfig, Engine

    d = runtime.from_env("cpu")
    counter = Counter() if d else None
    if d is None:
        import clover

        model, _ = clover.load(folder, device="cpu")
    else:
        tp, ep = (2, 1) if kind == "tp" else (1, 2)
        model = attach(load_parallel(folder, tp, ep, d.rank, d.device, torch.float32), d)
        if model is None:  # ranks > 0 mirrored rank 0's calls
            return {}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size - 1, (24 + 5 * i,), generator=g).tolist() for i in range(batch)]
    out = {}
    for mode in ("ar", "low_confidence"):
        cfg = DecodeConfig(mode=mode, block_size=32, max_new_tokens=new_tokens)
        Engine(model, cfg).generate([p[:8] for p in prompts])  # warm-up
        before = counter.snapshot() if counter else ({}, {})
        t0 = time.perf_counter()
        seqs = Engine(model, cfg).generate(prompts)
        dt = time.perf_counter() - t0
        after = counter.snapshot() if counter else ({}, {})
        forwards = max(s.forward_passes for s in seqs)
        tokens = sum(len(s.token_ids) for s in seqs)
        moved = {k: after[0][k] - before[0][k] for k in after[0]}
        out[mode] = {"ms_per_forward": 1000 * dt / forwards, "forwards": forwards, "tokens": tokens,
                     "allreduce_bytes_per_forward": moved.get("all_reduce", 0) / forwards,
                     "broadcast_bytes_per_forward": moved.get("broadcast", 0) / forwards,
                     "allreduce_bytes_per_token": moved.get("all_reduce", 0) / tokens,
                     "token_ids": [s.token_ids for s in seqs]}
    if d is not None:
        model.driver.release()
    return out


def train(corpus: str, steps: int, preset: str, ep: int) -> dict:
    from clover.distributed import runtime
    from clover.training import Trainer, TrainConfig

    d = runtime.from_env("cpu")
    counter = Counter() if d else None
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(objective="block_diffusion", tokenizer=f"{corpus}/tok", preset=preset,
                          model_overrides={"vocab_size": 512}, train_files=[f"{corpus}/train.jsonl"], out_dir=out,
                          seq_len=128, batch_size=4, max_steps=steps + 1, warmup_steps=1, progress=False,
                          block_schedule=[[1.0, [32]]], ckpt_every=0, eval_every=0, ep=ep)
        tr = Trainer(cfg, dist=d)
        tr.train_step()  # warm-up
        before = counter.snapshot() if counter else ({}, {})
        t0 = time.perf_counter()
        losses = [tr.train_step()["loss"] for _ in range(steps)]
        dt = (time.perf_counter() - t0) / steps
        after = counter.snapshot() if counter else ({}, {})
    moved = {k: (after[0][k] - before[0][k]) / steps for k in after[0]}
    return {"s_per_step": dt, "losses": losses, **{f"{k}_bytes_per_step": v for k, v in moved.items()}}


def worker(args) -> None:
    torch.set_num_threads(1)
    res = infer(args.folder, args.kind, args.new_tokens, args.batch) if args.kind in ("tp", "ep", "one") \
        else train(args.corpus, args.train_steps, args.preset, args.ep)
    from clover.distributed import runtime

    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(res))
    runtime.shutdown()


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------
def launch(nproc: int, extra: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if nproc == 1:
        cmd = [sys.executable, str(HERE), "--worker", *extra]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(HERE),
               "--worker", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if r.returncode:
        sys.stderr.write(r.stderr[-3000:])
        raise SystemExit(f"worker failed: {' '.join(cmd)}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def make_fixtures(tmp: Path, preset: str) -> tuple[str, str]:
    import random

    from clover.data import tasks
    from clover.data.tokenizer import train_tokenizer
    from clover.models import CloverForBlockDiffusion, preset_config

    sys.path.insert(0, str(REPO / "tests"))
    from helpers import tiny_tokenizer

    torch.manual_seed(0)
    folder = tmp / "model"
    model = CloverForBlockDiffusion(preset_config(preset))
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)  # the engine runs on token ids; clover.load wants a tokenizer
    corpus = tmp / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    texts = [tasks.plain_text(tasks.make_example(["copy", "add"][i % 2], rng)) for i in range(400)]
    (corpus / "train.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    train_tokenizer(texts, 512, corpus / "tok")
    return str(folder), str(corpus)


def plan_table() -> list[str]:
    from clover.models import preset_config
    from clover.sizes import GIB, serve_memory_plan, train_memory_plan

    c = preset_config("clover-35b-a3b")
    plans = [("train, FSDP2, 1 node x 8 GPUs, 1 x 4096 tokens, recompute", train_memory_plan(c, 8, 80 * GIB)),
             ("train, FSDP2, 2 nodes x 8 GPUs, 1 x 4096 tokens, recompute", train_memory_plan(c, 16, 80 * GIB)),
             ("serve, 1 GPU, 32k context", serve_memory_plan(c, 1, 80 * GIB, 32768)),
             ("serve, --tp 2, 32k context", serve_memory_plan(c, 2, 80 * GIB, 32768, tp=2)),
             ("serve, --ep 8, 128k context, batch 8", serve_memory_plan(c, 8, 80 * GIB, 131072, batch=8))]
    rows = ["| plan (80 GiB GPUs) | weights | grads | optimiser | gathered | activations | K/V | GDN state | "
            "logits + overhead | total per GPU | fits |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    g = lambda p, k: f"{p[k] / GIB:.2f}" if k in p else "-"  # noqa: E731
    for name, p in plans:
        rest = p["logits_bytes"] + p["runtime_overhead_bytes"]
        rows.append(f"| {name} | {g(p, 'weight_bytes')} | {g(p, 'grad_bytes')} | {g(p, 'optimizer_bytes')} | "
                    f"{g(p, 'gathered_bytes')} | {g(p, 'activation_bytes')} | {g(p, 'kv_cache_bytes')} | "
                    f"{g(p, 'gdn_state_bytes')} | {rest / GIB:.2f} | {p['total_bytes'] / GIB:.2f} | "
                    f"{'yes' if p['fits'] else 'no'} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="clover-small")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=4)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="one", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder, corpus = make_fixtures(Path(tmp), args.preset)
        common = ["--folder", folder, "--new-tokens", str(args.new_tokens), "--batch", str(args.batch)]
        runs = {"1 process": launch(1, ["--kind", "one", *common]),
                "--tp 2": launch(2, ["--kind", "tp", *common]),
                "--ep 2": launch(2, ["--kind", "ep", *common])}
        tcommon = ["--kind", "train", "--corpus", corpus, "--train-steps", str(args.train_steps), "--preset", args.preset]
        trains = {"1 process": launch(1, tcommon), "FSDP2, 2 ranks": launch(2, tcommon),
                  "FSDP2 + ep 2, 2 ranks": launch(2, [*tcommon, "--ep", "2"])}
    base = runs["1 process"]
    print(f"Inference, {args.preset} (random weights), batch {args.batch}, {args.new_tokens} new tokens each, "
          f"block 32, fp32, CPU gloo:\n")
    print("| run | mode | ms / forward | all-reduce bytes / forward | all-reduce bytes / token | "
          "input broadcast bytes / forward | output = 1 process |")
    print("|---|---|---|---|---|---|---|")
    for name, res in runs.items():
        for mode, r in res.items():
            same = r["token_ids"] == base[mode]["token_ids"]
            print(f"| {name} | {mode} | {r['ms_per_forward']:.1f} | {r['allreduce_bytes_per_forward']:,.0f} | "
                  f"{r['allreduce_bytes_per_token']:,.0f} | {r['broadcast_bytes_per_forward']:,.0f} | "
                  f"{'yes' if same else 'NO'} |")
    print(f"\nTraining, {args.preset}, block diffusion at block 32, global batch 4 x 128 tokens, fp32, "
          f"{args.train_steps} steps:\n")
    print("| run | s / step | all-gather bytes / step | reduce-scatter bytes / step | all-to-all bytes / step | "
          "all-reduce bytes / step | losses = 1 process (1e-5 rel) |")
    print("|---|---|---|---|---|---|---|")
    tb = trains["1 process"]["losses"]
    for name, r in trains.items():
        same = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], tb))
        print(f"| {name} | {r['s_per_step']:.2f} | {r.get('all_gather_single_bytes_per_step', 0):,.0f} | "
              f"{r.get('reduce_scatter_single_bytes_per_step', 0):,.0f} | {r.get('all_to_all_single_bytes_per_step', 0):,.0f} | "
              f"{r.get('all_reduce_bytes_per_step', 0):,.0f} "
              f"| {'yes' if same else 'NO'} |")
    print("\nclover-35b-a3b memory plan per GPU, GiB (`clover info --preset clover-35b-a3b --plan train|serve ...`):\n")
    print("\n".join(plan_table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
