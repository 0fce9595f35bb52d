"""The speed-quality curve (`clover bench pareto`): accuracy on the offline suite's generation tasks
against tokens per forward (TPF) and tokens/s, over low_confidence thresholds x block sizes, with
`ar` as the reference point. Same prompts, stop strings, budgets and exact-match scoring as the
lm-eval tasks (clover/eval/tasks/*.yaml), through the same generation code as the lm-eval model."""

from __future__ import annotations

import time

from . import suite
from .generation import generate_until

TASKS = ("arithmetic", "sorting", "copy", "lookup", "decisions")
THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
BLOCK_SIZES = (8, 16, 32, 64)


def examples(per_task: int, tasks=TASKS) -> list[dict]:
    recs = suite.suite_records()
    out = []
    for name in tasks:
        rows = recs[name] if per_task <= 0 else _first_per_task(recs[name], per_task)
        out += [{**r, "file": name, "budget": suite.MAX_GEN_TOKS[name]} for r in rows]
    return out


def _first_per_task(rows, n):
    seen, keep = {}, []
    for r in rows:
        if seen.get(r["task"], 0) < n:
            keep.append(r)
            seen[r["task"]] = seen.get(r["task"], 0) + 1
    return keep


def evaluate(model, tokenizer, exs: list[dict], mode: str, block_size: int, threshold: float, batch: int,
             eos_token_ids=()) -> dict:
    """Accuracy (exact match of the stripped first line), TPF and wall tokens/s of one setting."""
    right, tokens, forwards, per = 0, 0, 0, {}
    t0 = time.perf_counter()
    for s in range(0, len(exs), batch):
        chunk = exs[s:s + batch]
        texts, seqs = generate_until(model, tokenizer, [e["prompt"] + "\n" for e in chunk], [e["budget"] for e in chunk],
                                     ["\n"], mode, block_size, threshold, eos_token_ids=eos_token_ids)
        for e, text, seq in zip(chunk, texts, seqs):
            ok = text.strip() == e["answer"]
            right += ok
            per.setdefault(e["file"], []).append(ok)
            tokens += len(seq.token_ids)
            forwards += seq.forward_passes
    seconds = time.perf_counter() - t0
    return {"mode": mode, "block_size": block_size, "threshold": threshold if mode != "ar" else None,
            "accuracy": right / max(len(exs), 1), "tpf": tokens / max(forwards, 1), "tokens_per_second": tokens / seconds,
            "tokens": tokens, "seconds": seconds, "per_task": {k: sum(v) / len(v) for k, v in per.items()}}


def pareto_front(rows: list[dict]) -> set[int]:
    """Indices of rows no other row beats on both accuracy and TPF."""
    front = set()
    for i, a in enumerate(rows):
        if not any(b["accuracy"] >= a["accuracy"] and b["tpf"] >= a["tpf"] and
                   (b["accuracy"] > a["accuracy"] or b["tpf"] > a["tpf"]) for b in rows):
            front.add(i)
    return front


def plot(rows: list[dict], path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, label in ((axes[0], "tpf", "tokens per forward"), (axes[1], "tokens_per_second", "tokens / s (batched)")):
        for bs in sorted({r["block_size"] for r in rows if r["mode"] != "ar"}):
            pts = sorted((r for r in rows if r["mode"] != "ar" and r["block_size"] == bs), key=lambda r: r["threshold"])
            ax.plot([r[key] for r in pts], [100 * r["accuracy"] for r in pts], "o-", label=f"block {bs}")
            if key == "tpf":
                for r in pts:
                    ax.annotate(f"{r['threshold']:g}", (r[key], 100 * r["accuracy"]), fontsize=7,
                                textcoords="offset points", xytext=(3, 3))
        for r in rows:
            if r["mode"] == "ar":
                ax.plot([r[key]], [100 * r["accuracy"]], "k*", markersize=12, label="ar")
        ax.set_xlabel(label)
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
