"""Self-distillation data (`objective = "distill"`): the teacher's greedy `ar` output, cached.

The teacher is the model being converted, decoded at block size 1 (`ar`: the lossless target that
`self_spec` accepts) by the engine, in batches, over the training prompts. Training on one consistent
answer per prompt (the model's own) instead of the data's many continuations is what lets a student
fill a block in one forward (dParallel, d3LLM, LLaDA2.1 all train on their own outputs).

Prompts: JSONL records with "prompt" (plain text, encoded as `clover generate` encodes it) or
"messages" (a chat; the template's generation prompt is appended), and an optional "max_new_tokens".

The cache is a folder: `meta.json` (what it was made from: the teacher's files, the prompts' token ids,
the budget and batch, hashed) and `part_NNNNNN.jsonl`, one per batch of `batch` prompts, each written
whole (temp file + rename). Greedy decoding of fixed batches is deterministic, so a run killed at any
instant resumes by generating only the parts that are missing and ends with the same bytes as an
uninterrupted one. A cache made from other prompts or another teacher is refused (one line), never mixed.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from ..utils.files import atomic_write
from .config import RunStopped

VERSION = 1


def read_prompts(paths, tok) -> list[tuple[list[int], int | None]]:
    """(prompt ids, its own budget or None) of every record in the JSONL `paths`."""
    from ..chat import encode

    out = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"no such prompt file: {p}")
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if not isinstance(rec, dict) or not ("prompt" in rec or "messages" in rec):
                raise ValueError(f"{p}:{n}: a distillation record needs 'prompt' or 'messages'")
            ids = encode(tok, rec["prompt"]) if "prompt" in rec else encode(tok, rec["messages"], chat=True)
            if not ids:
                raise ValueError(f"{p}:{n}: empty prompt")
            out.append((ids, rec.get("max_new_tokens")))
    if not out:
        raise ValueError(f"no prompts in {', '.join(map(str, paths))}")
    return out


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else json.dumps(part, sort_keys=True).encode())
    return h.hexdigest()


def teacher_fingerprint(teacher: str | Path) -> str:
    """A hash of the teacher folder's config and weights (what its outputs depend on)."""
    folder = Path(teacher)
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _meta(teacher_id: str, prompts, max_new_tokens: int, batch: int) -> dict:
    return {"version": VERSION, "teacher": teacher_id, "prompts": _digest([p for p, _ in prompts]),
            "budgets": _digest([b for _, b in prompts]), "n_prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "batch": batch, "mode": "ar"}


def part_path(cache: Path, k: int) -> Path:
    return cache / f"part_{k:06d}.jsonl"


def _open_cache(cache: Path, meta: dict) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    mf = cache / "meta.json"
    if mf.is_file():
        old = json.loads(mf.read_text())
        if old != meta:
            diff = sorted(k for k in meta if old.get(k) != meta[k])
            raise ValueError(f"teacher cache {cache} was made with another {', '.join(diff)}: delete it or set "
                             f"another teacher_cache")
        return
    atomic_write(mf, json.dumps(meta, indent=1) + "\n")


def build_teacher_cache(model, tok, prompts, cache, max_new_tokens: int, batch: int, teacher_id: str,
                        eos=(), progress: bool = True, after_part=None, deadline=None) -> list[dict]:
    """Generate the parts of `cache` that are missing (greedy `ar`, `batch` prompts per engine run) and
    return every record {"prompt_ids", "output_ids", "finish_reason"} in prompt order. `after_part(k)`
    is called after part k is in place (tests inject faults there). Past `deadline` (time.time())
    it stops between parts: RunStopped, the finished parts kept."""
    from tqdm import tqdm

    from ..engine import DecodeConfig, Engine

    cache = Path(cache)
    _open_cache(cache, _meta(teacher_id, prompts, max_new_tokens, batch))
    cfg = DecodeConfig(mode="ar", max_new_tokens=max_new_tokens, eos_token_ids=tuple(eos))
    n_parts = -(-len(prompts) // batch)
    todo = [k for k in range(n_parts) if not part_path(cache, k).is_file()]
    bar = tqdm(total=n_parts, initial=n_parts - len(todo), desc="teacher (ar)", disable=not progress,
               dynamic_ncols=True)
    for k in todo:
        if deadline is not None and time.time() >= deadline:
            bar.close()
            raise RunStopped(f"teacher cache {cache}: stopped at the deadline with {len(todo) - todo.index(k)} of "
                             f"{n_parts} parts to go (resume to continue)")
        chunk = prompts[k * batch:(k + 1) * batch]
        budgets = [min(b or max_new_tokens, max_new_tokens) for _, b in chunk]
        with torch.inference_mode():
            engine = Engine(model, cfg)
            seqs = engine.add([p for p, _ in chunk], budgets)
            while engine.running:
                engine.step()
        lines = [json.dumps({"prompt_ids": s.prompt_ids, "output_ids": s.token_ids, "finish_reason": s.finish_reason})
                 for s in seqs]
        atomic_write(part_path(cache, k), "\n".join(lines) + "\n")
        bar.update(1)
        if after_part is not None:
            after_part(k)
    bar.close()
    return read_teacher_cache(cache)


def read_teacher_cache(cache) -> list[dict]:
    """Every record of a complete cache, in prompt order; ValueError when parts are missing."""
    cache = Path(cache)
    meta = json.loads((cache / "meta.json").read_text())
    n_parts = -(-meta["n_prompts"] // meta["batch"])
    missing = [k for k in range(n_parts) if not part_path(cache, k).is_file()]
    if missing:
        raise ValueError(f"teacher cache {cache} lacks {len(missing)} of {n_parts} parts (first: {missing[0]})")
    recs = [json.loads(line) for k in range(n_parts) for line in part_path(cache, k).read_text().splitlines() if line]
    if len(recs) != meta["n_prompts"]:
        raise ValueError(f"teacher cache {cache} holds {len(recs)} records, meta.json says {meta['n_prompts']}")
    return recs


def teacher_stream(records: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The records as one token stream with its loss mask (the prompt is context, the teacher's
    output, its end token included, the target), ready for `dataset.pack`."""
    ids, mask = [], []
    for r in records:
        ids += r["prompt_ids"] + r["output_ids"]
        mask += [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"])
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def teacher_data(cfg, tok, device, progress: bool = True, after_part=None,
                 deadline=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The distillation stream of a TrainConfig: its cache (`teacher_cache`, default
    <out_dir>/teacher), completed first from the teacher (`teacher`, default `init`) when parts are
    missing."""
    from ..api import eos_ids, load

    teacher = cfg.teacher or cfg.init
    cache = Path(cfg.teacher_cache or Path(cfg.out_dir) / "teacher")
    prompts = read_prompts(cfg.train_files, tok)
    meta = _meta(teacher_fingerprint(teacher), prompts, cfg.teacher_max_new_tokens, cfg.teacher_batch)
    n_parts = -(-len(prompts) // cfg.teacher_batch)
    if (cache / "meta.json").is_file() and all(part_path(cache, k).is_file() for k in range(n_parts)):
        _open_cache(cache, meta)  # complete: only check it is this one
        return teacher_stream(read_teacher_cache(cache))
    model, _ = load(teacher, str(device))
    recs = build_teacher_cache(model, tok, prompts, cache, cfg.teacher_max_new_tokens, cfg.teacher_batch,
                               meta["teacher"], eos_ids(model, tok), progress, after_part, deadline)
    del model
    return teacher_stream(recs)


def interpolate(base: dict, tuned: dict, alpha: float) -> dict:
    """Weights `base + alpha * (tuned - base)` (WiSE-FT, Wortsman et al. 2022: a fine-tuned model
    averaged with its start keeps the start's skills better than either alone): after distillation,
    the student moved part of the way back to its teacher, so block size 1 loses less of what the
    teacher did while the block paths keep part of their gain. Computed in float32, cast back to
    each tensor's dtype; the two state dicts must hold the same names and shapes."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"merge weight must be in [0, 1], got {alpha}")
    if base.keys() != tuned.keys():
        raise ValueError(f"different tensors: {sorted(base.keys() ^ tuned.keys())[:3]}")
    out = {}
    for name, t in tuned.items():
        b = base[name]
        if b.shape != t.shape:
            raise ValueError(f"{name}: shape {tuple(b.shape)} against {tuple(t.shape)}")
        out[name] = torch.lerp(b.float(), t.float(), alpha).to(t.dtype) if t.is_floating_point() else t.clone()
    return out
