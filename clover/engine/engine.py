"""The decoding engine: the scheduler-facing front of one decoding configuration. Reads top to
bottom: add requests (validate, prefill, join the row batch) -> step (the mode advances every row:
one model forward per denoising step / AR step, one or two per self-spec round) -> drop finished
rows.

Three parts, each with one job:
* `RowBatch` (engine/batch.py): the running rows, their cache rows, the pending clean segment, the
  draft window, prefill and left padding, join / leave. Shared by every mode.
* a mode (engine/modes.py): diffusion policies, AR or self-speculative, each with its own typed
  per-row state.
* the runner (engine/runner.py): the only code that calls the model.

Batch state lives on-device as [rows, window] tensors; the host sees one small sync per step (did a
block finish?). Every row advances its own block and leaves the batch when it finishes; new
requests may join between steps (`add`), so a server can batch continuously.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .batch import RowBatch
from .modes import make_mode
from .policies import SCORES, make_policy
from .runner import RUNNERS, make_runner
from .sampling import SamplingParams, make_generator
from .sequence import Sequence

MODES = ("low_confidence", "topk", "entropy", "margin", "self_spec", "ar")


@dataclass(frozen=True)
class DecodeConfig:
    """How to decode: every decoding default lives here once (`DEFAULTS`); the API, the CLI, the
    server's Settings and EngineKey, the lm-eval model and the benchmarks take theirs from it, and
    build one from flat settings the same way (`from_settings`). Frozen and checked when made (a bad
    setting is a ValueError naming it): derive a variant with `dataclasses.replace` / `with_`."""

    mode: str = "low_confidence"
    block_size: int = 32
    threshold: float = 0.95
    steps: int | None = None  # per block, for topk / entropy / margin
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    prefill_chunk: int = 512  # prompt tokens per prefill forward (rounded to whole windows)
    runner: str = "eager"  # how the model is called: "eager" or "compiled" (engine/runner.py)

    def __post_init__(self) -> None:
        self.validate()

    def with_(self, **changes) -> "DecodeConfig":
        return replace(self, **changes)

    @classmethod
    def from_settings(cls, base: "DecodeConfig | None" = None, **settings) -> "DecodeConfig":
        """`base` (default: the defaults) with flat settings: any field, and the sampling's
        `temperature`, `top_p`, `top_k`, `seed`. A setting given as None keeps the base's value;
        numbers may come as text (lm-eval's model_args; "" / "None" = None). ValueError names a bad
        or unknown setting."""
        base = DEFAULTS if base is None else base
        fields, sampling = {}, {}
        for name, value in settings.items():
            if isinstance(value, str) and name in _NUMBERS:
                try:
                    value = None if value in ("", "None") else _NUMBERS[name](value)
                except ValueError:
                    raise ValueError(f"{name} must be a number, got {value!r}") from None
            if value is None:
                continue
            if name in _SAMPLING:
                sampling[name] = value
            elif name in cls.__dataclass_fields__:
                fields[name] = value
            else:
                raise ValueError(f"unknown decoding setting {name!r}")
        if sampling:
            fields["sampling"] = replace(fields.get("sampling", base.sampling), **sampling)
        return replace(base, **fields)

    def validate(self) -> None:
        """Checks that need no model (so a CLI can fail before loading one)."""
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r} (known: {', '.join(MODES)})")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.sampling.validate()
        if self.runner not in RUNNERS:
            raise ValueError(f"unknown runner {self.runner!r} (known: {', '.join(RUNNERS)})")
        if self.mode == "self_spec" and not self.sampling.greedy:
            raise ValueError("self_spec is greedy only (it reproduces ar greedy output): use temperature 0")
        if self.mode in SCORES:
            make_policy(self.mode, self.block_size, self.threshold, self.steps)


DEFAULTS = DecodeConfig()
_SAMPLING = ("temperature", "top_p", "top_k", "seed")  # flat names of DecodeConfig.sampling's fields
_NUMBERS = {"block_size": int, "threshold": float, "steps": int, "max_new_tokens": int, "prefill_chunk": int,
            "temperature": float, "top_p": float, "top_k": int, "seed": int}  # settings that may come as text


class Engine:
    def __init__(self, model, config: DecodeConfig, defer_compile: bool = False):
        """`defer_compile` (runner "compiled"): a step of a shape with no graph yet runs eagerly and the
        shape waits for `runner.compile_deferred` (the server compiles when idle)."""
        cfg, mc = config, model.config
        if cfg.block_size > mc.max_block_size:
            raise ValueError(f"block_size must be in [1, {mc.max_block_size}], got {cfg.block_size}")
        self.model, self.cfg = model, cfg
        self.runner = make_runner(cfg.runner, model, defer=defer_compile)
        self.mask_id = mc.mask_token_id
        self.device = model.device
        self.eos = set(cfg.eos_token_ids)
        self.mode = make_mode(cfg, self.mask_id, self.device, make_generator(cfg.sampling, self.device))
        cap = self.runner.prefill_chunk  # a compiled runner takes prompts in chunks its graphs fit
        if cap:  # the prompt's last chunk rides with the first window: both fit, a 60-token tail + 4 columns is 64, not 68
            cap = max(cap - self.mode.width, self.mode.clean_bs)
        self.batch = RowBatch(self.runner, self.mode.width, self.mode.clean_bs, self.mask_id, self.device,
                              min(cfg.prefill_chunk, cap) if cap else cfg.prefill_chunk)
        self.added = 0

    # the row batch's parts the server scheduler reads (the slot mode takes the whole `batch`)
    @property
    def seqs(self) -> list[Sequence]:
        return self.batch.seqs

    @property
    def cache(self):
        return self.batch.cache

    @property
    def policy(self):
        return getattr(self.mode, "policy", None)

    # ---- add requests ----------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, prompts: list[list[int]], max_new_tokens: list[int] | None = None) -> list[Sequence]:
        """Validate every prompt before any work, prefill them as a batch and join the running rows
        (continuous batching: requests may be added between steps). `max_new_tokens` gives each row
        its own budget (default: the config's)."""
        budgets = self._budgets(prompts, max_new_tokens)
        seqs = [Sequence(self.added + i, list(p), n) for i, (p, n) in enumerate(zip(prompts, budgets))]
        self.added += len(seqs)
        first = not self.batch.seqs
        longest = max(len(p) + n for p, n in zip(prompts, budgets))
        self.batch.join(seqs, capacity=longest + self.batch.width)
        self.mode.join(seqs, first)
        return seqs

    def _budgets(self, prompts: list[list[int]], max_new_tokens: list[int] | None) -> list[int]:
        if not prompts:
            raise ValueError("no prompts")
        budgets = list(max_new_tokens) if max_new_tokens is not None else [self.cfg.max_new_tokens] * len(prompts)
        if len(budgets) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(budgets)} max_new_tokens")
        ctx = self.model.config.max_position_embeddings
        for i, (p, n) in enumerate(zip(prompts, budgets)):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if n < 1:
                raise ValueError(f"max_new_tokens must be >= 1, got {n}")
            if len(p) + n > ctx:
                raise ValueError(f"prompt {i} ({len(p)} tokens) + max_new_tokens ({n}) "
                                 f"exceeds the model's context of {ctx} tokens")
        return budgets

    def block_view(self, row: int = 0) -> list[tuple[int | None, int]]:
        """The current block of a running row as (token or None while masked, fill step) pairs."""
        return self.mode.block_view(row) if row < len(self.seqs) else []

    def finish(self, seq: Sequence, reason: str = "cancelled") -> None:
        """End a running row between steps (client gone, stop string matched): it leaves the batch
        and its cache rows are freed."""
        if seq.finished or not any(s is seq for s in self.seqs):
            return
        seq.finish(reason)
        self._drop_finished()

    # ---- step ---------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return bool(self.seqs)

    @torch.no_grad()
    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Advance every running row; returns (sequence, new tokens) for rows that produced output."""
        events = self.mode.step(self.batch)
        self._drop_finished()
        return events

    def _drop_finished(self) -> None:
        idx = self.batch.drop_finished()
        if idx is not None:
            self.mode.select(idx)

    # ---- whole runs ---------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], on_step=None) -> list[Sequence]:
        """Run a batch to the end; `on_step(engine, events)` is called after every step."""
        seqs = self.add(prompts)
        for _ in self._run(on_step):
            pass
        return seqs

    def stream(self, prompts: list[list[int]], on_step=None):
        """Yield (sequence, new tokens) as rows produce output (block by block)."""
        self.add(prompts)
        yield from self._run(on_step)

    def _run(self, on_step):
        while self.running:
            events = self.step()
            if on_step is not None:
                on_step(self, events)
            yield from events

