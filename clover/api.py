"""Python API: `model, tokenizer = clover.load()` and `clover.generate(model, tokenizer, prompt)`.
torch, transformers and the engine are imported by the functions that use them, so `model_folder`
(the checks of a model folder) answers without them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .chat import encode, split_thinking  # part of the Python API; their home is clover.chat
from .settings import SEED_MAX, SEED_MIN, decode_config, eos_ids  # noqa: F401 (the API; home: clover.settings)

if TYPE_CHECKING:
    from .engine import DecodeConfig

DEFAULT_MODEL = Path(__file__).parent / "assets" / "default"


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) or "length"
    forward_passes: int  # model forwards after the prompt prefill
    tokens_per_forward: float
    seconds: float
    tokens_per_second: float
    reasoning: str | None = None  # the <think> part, with think=True
    trajectory: list[tuple[int, int]] | None = None  # per token: (block, step at which it was filled)

    def to_dict(self, token_ids: bool = True, trajectory: bool = True) -> dict:
        drop = {name for name, keep in (("token_ids", token_ids), ("trajectory", trajectory)) if not keep}
        return {k: v for k, v in asdict(self).items() if v is not None and k not in drop}


def check_device_name(device: str) -> str:
    """cpu, cuda or cuda:N, checked by its spelling alone (no torch)."""
    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise ValueError(f"unknown device {device!r} (use cpu, cuda or cuda:N)")
    return str(device)


def cpu_only_torch() -> str | None:
    """The installed torch's version when it is a CPU-only build (read from its metadata: no import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("torch")
    except PackageNotFoundError:
        return None
    return v if v.endswith("+cpu") else None


def resolve_device(device: str | None) -> str:
    """A device checked before anything loads: cpu, cuda, cuda:N (None = cuda when available)."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = check_device_name(device)
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine (torch {torch.__version__}"
                             f"{'' if torch.version.cuda else ', a CPU-only build'}); use --device cpu")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def check_checkpoint(folder: str | Path):
    """The CloverConfig of a checkpoint folder after checking it whole (config.json a Clover config,
    every safetensors file complete, every tensor shaped as the config says); ValueError naming the file."""
    import torch

    from .models import CloverConfig, CloverForBlockDiffusion
    from .utils.checkpoint import CheckpointError, check_folder, check_shapes

    _, weights = check_folder(folder)
    try:
        config = CloverConfig.from_pretrained(folder)
    except ValueError as e:  # CloverConfig's own validation (layer_types, heads, ...)
        raise CheckpointError(f"{Path(folder) / 'config.json'}: {e}") from None
    with torch.device("meta"):
        check_shapes(folder, CloverForBlockDiffusion(config), weights)
    return config


def model_folder(path: str | Path | None = None) -> Path:
    """The folder `load` reads (None = the shipped default model), checked without torch: config.json
    a Clover config, tokenizer files present, every safetensors file whole; else a one-line error."""
    from .errors import UserError
    from .utils.checkpoint import check_folder

    folder = Path(path) if path else DEFAULT_MODEL
    if not (folder / "config.json").is_file():
        if path is None:
            raise UserError(f"no default model at {folder}: build it with `make model` (or pass a model folder)")
        raise UserError(f"{folder}: no config.json (not a model folder)")
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise UserError(f"{folder}: no tokenizer files (tokenizer.json); copy the model's tokenizer beside its weights")
    check_folder(folder)
    return folder


def load(path: str | Path | None = None, device: str | None = None, dtype=None):
    """(model, tokenizer) from a model folder; None = the shipped default model. bf16 on CUDA.
    The folder is checked first (config.json a Clover config, safetensors files whole, shapes as the
    config says): a bad one is a ValueError naming the file, before any weight is read."""
    import torch
    from transformers import AutoTokenizer

    from .models import CloverForBlockDiffusion
    from .utils.checkpoint import load_progress

    folder = model_folder(path)
    device = resolve_device(device)
    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    if is_family_folder(folder):  # a public block-diffusion family behind the engine's seam
        return load_family_seam(folder, device, dtype)
    config = check_checkpoint(folder)
    with load_progress(folder):
        model = CloverForBlockDiffusion.from_pretrained(folder, config=config, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def is_family_folder(folder) -> bool:
    from .models.families import is_family_folder as is_family

    return is_family(folder)


def load_family_seam(folder, device, dtype):
    """(FamilySeam, tokenizer) of a family folder (clover/models/family_seam.py): its published
    decoding defaults ride on the model (`decode_defaults`, read by `decode_config`)."""
    from .models.families import load_family
    from .models.family_seam import FamilySeam

    loaded = load_family(folder, dtype=dtype, device=device)
    return FamilySeam(loaded).eval(), loaded.tokenizer


def result(seq, tokenizer, think: bool = False, trajectory: bool = False) -> Generation:
    n = len(seq.token_ids)
    text = tokenizer.decode(seq.token_ids, skip_special_tokens=True)
    reasoning = None
    if think:
        reasoning, text = split_thinking(text)
    return Generation(text, seq.token_ids, seq.finish_reason, seq.forward_passes, n / max(seq.forward_passes, 1),
                      seq.seconds, n / seq.seconds, reasoning, seq.trajectory if trajectory else None)


def generate(model, tokenizer, prompts, config: DecodeConfig | None = None, *, chat: bool = False,
             think: bool = False, trajectory: bool = False, on_step=None, **settings):
    """Generate for one prompt (a string or a list of chat messages) -> Generation, or for a list of
    prompts (one batch, each row finishing on its own) -> list[Generation]. Decoding follows `config`
    and the keyword `settings` (`max_new_tokens=`, `block_size=`, `threshold=`, `mode=`, `steps=`,
    `edit_threshold=`, `max_post_steps=` (mode "editing"), `temperature=`, `top_p=`, `top_k=`, `seed=`,
    `runner=`; defaults: DecodeConfig's). See
    DecodeConfig for modes and runners (runner="compiled": torch.compile'd steps, engine/runner.py);
    think=True uses the chat template in thinking mode and returns the reasoning apart."""
    single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict))
    batch = [prompts] if single else list(prompts)
    cfg = decode_config(model, tokenizer, config, **settings)
    ids = [encode(tokenizer, p, chat or think, think) for p in batch]
    from .engine import Engine

    seqs = Engine(model, cfg).generate(ids, on_step)
    out = [result(s, tokenizer, think, trajectory) for s in seqs]
    return out[0] if single else out
