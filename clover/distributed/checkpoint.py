"""Sharded training checkpoints through torch.distributed.checkpoint (DCP), and the HF export.

A distributed checkpoint is a folder `checkpoints/step_NNNNNN/` holding
* `dcp/`: the model's and the optimiser's tensors, each rank writing its own shards (DCP's
  `.distcp` files + `.metadata`); tensors only, so loading never unpickles anything;
* `trainer_state.json`: step, tokens, elapsed, max_steps, the scheduler's state and the optimiser's
  param groups (plain numbers); `rng.safetensors`: the data generator's and torch's RNG states;
* `config.json`, the tokenizer files and `train_config.json`.
It is written into `.step_NNNNNN.tmp/` and renamed into place by rank 0 once every rank's shards
are on disk (then `latest` is replaced), so an interrupted save leaves the last good one intact.
DCP re-shards on load: a checkpoint written by N processes resumes on M (one process included,
with a plain model: `load()` works without a process group). The checkpoint folder must be on a
file system every rank sees (a shared one across nodes).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from ..utils.checkpoint_dirs import put_in_place
from ..utils.files import keep_umask_mode

STATE = "trainer_state.json"


def is_distributed_checkpoint(path: Path) -> bool:
    return (Path(path) / STATE).is_file() and (Path(path) / "dcp").is_dir()


def _state_dicts(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return msd, osd


def save(trainer, final: Path, tmp: Path, d) -> None:
    """Every rank calls this; rank 0 writes the small files and renames `tmp` to `final`."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    main = d is None or d.main
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if d is not None:
        d.barrier()
    msd, osd = _state_dicts(trainer.model, trainer.opt)
    dcp.save({"model": msd, "optim": osd["state"]}, checkpoint_id=str(tmp / "dcp"))
    if d is not None:
        d.barrier()  # every shard written
    if main:
        state = {"step": trainer.step, "tokens": trainer.tokens, "elapsed": trainer.elapsed,
                 "max_steps": trainer.max_steps, "scheduler": trainer.sched.state_dict(),
                 "param_groups": osd["param_groups"], "world_size": d.world if d else 1}
        (tmp / STATE).write_text(json.dumps(state, indent=2, default=float))
        save_file({"generator": trainer.gen.get_state(), "torch_rng": torch.get_rng_state()},
                  str(tmp / "rng.safetensors"))
        keep_umask_mode(tmp / "rng.safetensors")  # safetensors writes 0600
        trainer.model.config.save_pretrained(str(tmp))
        trainer.tok.save_pretrained(str(tmp))
        (tmp / "train_config.json").write_text(trainer.config_json())
        put_in_place(tmp, final)  # whole, never half-replaced (clover/utils/checkpoint_dirs.py)
    if d is not None:
        d.barrier()


def load(trainer, path: Path) -> None:
    """Load a distributed checkpoint into the trainer's (sharded or plain) model and optimiser."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_state_dict

    msd, osd = _state_dicts(trainer.model, trainer.opt)  # the optimiser state initialised, as templates
    target = {"model": msd, "optim": osd["state"]}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, checkpoint_id=str(path / "dcp"))
    st = json.loads((path / STATE).read_text())
    set_state_dict(trainer.model, trainer.opt, model_state_dict=target["model"],
                   optim_state_dict={"state": target["optim"], "param_groups": st["param_groups"]})
    trainer.max_steps = int(st["max_steps"])
    trainer.sched.load_state_dict(st["scheduler"])
    rng = load_file(str(path / "rng.safetensors"))
    trainer.gen.set_state(rng["generator"])
    torch.set_rng_state(rng["torch_rng"])
    trainer.step, trainer.tokens, trainer.elapsed = int(st["step"]), int(st["tokens"]), float(st["elapsed"])


def load_full_optimizer(trainer, osd: dict) -> None:
    """A single-process optimiser state (parameters by index, full tensors) into the sharded
    optimiser: indices become the parameter names, each rank keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = trainer.param_names
    full = {"state": {names[int(i)]: v for i, v in osd["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in osd["param_groups"]]}
    set_optimizer_state_dict(trainer.model, trainer.opt, full, options=StateDictOptions(full_state_dict=True))


def export_hf(model, tokenizer, folder: Path, d) -> None:
    """The full model (gathered from the shards to rank 0's CPU) as one HF folder, written by rank 0
    into a temporary folder and renamed."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if d is None or d.main:
        from ..models import CloverForBlockDiffusion

        with torch.device("meta"):
            plain = CloverForBlockDiffusion(model.config)
        plain.load_state_dict(full, assign=True)
        plain.tie_weights()
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        plain.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    if d is not None:
        d.barrier()
