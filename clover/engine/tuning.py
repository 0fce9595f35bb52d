"""Block size and threshold per model and machine (`clover tune`, `--block-size auto`).

On a CPU a 32-token draft step costs several AR steps; on a GPU about one. The best block size is
where (tokens per forward) / (time per forward) peaks, which depends on both the model and the
machine, so it is measured: `tune()` decodes a calibration set (the held-out task prompts the
decode benchmark uses) with low_confidence at each (block size, threshold) and keeps the fastest.
Results live in one small JSON file under the user's cache dir ($XDG_CACHE_HOME or ~/.cache,
then clover/tune.json), keyed by model (folder + a hash of its config and weights' size) and
machine (CPU model, threads, device), written atomically. Nothing tuned: the announced defaults.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from ..utils.files import atomic_write
from .engine import DEFAULTS

DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD = DEFAULTS.block_size, DEFAULTS.threshold


def cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "clover" / "tune.json"


def model_key(folder: str | Path) -> str:
    """The model folder and a hash of its config and weight files' sizes (a retrained model in the
    same folder is a different model)."""
    folder = Path(folder).resolve()
    h = hashlib.sha256()
    config = folder / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return f"{folder}#{h.hexdigest()[:12]}"


def machine_key(device: str | None = None, threads: int | None = None) -> str:
    """CPU (or GPU) model, device kind and torch threads; device None = cuda when available. With bf16
    activations in the CPU linears (`--linear-dtype bfloat16`) steps cost less: the key says so
    (`|linear=bfloat16`), and a setting tuned without them stays apart."""
    from ..ops.linear import tiled

    kind = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type
    name = torch.cuda.get_device_name() if kind == "cuda" else _cpu_name()
    key = f"{name}|{kind}|threads={threads or torch.get_num_threads()}"
    return f"{key}|linear=bfloat16" if kind == "cpu" and tiled.bf16_activations() else key


def resolve_block_size(value, model_folder, device: str | None = None) -> tuple[int, float | None]:
    """`--block-size` as given: an int (threshold untouched: None), or "auto": the tuned (block size,
    threshold) for this model and machine, else the announced defaults."""
    if value != "auto":
        return int(value), None
    return lookup(model_key(model_folder), machine_key(device))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read() -> dict:
    """The cache's entries ({} when there is no file); a file that is not one: a one-line error naming it."""
    path = cache_file()
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a tune cache ({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                         "delete it and run `clover tune` again") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"{path}: not a tune cache (a JSON object of objects is needed); "
                         "delete it and run `clover tune` again")
    return data


def store(model: str, machine: str, entry: dict) -> Path:
    """Add or replace the entry for (model, machine); temp file + rename, never a half-written file."""
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read()
    data.setdefault(model, {})[machine] = entry
    return atomic_write(path, json.dumps(data, indent=1, sort_keys=True))


def lookup(model: str, machine: str) -> tuple[int, float]:
    """(block size, threshold) tuned for this model and machine, or the announced defaults."""
    entry = _read().get(model, {}).get(machine)
    try:
        return int(entry["block_size"]), float(entry["threshold"])
    except (TypeError, KeyError, ValueError):
        return DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD


def step_ms(model, sizes, context: int = 256, repeats: int = 10, runner: str = "eager") -> dict[int, float]:
    """Median ms of a draft step of each window size (1 = an AR step) on a cache of `context` tokens."""
    from ..utils.timing import time_alternately
    from .runner import make_runner

    r = make_runner(runner, model)
    prompt = torch.randint(0, model.config.mask_token_id, (1, context), device=model.device)
    cache = r.new_cache(1, context + max(sizes))
    with torch.inference_mode():
        model(prompt, cache=cache)
        snap = cache.snapshot()
        calls = {n: (lambda n=n: r.forward(prompt[:, -n:], cache, block_size=n, draft_len=n, clean_block_size=n,
                                              logits_to_keep=n))
                 if n > 1 else (lambda: r.forward(prompt[:, -1:], cache, logits_to_keep=1)) for n in sizes}
        times = time_alternately(calls, repeats=repeats, warmup=2, setup=lambda _: cache.restore(snap))
    return {n: 1e3 * t for n, t in times.items()}


def decode_rate(model, jobs, eos, mode: str, block_size: int, threshold: float, runner: str = "eager",
                score=None) -> dict:
    """Decode every (prompt, budget) one at a time; tokens, forwards, seconds, tokens/s, and with
    `score(i, token_ids) -> bool` (is job i's output right?) the accuracy."""
    from . import DecodeConfig, Engine

    tokens = forwards = eager_calls = 0
    outputs = []
    start = time.perf_counter()
    for prompt, budget in jobs:
        cfg = DecodeConfig(mode=mode, block_size=block_size, threshold=threshold, max_new_tokens=budget,
                           eos_token_ids=tuple(eos), runner=runner)
        engine = Engine(model, cfg)
        seq = engine.generate([prompt])[0]
        tokens += len(seq.token_ids)
        forwards += seq.forward_passes
        outputs.append(list(seq.token_ids))
        eager_calls += getattr(engine.runner, "eager_calls", 0)  # only a compiled runner falls back
    seconds = time.perf_counter() - start  # scoring (detokenising) is not decode time
    accuracy = None if score is None else sum(bool(score(i, ids)) for i, ids in enumerate(outputs)) / max(len(jobs), 1)
    # eager_calls: model calls a compiled runner ran eagerly (a shape it had no graph for): not its speed
    return dict(block_size=block_size, threshold=threshold, tokens=tokens, forwards=forwards, seconds=seconds,
                tpf=tokens / max(forwards, 1), tokens_per_second=tokens / seconds, accuracy=accuracy,
                eager_calls=eager_calls)


ACCURACY_SLACK = 0.02  # a tuned setting may lose at most 2 points of accuracy against lc at the defaults


THRESHOLDS = (0.7, 0.75, 0.8, 0.85, 0.9, 0.95)  # tried by default: lower ones fill more per step, the accuracy check guards them


def tune(model, jobs, eos, sizes=(4, 8, 16, 32), thresholds=THRESHOLDS, runner: str = "eager", score=None,
         rounds: int = 3, progress=None) -> dict:
    """Measure the step cost per window and low_confidence tokens/s per (block size, threshold) on
    `jobs`; the entry to store: the best setting, the curve, ar's rate and the step costs. With
    `score` (see decode_rate) the best is the fastest setting whose accuracy is within
    ACCURACY_SLACK of low_confidence at the announced defaults (measured too when not on the grid).
    Every setting (ar included) is decoded once per round, the rounds interleaved, so load from other
    processes hits all alike; each keeps its median tokens/s (greedy: its tokens are the same each round).
    `progress(done, total)`, if given, is called after each decode of the whole set."""
    rounds = max(1, rounds)
    settings = [("ar", 1, DEFAULT_THRESHOLD)] + [("low_confidence", b, t) for b in sizes for t in thresholds]
    if score is not None and ("low_confidence", DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD) not in settings:
        settings.append(("low_confidence", DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD))  # the accuracy reference
    # compile (or load) each block size's graphs first: compile seconds are not decode speed
    warm = list(dict.fromkeys((m, b) for m, b, _ in settings)) if runner != "eager" else []
    total, done = len(warm) + rounds * len(settings), 0

    def decoded(result):
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)
        return result

    with torch.inference_mode():
        for mode, b in warm:
            decoded(decode_rate(model, jobs, eos, mode, b, DEFAULT_THRESHOLD, runner))
        runs = {s: [] for s in settings}
        for _ in range(rounds):
            for s in settings:
                runs[s].append(decoded(decode_rate(model, jobs, eos, *s, runner, score)))
    measured = {s: dict(rs[-1], tokens_per_second=statistics.median(r["tokens_per_second"] for r in rs))
                for s, rs in runs.items()}
    ar = measured[settings[0]]
    curve = [measured[("low_confidence", b, t)] for b in sizes for t in thresholds]
    reference = measured.get(("low_confidence", DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD)) if score is not None else None
    eligible = [r for r in curve if reference is None or r["accuracy"] >= reference["accuracy"] - ACCURACY_SLACK - 1e-9]
    best = max(eligible or [reference], key=lambda r: r["tokens_per_second"])
    return dict(block_size=best["block_size"], threshold=best["threshold"], runner=runner, ar=ar, curve=curve,
                reference=reference, rounds=rounds,
                step_ms={str(k): v for k, v in step_ms(model, [1, *sizes], runner=runner).items()},
                prompts=len(jobs), tuned_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
