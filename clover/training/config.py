"""`clover train`'s options: TrainConfig (the keys of a TOML config, the `clover train` flags) and its checks.

Torch-free, so `clover train --help` and argument errors answer without loading torch; the training
loop (clover/training/trainer.py, which re-exports TrainConfig) imports it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

OBJECTIVES = ("ar", "block_diffusion", "distill")
RECIPE_HINT = ("recipes/default's stages get their data and tokenizer from `make model`, which builds "
               "runs/default/ and trains them: recipes/default/README.md")


class RunStopped(Exception):
    """A run reached its `stop_after` before its teacher cache was complete: every finished part is
    kept, and the same command with --resume continues."""


@dataclass
class TrainConfig:
    objective: str = "ar"
    out_dir: str = "runs/train"
    tokenizer: str = ""  # tokenizer folder (tokenizer.json)
    init: str = ""  # a model folder to start from (HF format), else a fresh `preset`
    preset: str = "clover-small"
    model_overrides: dict = field(default_factory=dict)  # CloverConfig fields for a fresh model
    train_files: list = field(default_factory=list)
    eval_files: list = field(default_factory=list)
    seq_len: int = 256
    batch_size: int = 8
    grad_accum: int = 1
    max_steps: int = 1000
    time_budget: float = 0.0  # seconds; > 0: max_steps is fitted to the budget (calibrate_budget, _replan)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | wsd
    decay_frac: float = 0.2  # wsd: share of steps in the final decay
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    bf16: bool = False
    device: str = "cpu"
    seed: int = 0
    threads: int = 0  # torch.set_num_threads (0: leave)
    recompute: bool = False  # recompute each decoder layer in the backward (activation checkpointing)
    ep: int = 1  # expert parallel over this many processes (under torchrun: all of them; clover/distributed/expert.py)
    # block diffusion
    t_min: float = 0.1
    t_max: float = 1.0
    complementary: bool = False
    suffix_frac: float = 0.0  # share of windows masked as a suffix (objectives.sample_noise), not at random
    conf_weight: float = 0.0  # weight of the confidence term (entropy of right predictions; objectives docstring)
    chat_eos_pad: int = 0  # extra end-of-text targets after each training chat record (data.dataset docstring)
    block_schedule: list = field(default_factory=lambda: [[0.1, [1]], [0.2, [4]], [0.3, [8]], [0.4, [16]],
                                                         [1.0, [4, 8, 16, 32]]])
    random_phase: bool = True
    eval_block_size: int = 32
    # self-distillation (objective "distill", clover/training/distill.py): train_files hold prompts
    teacher: str = ""  # model folder whose greedy ar output is the target (default: init)
    teacher_cache: str = ""  # folder of the cached teacher outputs (default: <out_dir>/teacher)
    teacher_max_new_tokens: int = 64  # budget of each teacher answer (a record's own max_new_tokens if smaller)
    teacher_batch: int = 32  # prompts per engine run (and per cache part)
    ar_weight: float = 0.0  # distill: weight of the AR loss added to the block loss of every block > 1 step
    ar_kl_weight: float = 0.0  # distill: weight of KL(teacher || student) at block size 1 (a frozen teacher forward per step)
    replay_files: list = field(default_factory=list)  # distill: data files trained as they are beside the teacher's rows
    replay_frac: float = 0.0  # distill: their share of the training rows (< 1)
    self_spec_frac: float = 0.0  # share of steps on causal-prefix + one-noisy-window samples (self_spec_loss)
    # bookkeeping
    stop_after: float = 0.0  # seconds after the run starts: save a checkpoint and stop unfinished (resume with --resume)
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    ckpt_every: int = 100
    keep_ckpts: int = 2
    progress: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - names)
        if bad:
            raise ValueError(f"unknown training option(s): {', '.join(bad)}")
        return cls(**d)

    def validate(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"schedule must be cosine or wsd, got {self.schedule!r}")
        if not self.train_files:
            raise ValueError(f"no train_files given (set train_files, or pass --train-files FILE.jsonl; {RECIPE_HINT})")
        if not self.tokenizer:
            raise ValueError(f"no tokenizer given (set tokenizer, or pass --tokenizer DIR; {RECIPE_HINT})")
        if not 0 <= self.self_spec_frac <= 1:
            raise ValueError(f"self_spec_frac must be in [0, 1], got {self.self_spec_frac}")
        if not 0 <= self.suffix_frac <= 1:
            raise ValueError(f"suffix_frac must be in [0, 1], got {self.suffix_frac}")
        if self.conf_weight < 0:
            raise ValueError(f"conf_weight must be >= 0, got {self.conf_weight}")
        if not 0 <= self.replay_frac < 1:
            raise ValueError(f"replay_frac must be in [0, 1), got {self.replay_frac}")
        if self.ar_weight < 0:
            raise ValueError(f"ar_weight must be >= 0, got {self.ar_weight}")
        if self.ar_kl_weight < 0:
            raise ValueError(f"ar_kl_weight must be >= 0, got {self.ar_kl_weight}")
        if self.stop_after < 0:
            raise ValueError(f"stop_after must be >= 0, got {self.stop_after}")
        if self.objective == "distill":
            if not (self.teacher or self.init):
                raise ValueError("objective distill needs a teacher model: set init (or teacher)")
            if self.teacher_max_new_tokens < 1 or self.teacher_batch < 1:
                raise ValueError("teacher_max_new_tokens and teacher_batch must be >= 1")
        if self.chat_eos_pad < 0:
            raise ValueError(f"chat_eos_pad must be >= 0, got {self.chat_eos_pad}")
        if not 0 < self.t_min <= self.t_max <= 1:
            raise ValueError(f"need 0 < t_min <= t_max <= 1, got {self.t_min}, {self.t_max}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda":
            import torch  # only here: the rest of the checks (and `clover train --help`) stay torch-free

            if not torch.cuda.is_available():
                raise ValueError("device cuda requested but CUDA is not available")
        for stage in self.block_schedule:
            if len(stage) != 2 or not stage[1] or any(int(b) < 1 for b in stage[1]):
                raise ValueError(f"bad block_schedule stage {stage!r}: want [until_fraction, [sizes...]]")

    def check_files(self) -> None:
        """The tokenizer folder and the data files exist (a one-line error naming the first missing one);
        apart from `validate`, which also checks configs prepared before their data is built."""
        from pathlib import Path

        hint = lambda path: f"; {RECIPE_HINT}" if "runs/default" in str(path) else ""  # noqa: E731
        if not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer {self.tokenizer}: no tokenizer.json there{hint(self.tokenizer)}")
        for name in ("train_files", "eval_files"):
            for path in getattr(self, name):
                if not Path(path).is_file():
                    raise ValueError(f"{name}: {path}: no such file{hint(path)}")


# what a resumed run takes from its checkpoint whatever it is given: the model (its shape and
# weights) and the seeded generator's state
RESUME_FIXED = ("preset", "model_overrides", "init", "seed")


def resume_point(cfg: TrainConfig, resume: bool) -> Path | None:
    """The checkpoint a run starts from: with `resume` the newest complete one in out_dir, else None;
    a one-line error where there is none to resume, where a fresh run would mix its checkpoints with
    an earlier run's, or where an option cannot be honoured on resume (RESUME_FIXED changed, max_steps
    before the checkpoint). Torch-free: `clover train` asks before any process group starts."""
    from ..utils.checkpoint_dirs import find_checkpoint, step_of

    ckdir = Path(cfg.out_dir) / "checkpoints"
    latest = find_checkpoint(ckdir)
    if resume and latest is None:
        raise ValueError(f"--resume: no checkpoint in {ckdir}")
    if not resume and latest is not None:
        raise ValueError(f"{ckdir} holds checkpoints of an earlier run ({latest.name}): pass --resume "
                         f"to continue it, or use a new --out-dir")
    if latest is None:
        return None
    saved_file = latest / "train_config.json"
    saved = json.loads(saved_file.read_text()) if saved_file.is_file() else {}
    for name in RESUME_FIXED:
        if name in saved and saved[name] != getattr(cfg, name):
            raise ValueError(f"--resume: {name} cannot change on resume (checkpoint {latest.name} has {saved[name]!r}, "
                             f"this run {getattr(cfg, name)!r}); drop the option or use a new --out-dir")
    step = step_of(latest)
    if cfg.time_budget <= 0 and cfg.max_steps < step:
        raise ValueError(f"--resume: max_steps {cfg.max_steps} is before checkpoint {latest.name}'s step {step}")
    return latest

