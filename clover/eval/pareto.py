"""The speed-quality curve (`clover bench pareto`): accuracy on the offline suite's generation tasks
(the default model's 280 held-out task prompts: 40 per task) against tokens per forward (TPF) and
tokens/s, over low_confidence thresholds x block sizes and self_spec per block size, with `ar` as the
reference point. Same prompts, stop strings, budgets and exact-match scoring as the lm-eval tasks
(clover/eval/tasks/*.yaml), through the same generation code as the lm-eval model.

AUP (accuracy under parallelism) is d3LLM's one-number score of such a curve (Qian et al., "AUP: when
Accuracy Meets Parallelism in Diffusion Language Models", hao-ai-lab blog 2025; github.com/hao-ai-lab/
d3LLM, AUP_leaderboard and d3LLM_Code/aup_utils.py): sort the (TPF rho, accuracy y in %) points by rho,
keep those with y >= y_1 - 5 (y_1: the accuracy at the smallest rho), and take
rho_1 y_1 + sum_i (rho_i - rho_{i-1}) (y_i W(y_i) + y_{i-1} W(y_{i-1})) / 2 with the weight
W(y) = min(exp(-3 (1 - y / y_max)), 1), y_max the best accuracy of all settings compared. So a curve
that stays at its best accuracy scores its area, TPF spent below the best accuracy is discounted, and
points more than 5 points under the slowest one count nothing. Here it is computed on the Pareto front
of all settings (ar included, at TPF 1), and per block size on ar plus that block's settings."""

from __future__ import annotations

import io
import math
import time

from . import suite
from ..settings import DEFAULTS
from ..utils.files import atomic_write
from .generation import generate_until

TASKS = ("arithmetic", "sorting", "copy", "lookup", "decisions")
THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
BLOCK_SIZES = (4, 8, 16, 32)
MODES = ("ar", "self_spec", "low_confidence")
AUP_ALPHA, AUP_DROP = 3.0, 5.0  # d3LLM's defaults: the weight's penalty and the accuracy window (points)


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
                                     ["\n"], mode, block_size, threshold if mode == "low_confidence" else DEFAULTS.threshold,
                                     eos_token_ids=eos_token_ids)
        for e, text, seq in zip(chunk, texts, seqs):
            ok = text.strip() == e["answer"]
            right += ok
            per.setdefault(e["file"], []).append(ok)
            tokens += len(seq.token_ids)
            forwards += seq.forward_passes
    seconds = time.perf_counter() - t0
    return {"mode": mode, "block_size": block_size, "threshold": threshold if mode == "low_confidence" else None,
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


def settings(modes, blocks, thresholds) -> list[tuple[str, int, float]]:
    """(mode, block size, threshold) of every setting: low_confidence per block x threshold, self_spec
    per block (no threshold: it commits what ar would), ar once (block size 1)."""
    out = [("low_confidence", b, t) for b in blocks for t in thresholds] if "low_confidence" in modes else []
    out += [("self_spec", b, 0.0) for b in blocks] if "self_spec" in modes else []
    return out + ([("ar", 1, 0.0)] if "ar" in modes else [])


def aup(points: list[tuple[float, float]], y_max: float | None = None, alpha: float = AUP_ALPHA,
        drop: float = AUP_DROP) -> float:
    """d3LLM's AUP of (TPF, accuracy in %) points (module docstring); y_max defaults to their best."""
    pts = sorted(points)
    if not pts:
        raise ValueError("AUP of no points")
    y_max = max(y for _, y in pts) if y_max is None else y_max
    keep = [(r, y) for r, y in pts if y >= pts[0][1] - drop]
    weighted = [y * min(math.exp(-alpha * (1 - y / y_max)), 1.0) if y_max > 0 else 0.0 for _, y in keep]
    total = keep[0][0] * keep[0][1]
    for i in range(1, len(keep)):
        total += 0.5 * (keep[i][0] - keep[i - 1][0]) * (weighted[i] + weighted[i - 1])
    return total


def aup_report(rows: list[dict], y_max: float | None = None) -> dict:
    """AUP of the Pareto front of `rows` and of each block size's settings with ar (accuracy in %).
    `y_max` (default: the best of `rows`) must be shared when models are compared, as d3LLM shares it."""
    y_max = 100 * max(r["accuracy"] for r in rows) if y_max is None else y_max
    point = lambda r: (r["tpf"], 100 * r["accuracy"])  # noqa: E731
    front = [point(rows[i]) for i in sorted(pareto_front(rows))]
    ar = [point(r) for r in rows if r["mode"] == "ar"]
    per_block = {}
    for mode in ("low_confidence", "self_spec"):
        for b in sorted({r["block_size"] for r in rows if r["mode"] == mode}):
            pts = ar + [point(r) for r in rows if r["mode"] == mode and r["block_size"] == b]
            per_block[f"{mode} {b}"] = aup(pts, y_max)
    return {"front": aup(front, y_max), "y_max": y_max, "per_curve": per_block}


def plot(rows: list[dict], path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, label in ((axes[0], "tpf", "tokens per forward"), (axes[1], "tokens_per_second", "tokens / s (batched)")):
        for bs in sorted({r["block_size"] for r in rows if r["mode"] == "low_confidence"}):
            pts = sorted((r for r in rows if r["mode"] == "low_confidence" and r["block_size"] == bs),
                         key=lambda r: r["threshold"])
            ax.plot([r[key] for r in pts], [100 * r["accuracy"] for r in pts], "o-", label=f"low_confidence {bs}")
            if key == "tpf":
                for r in pts:
                    ax.annotate(f"{r['threshold']:g}", (r[key], 100 * r["accuracy"]), fontsize=7,
                                textcoords="offset points", xytext=(3, 3))
        spec = sorted((r for r in rows if r["mode"] == "self_spec"), key=lambda r: r["block_size"])
        if spec:
            ax.plot([r[key] for r in spec], [100 * r["accuracy"] for r in spec], "ks--", mfc="none", label="self_spec")
            for r in spec:
                ax.annotate(f"{r['block_size']}", (r[key], 100 * r["accuracy"]), fontsize=7,
                            textcoords="offset points", xytext=(3, -9))
        for r in rows:
            if r["mode"] == "ar":
                ax.plot([r[key]], [100 * r["accuracy"]], "k*", markersize=12, label="ar")
        ax.set_xlabel(label)
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    atomic_write(path, png.getvalue())
