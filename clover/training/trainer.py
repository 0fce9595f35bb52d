"""`clover train`: one loop for the `ar`, `block_diffusion` and `distill` objectives (distill: the
block objective on the teacher's cached greedy answers, clover/training/distill.py).

Checkpoints (every `ckpt_every` steps, and at the end) are folders
`<out_dir>/checkpoints/step_NNNNNN/` holding the model in HF format (config.json +
model.safetensors, fp32 master weights), `trainer_state.pt` (optimizer, scheduler, RNG states, step;
plain tensors / numbers only, loadable with `torch.load(weights_only=True)`) and `train_config.json`.
Each is written into a temporary folder and renamed into place whole (clover/utils/checkpoint_dirs.py
has the rules), so a run killed at any instant leaves every finished checkpoint intact; `--resume`
continues from the newest complete one (found by looking, not by trusting `checkpoints/latest`, a
hint written after each save) bit-for-bit on CPU (the batch order and the noise come from one seeded
generator whose state is saved). Options given on resume win over the checkpoint's (`max_steps`,
the learning rate, ...), except those it cannot change (config.RESUME_FIXED): a one-line error. A run
without --resume refuses an out_dir that already holds checkpoints.

Outputs in `out_dir`: metrics.jsonl (one record per logged step / eval), loss.png, final/ (model +
tokenizer), checkpoints/.

Under `torchrun` with several processes (`dist`, clover/distributed, docs/distributed.md) the model
is sharded with FSDP2, every rank draws the same global batch and noise from the seeded generator
and runs its own rows of it (the losses and weights equal one process's on the whole batch, up to
fp32 reduction order), checkpoints go through torch.distributed.checkpoint (`step_NNNNNN/dcp/`),
and only rank 0 prints and writes files. With one process nothing of this runs.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import shutil
import time
from pathlib import Path

import torch

from ..data.dataset import encode_files, pack
from ..utils.files import atomic_write
from ..utils import checkpoint_dirs as checkpoints
from .config import RunStopped, TrainConfig, resume_point  # their home is config.py (torch-free); re-exported here
from .objectives import ar_loss, block_diffusion_loss, distill_loss, self_spec_loss


def lr_factor(step: int, cfg: TrainConfig, max_steps: int) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        p = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    decay_start = int(max_steps * (1 - cfg.decay_frac))
    if step < decay_start:
        return 1.0
    p = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
    return 1.0 - (1 - cfg.min_lr_ratio) * p


def block_sizes_at(step: int, max_steps: int, schedule: list) -> list[int]:
    frac = step / max(1, max_steps)
    for until, sizes in schedule:
        if frac < until:
            return [int(s) for s in sizes]
    return [int(s) for s in schedule[-1][1]]


class Trainer:
    def __init__(self, cfg: TrainConfig, resume: bool = False, dist=None):
        from ..data.tokenizer import load_tokenizer
        from ..models import CloverForBlockDiffusion, preset_config

        cfg.validate()
        cfg.check_files()
        self.cfg = cfg
        self.dist = dist  # clover.distributed.runtime.Dist, or None: one process
        self.main = dist is None or dist.main
        if cfg.ep != 1 and (dist is None or cfg.ep != dist.world):
            raise ValueError(f"ep = {cfg.ep} needs torchrun with {cfg.ep} processes "
                             f"(this run has {1 if dist is None else dist.world})")
        if dist is not None and cfg.batch_size < dist.world:
            raise ValueError(f"batch_size {cfg.batch_size} < {dist.world} processes: every rank needs rows")
        try:  # no "Writing model shards" bars between our own
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except Exception:  # pragma: no cover
            pass
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        # stop_after: this process's deadline (a stage longer than one sitting checkpoints and stops)
        self.deadline = time.time() + cfg.stop_after if cfg.stop_after > 0 else None
        self.stopped = False
        self.out = Path(cfg.out_dir)
        self.ckdir = self.out / "checkpoints"
        self.device = torch.device(cfg.device) if dist is None else dist.device
        self.tok = load_tokenizer(cfg.tokenizer)
        torch.manual_seed(cfg.seed)
        latest = resume_point(cfg, resume)  # the newest complete checkpoint, or a one-line error
        if latest is not None and self._sharded_checkpoint(latest):
            from ..models import CloverConfig

            self.model = CloverForBlockDiffusion(CloverConfig.from_pretrained(str(latest)))  # weights: _load_state
        elif latest is not None:
            self.model = CloverForBlockDiffusion.from_pretrained(str(latest), dtype=torch.float32)
        elif cfg.init:
            self.model = CloverForBlockDiffusion.from_pretrained(cfg.init, dtype=torch.float32)
        else:
            over = dict(vocab_size=len(self.tok), mask_token_id=self.tok.mask_token_id,
                        eos_token_id=self.tok.eos_token_id, pad_token_id=self.tok.pad_token_id)
            over.update(cfg.model_overrides)
            self.model = CloverForBlockDiffusion(preset_config(cfg.preset, **over))
        if self.model.config.mask_token_id != self.tok.mask_token_id:
            raise ValueError(f"model mask_token_id {self.model.config.mask_token_id} != tokenizer's "
                             f"{self.tok.mask_token_id}")
        if self.model.config.vocab_size < len(self.tok):
            raise ValueError(f"model vocab {self.model.config.vocab_size} < tokenizer size {len(self.tok)}")
        self.model.to(self.device).train()
        if cfg.recompute:  # each layer keeps its input only and reruns its forward in the backward
            from torch.distributed._composable import checkpoint

            for layer in self.model.model.layers:
                checkpoint(layer)
        self.expert_params = []
        if dist is not None:
            from ..distributed.fsdp import shard_model

            if cfg.ep > 1:
                from ..distributed.expert import apply_expert_parallel

                self.expert_params = apply_expert_parallel(self.model, dist)
            shard_model(self.model, dist, cfg.bf16, self.expert_params)
        self.teacher_model = self._frozen_teacher()
        ids, mask = self._train_stream()
        self.rows, self.rmask = self._with_replay(*pack(ids, mask, cfg.seq_len))
        self.eval_rows = None
        if cfg.eval_files:
            e_ids, e_mask = encode_files(cfg.eval_files, self.tok)
            n = cfg.eval_batches * cfg.batch_size
            r, m = pack(e_ids, e_mask, cfg.seq_len)
            self.eval_rows, self.eval_mask = r[:n], m[:n]
        decay, no_decay, names = [], [], ([], [])
        for n, p in self.model.named_parameters():
            plain = p.dim() < 2 or "norm" in n or "calibration" in n or "bidir" in n
            (no_decay if plain else decay).append(p)
            names[plain].append(n)
        self.param_names = names[0] + names[1]  # the optimiser's parameter order
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
        )
        self.max_steps = cfg.max_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, self.cfg, self.max_steps))
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self.tokens = 0
        self.elapsed = 0.0
        self._saved_step = None  # the step of the last checkpoint this trainer wrote or loaded
        if latest is not None:
            self._load_state(latest)
            self._apply_resume_options(latest)
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "train_config.json").write_text(self.config_json())

    def _frozen_teacher(self):
        """distill with ar_kl_weight > 0: the teacher model, frozen, whose block-size-1 logits each step's
        KL term compares against (a full copy on every rank); else None."""
        cfg = self.cfg
        if cfg.objective != "distill" or not cfg.ar_kl_weight:
            return None
        from ..models import CloverForBlockDiffusion

        teacher = CloverForBlockDiffusion.from_pretrained(cfg.teacher or cfg.init, dtype=torch.float32)
        return teacher.to(self.device).eval().requires_grad_(False)

    def _train_stream(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The training tokens and loss mask: the files' records, or for `distill` the teacher's
        answers to the files' prompts (generated into the cache by rank 0 when missing)."""
        cfg = self.cfg
        if cfg.objective != "distill":
            return encode_files(cfg.train_files, self.tok, cfg.chat_eos_pad)  # held-out rows: unpadded
        from .distill import teacher_data

        if self.dist is not None and not self.main:
            self.dist.barrier()
        deadline = self.deadline if self.dist is None else None  # under torchrun: checked in the loop only
        out = teacher_data(cfg, self.tok, self.device, cfg.progress and self.main, deadline=deadline)
        if self.dist is not None and self.main:
            self.dist.barrier()
        return out

    def _with_replay(self, rows: torch.Tensor, rmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """distill: the teacher's rows plus rows of `replay_files` (data trained as it is, so skills the
        prompts do not cover are kept), a `replay_frac` share of all rows, drawn by a seeded generator."""
        cfg = self.cfg
        if cfg.objective != "distill" or not cfg.replay_files or not cfg.replay_frac:
            return rows, rmask
        r_rows, r_mask = pack(*encode_files(cfg.replay_files, self.tok, cfg.chat_eos_pad), cfg.seq_len)
        want = round(rows.shape[0] * cfg.replay_frac / (1 - cfg.replay_frac))
        pick = torch.randperm(r_rows.shape[0], generator=torch.Generator().manual_seed(cfg.seed + 17))[:want]
        return torch.cat([rows, r_rows[pick]]), torch.cat([rmask, r_mask[pick]])

    def config_json(self) -> str:
        return json.dumps(dataclasses.asdict(self.cfg), indent=2)

    # ---------------------------------------------------------------- checkpoints
    @staticmethod
    def _sharded_checkpoint(path: Path) -> bool:
        return (path / "dcp").is_dir()

    def save_checkpoint(self) -> Path:
        """Write the checkpoint of this step (the sequence clover/utils/checkpoint_dirs.py describes)."""
        name = checkpoints.checkpoint_name(self.step)
        final = self.ckdir / name
        tmp = self.ckdir / f".{name}.tmp"
        if self.dist is not None:  # sharded, through torch.distributed.checkpoint
            from ..distributed import checkpoint

            if self.main:
                self.ckdir.mkdir(parents=True, exist_ok=True)
            checkpoint.save(self, final, tmp, self.dist)
            if self.main:
                self._point_latest(name, final)
            self.dist.barrier()
            self._saved_step = self.step
            return final
        self.ckdir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(str(tmp), safe_serialization=True)
        self.tok.save_pretrained(str(tmp))  # a checkpoint is a whole model folder: `clover generate --model` it
        state = {
            "step": self.step, "tokens": self.tokens, "elapsed": self.elapsed, "max_steps": self.max_steps,
            "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
            "generator": self.gen.get_state(), "torch_rng": torch.get_rng_state(),
        }
        torch.save(state, tmp / "trainer_state.pt")
        (tmp / "train_config.json").write_text(self.config_json())
        checkpoints.put_in_place(tmp, final)
        self._point_latest(name, final)
        self._saved_step = self.step
        return final

    def _point_latest(self, name: str, final: Path) -> None:
        atomic_write(self.ckdir / "latest", name)
        checkpoints.prune(self.ckdir, self.cfg.keep_ckpts, final)

    def _apply_resume_options(self, ck: Path) -> None:
        """The options of this run over the checkpoint's: max_steps (fixed-step runs; a time budget's
        plan continues), and the learning rate, betas and weight decay the optimiser state restored
        (each set only where it differs, so an unchanged run resumes bit-for-bit)."""
        cfg = self.cfg
        self._saved_step = self.step
        if cfg.time_budget <= 0:
            self.max_steps = cfg.max_steps
        for group, decay in zip(self.opt.param_groups, (cfg.weight_decay, 0.0)):
            group["betas"], group["weight_decay"] = (cfg.beta1, cfg.beta2), decay
        if any(group.get("initial_lr") != cfg.lr for group in self.opt.param_groups):
            factor = lr_factor(self.sched.last_epoch, cfg, self.max_steps)  # LambdaLR's lr after last_epoch steps
            self.sched.base_lrs = [cfg.lr] * len(self.opt.param_groups)
            for group in self.opt.param_groups:
                group["initial_lr"], group["lr"] = cfg.lr, cfg.lr * factor

    def _load_state(self, path: Path) -> None:
        if self._sharded_checkpoint(path):  # written under torchrun, by any number of processes
            from ..distributed import checkpoint

            return checkpoint.load(self, path)
        st = torch.load(path / "trainer_state.pt", weights_only=True, map_location="cpu")
        if self.dist is not None:  # a single-process checkpoint under torchrun: its full optimiser state, sharded
            from ..distributed.checkpoint import load_full_optimizer

            load_full_optimizer(self, st["optimizer"])
        else:
            self.opt.load_state_dict(st["optimizer"])
        self.max_steps = int(st["max_steps"])
        self.sched.load_state_dict(st["scheduler"])
        self.gen.set_state(st["generator"])
        torch.set_rng_state(st["torch_rng"])
        self.step, self.tokens, self.elapsed = int(st["step"]), int(st["tokens"]), float(st["elapsed"])

    # ---------------------------------------------------------------- steps
    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16)

    def _loss(self, ids, mask, block, gen, held_out=False, stats=None, shard=None):
        """The training loss; `held_out`: the plain ELBO (random masks, no confidence term) whatever
        the training mix, so every run's held-out loss compares. `shard`: this rank's rows (under
        torchrun), the loss then its share of the global batch's."""
        if self.cfg.objective == "ar" or block == 1:
            return ar_loss(self.model, ids, mask, shard)
        suffix_frac, conf_weight = (0.0, 0.0) if held_out else (self.cfg.suffix_frac, self.cfg.conf_weight)
        bd = dict(t_min=self.cfg.t_min, t_max=self.cfg.t_max, generator=gen, complementary=self.cfg.complementary,
                  suffix_frac=suffix_frac, conf_weight=conf_weight, shard=shard)
        if self.cfg.objective == "distill" and not held_out:
            return distill_loss(self.model, ids, mask, block, self.cfg.ar_weight, stats, teacher=self.teacher_model,
                                kl_weight=self.cfg.ar_kl_weight, **bd)
        return block_diffusion_loss(self.model, ids, mask, block, stats=stats, **bd)

    def _shard(self, batch: int):
        if self.dist is None:
            return None
        from ..distributed.fsdp import batch_shard

        return batch_shard(self.dist, batch)

    def train_step(self) -> dict:
        cfg = self.cfg
        block = 1
        if cfg.objective != "ar":
            sizes = block_sizes_at(self.step, self.max_steps, cfg.block_schedule)
            block = sizes[int(torch.randint(len(sizes), (1,), generator=self.gen))]
        total, ntok, stats = 0.0, 0, {}
        shard = self._shard(cfg.batch_size)
        for micro in range(cfg.grad_accum):
            idx = torch.randint(self.rows.shape[0], (cfg.batch_size,), generator=self.gen)
            ids, mask = self.rows[idx], self.rmask[idx]
            if cfg.random_phase and block > 1:  # vary where the window boundaries fall
                crop = int(torch.randint(block, (1,), generator=self.gen))
                ids, mask = ids[:, crop:], mask[:, crop:]
            ids, mask = ids.to(self.device), mask.to(self.device)
            spec = cfg.self_spec_frac > 0 and block > 1 and float(torch.rand(1, generator=self.gen)) < cfg.self_spec_frac
            if shard is not None:  # FSDP reduces the gradients after the last micro-batch only
                self.model.set_requires_gradient_sync(micro == cfg.grad_accum - 1)
            with self._autocast():
                if spec:
                    loss, _ = self_spec_loss(self.model, ids, mask, block, cfg.t_min, cfg.t_max, self.gen, shard)
                else:
                    loss, _ = self._loss(ids, mask, block, self.gen, stats=stats, shard=shard)
            if shard is None:
                (loss / cfg.grad_accum).backward()
                total += float(loss.detach()) / cfg.grad_accum
            else:  # FSDP averages the gradients over ranks: the sum of the shares is the batch's loss
                (loss * shard.world / cfg.grad_accum).backward()
                total += shard.all_sum(float(loss.detach())) / cfg.grad_accum
            ntok += ids.numel()
        if self.expert_params:  # complete on their owner, but scaled by the world size like every loss share
            from ..distributed.expert import scale_grads

            scale_grads(self.expert_params, shard.world)
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if shard is not None:
            from ..distributed.fsdp import full_tensor

            gnorm = full_tensor(gnorm)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens += ntok
        # "stats": what the objective reports beside the loss (the confidence term's, last micro-batch)
        return {"loss": total, "grad_norm": float(gnorm), "block_size": block, "tokens_step": ntok, "stats": stats}

    @torch.no_grad()
    def evaluate(self) -> dict:
        if self.eval_rows is None:
            return {}
        self.model.eval()
        gen = torch.Generator().manual_seed(1234)  # the same noise at every evaluation
        out = {}
        bs = self.cfg.batch_size
        blocks = [1] + ([self.cfg.eval_block_size] if self.cfg.objective != "ar" else [])
        for block in blocks:
            num, den = 0.0, 0
            for i in range(0, self.eval_rows.shape[0], bs):
                ids = self.eval_rows[i:i + bs].to(self.device)
                mask = self.eval_mask[i:i + bs].to(self.device)
                shard = self._shard(ids.shape[0])
                with self._autocast():
                    loss, n = self._loss(ids, mask, block, gen, held_out=True, shard=shard)
                if shard is not None:  # the shares of the ranks (none from a rank without rows)
                    loss = shard.all_sum(0.0 if shard.empty else float(loss))
                num += float(loss) * n
                den += n
            out["eval_ar_loss" if block == 1 else f"eval_bd{block}_loss"] = num / max(den, 1)
        self.model.train()
        return out

    def calibrate_budget(self) -> int:
        """Set max_steps so the run fits `time_budget` seconds: time one step at each block size of
        the schedule's last stage (after one warm-up pass), on a separate generator and without
        touching the weights, so the training itself stays a pure function of the config + max_steps."""
        cfg = self.cfg
        sizes = block_sizes_at(10**9, 1, cfg.block_schedule) if cfg.objective != "ar" else [1]
        gen = torch.Generator().manual_seed(cfg.seed + 7919)
        ids = self.rows[: cfg.batch_size].to(self.device)
        mask = self.rmask[: cfg.batch_size].to(self.device)
        times = []
        for block in [sizes[-1]] + sizes:
            t0 = time.time()
            with self._autocast():
                loss, _ = self._loss(ids, mask, block, gen)
            loss.backward()
            times.append(time.time() - t0)
        self.opt.zero_grad(set_to_none=True)
        per_step = sum(times[1:]) / len(sizes) * cfg.grad_accum
        if self.dist is not None:  # rank 0's timing: every rank must plan the same number of steps
            per_step = self.dist.broadcast(per_step)
        self.max_steps = max(cfg.warmup_steps + 1, int(cfg.time_budget / per_step))
        self._log({"calibration": True, "seconds_per_step": per_step, "max_steps": self.max_steps})
        return self.max_steps

    def _replan(self, per_step: float, bar) -> None:
        """Time-budget mode on a shared machine: until 75% of the budget has elapsed, re-fit max_steps
        to the time left at the recent step time (the schedules stretch or shrink with it), so a plan
        that shrank under contention grows back when the machine frees up. (Freezing at 75% of the
        *steps* let a shrunken plan reach its freeze point early and end the stage with budget left.)
        The plan is saved in checkpoints, so --resume continues it; bit-for-bit resume needs a fixed
        max_steps."""
        if self.step % max(1, self.cfg.log_every) or self.elapsed >= 0.75 * self.cfg.time_budget:
            return
        left = max(0.0, self.cfg.time_budget - self.elapsed)
        new = max(self.step + 1, self.cfg.warmup_steps + 1, self.step + int(left / max(per_step, 1e-6)))
        if new != self.max_steps:
            self.max_steps = new
            bar.total = new
            bar.refresh()

    # ---------------------------------------------------------------- loop
    def _log(self, rec: dict) -> None:
        if not self.main:
            return
        with (self.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def fit(self) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        if self.main and self.step == 0 and (self.out / "metrics.jsonl").exists():
            (self.out / "metrics.jsonl").unlink()
        if cfg.time_budget > 0 and self.step == 0:
            self.calibrate_budget()
        bar = tqdm(total=self.max_steps, initial=self.step, disable=not (cfg.progress and self.main), dynamic_ncols=True,
                   desc=cfg.objective)
        window_t, window_tok, losses, extras = time.time(), 0, [], {}
        last_eval = {}
        step_ema = None
        while self.step < self.max_steps:
            t0 = time.time()
            rec = self.train_step()
            dt = time.time() - t0
            if self.dist is not None and cfg.time_budget > 0:  # one clock, so every rank plans the same steps
                dt = self.dist.broadcast(dt)
            self.elapsed += dt
            window_tok += rec["tokens_step"]
            losses.append(rec["loss"])
            for key, value in rec["stats"].items():
                extras.setdefault(key, []).append(value)
            if cfg.time_budget > 0:
                step_ema = dt if step_ema is None else 0.9 * step_ema + 0.1 * dt
                self._replan(step_ema, bar)
            if not math.isfinite(rec["loss"]):
                raise FloatingPointError(f"loss is {rec['loss']} at step {self.step}")
            if self.step % cfg.log_every == 0 or self.step == self.max_steps:
                now = time.time()
                tps = window_tok / max(now - window_t, 1e-9)
                log = {"step": self.step, "loss": sum(losses) / len(losses), "lr": self.sched.get_last_lr()[0],
                       "grad_norm": rec["grad_norm"], "block_size": rec["block_size"], "tokens": self.tokens,
                       "tokens_per_s": tps, "elapsed_s": self.elapsed}
                log.update({key: sum(v) / len(v) for key, v in extras.items()})  # means over the window's steps
                self._log(log)
                window_t, window_tok, losses, extras = now, 0, [], {}
                bar.set_postfix(loss=f"{log['loss']:.3f}", tok_s=f"{tps:.0f}", bs=rec["block_size"])
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.max_steps:
                last_eval = self.evaluate()
                if last_eval:
                    self._log({"step": self.step, **last_eval})
                    self.plot()
            if cfg.ckpt_every and self.step % cfg.ckpt_every == 0:
                self.save_checkpoint()
            bar.update(1)
            if self._past_deadline():
                break
        bar.close()
        if self.stopped:
            return self._stop()
        last_eval = self.evaluate()
        if last_eval:
            self._log({"step": self.step, **last_eval})
        if self._saved_step != self.step:  # not saved by the loop's last step already
            self.save_checkpoint()
        final = self.out / "final"
        if self.dist is not None:  # the shards gathered into one HF folder
            from ..distributed.checkpoint import export_hf

            export_hf(self.model, self.tok, final, self.dist)
        else:
            self.model.save_pretrained(str(final))
            self.tok.save_pretrained(str(final))
        self.plot()
        summary = {"step": self.step, "tokens": self.tokens, "elapsed_s": self.elapsed,
                   "tokens_per_s": self.tokens / max(self.elapsed, 1e-9), **last_eval, "final": str(final)}
        if self.dist is not None:
            summary["world_size"] = self.dist.world
        if self.expert_params:  # what each rank held: its experts of each MoE layer
            summary["experts_per_rank"] = self.expert_params[0].to_local().shape[0]
        if self.main:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _past_deadline(self) -> bool:
        """stop_after reached (every rank takes rank 0's answer)."""
        if self.deadline is None or self.step >= self.max_steps:
            return False
        late = float(time.time() >= self.deadline)
        if self.dist is not None:
            late = self.dist.broadcast(late)
        self.stopped = bool(late)
        return self.stopped

    def _stop(self) -> dict:
        """End an unfinished run at its deadline: a checkpoint of this step (no final/, no summary.json),
        from which --resume continues as if it had not stopped."""
        if self._saved_step != self.step:
            self.save_checkpoint()
        self._log({"step": self.step, "stopped": True, "elapsed_s": self.elapsed})
        self.plot()
        return {"step": self.step, "max_steps": self.max_steps, "tokens": self.tokens, "elapsed_s": self.elapsed,
                "stopped": True, "checkpoint": str(self.ckdir / checkpoints.checkpoint_name(self.step))}

    def plot(self) -> Path | None:
        if not self.main:
            return None
        return plot_metrics(self.out / "metrics.jsonl", self.out / "loss.png")


def plot_metrics(metrics: Path, png: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    recs = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    tr = [r for r in recs if "loss" in r]
    if tr:
        ax.plot([r["step"] for r in tr], [r["loss"] for r in tr], label="train")
    for key in sorted({k for r in recs for k in r if k.startswith("eval_")}):
        ev = [r for r in recs if key in r]
        ax.plot([r["step"] for r in ev], [r[key] for r in ev], "o-", label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    data = io.BytesIO()
    fig.savefig(data, format="png", dpi=100)
    plt.close(fig)
    return atomic_write(png, data.getvalue())
