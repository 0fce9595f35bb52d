"""The one decoding settings object, torch-free: `DecodeConfig` holds every decoding default once
(`DEFAULTS`) and the infill default (`INFILL_THRESHOLD`); the CLI, the server, the lm-eval model, the
benchmarks and the Python API build one and pass it whole. Frozen and checked when made (a bad
setting is a ValueError naming it); `check(model)` adds the checks that need a model (the block size
against the model's largest block: `check_block_size`, the one place that check is written).

The server's engine key is a `DecodeConfig` too (`engine_key`): rows whose configs are equal but for
their token budget share one engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

MODES = ("low_confidence", "topk", "entropy", "margin", "self_spec", "ar", "editing")
DRAFTS = ("diffusion", "lookup")  # self_spec's drafts: the model's diffusion step, or looked up in the context
POLICIES = ("low_confidence", "topk", "entropy", "margin")  # the diffusion fill policies (engine/policies.py)
RUNNERS = ("eager", "compiled")  # how the model is called (engine/runner.py; a test checks they agree)
INFILL_THRESHOLD = 0.9  # slots (decide, structured output, forced tool calls) commit above this confidence
# The seeds a generation accepts: a 64-bit signed integer, as OpenAI's `seed` (the server and the CLI check
# against these; the sampler folds the seed into torch's generator).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """EOS ids from the tokenizer, the model config and its generation config: where decoding stops."""
    found = set()
    for source in (tokenizer.eos_token_id, model.config.eos_token_id,
                   getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        found |= set(source if isinstance(source, (list, tuple)) else [source])
    return tuple(sorted(t for t in found if t is not None))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = argmax
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    suppress: tuple[int, ...] = ()  # token ids never chosen, in every mode (e.g. a tool-call frame without tools)

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_threshold(threshold: float) -> None:
    if not 0 <= threshold <= 1:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")


def policy_steps(block_size: int, steps: int | None) -> int:
    """A fixed-budget policy's steps per block: `steps`, by default block_size // 4 (~4 tokens a step)."""
    steps = steps or max(1, block_size // 4)
    if not 1 <= steps <= block_size:
        raise ValueError(f"steps must be in [1, block_size={block_size}], got {steps}")
    return steps


def check_block_size(block_size: int, model, low: int = 1) -> None:
    """`block_size` in [low, the model's largest block] (infilling needs 2: an anchor and a slot)."""
    top = model.config.max_block_size
    if not low <= block_size <= top:
        raise ValueError(f"block_size must be in [{low}, {top}], got {block_size}")


@dataclass(frozen=True)
class DecodeConfig:
    """How to decode. Derive a variant with `dataclasses.replace` / `with_`, build one from flat
    settings with `from_settings`."""

    mode: str = "low_confidence"
    block_size: int = 32
    threshold: float = 0.95
    steps: int | None = None  # per block, for topk / entropy / margin
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # decode past EOS (every row runs its whole budget)
    prefill_chunk: int = 512  # prompt tokens per prefill forward (rounded to whole windows)
    runner: str = "eager"  # how the model is called: "eager" or "compiled" (engine/runner.py)
    # mode editing (LLaDA2.1, engine/editing.py): a decoded token whose prediction differs with probability
    # above edit_threshold is replaced; after a block's last mask up to max_post_steps forwards only edit
    edit_threshold: float = 0.5
    max_post_steps: int = 16
    # self_spec's drafts: "diffusion" (one diffusion step of the model) or "lookup" (the continuation of
    # the context's latest repeated n-gram, engine/lookup.py; an AR step where there is none)
    draft: str = "diffusion"

    def __post_init__(self) -> None:
        self.validate()

    def with_(self, **changes) -> "DecodeConfig":
        return replace(self, **changes)

    @property
    def eos(self) -> tuple[int, ...]:
        """The ids that end a row (none with `ignore_eos`)."""
        return () if self.ignore_eos else self.eos_token_ids

    @classmethod
    def from_settings(cls, base: "DecodeConfig | None" = None, **settings) -> "DecodeConfig":
        """`base` (default: the defaults) with flat settings: any field, and the sampling's
        `temperature`, `top_p`, `top_k`, `seed`, `suppress`. A setting given as None keeps the base's
        value; numbers may come as text (lm-eval's model_args; "" / "None" = None). ValueError names a
        bad or unknown setting."""
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
        if self.draft not in DRAFTS:
            raise ValueError(f"draft must be one of {', '.join(DRAFTS)}, got {self.draft!r}")
        if self.mode == "self_spec" and not self.sampling.greedy:
            raise ValueError("self_spec is greedy only (it reproduces ar greedy output): use temperature 0")
        if self.mode in ("low_confidence", "editing"):
            check_threshold(self.threshold)
        if not 0 <= self.edit_threshold <= 1:
            raise ValueError(f"edit_threshold must be in [0, 1], got {self.edit_threshold}")
        if self.max_post_steps < 0:
            raise ValueError(f"max_post_steps must be >= 0, got {self.max_post_steps}")
        elif self.mode in POLICIES:
            policy_steps(self.block_size, self.steps)

    def check(self, model) -> "DecodeConfig":
        """The checks that need the model (its largest block; a mode that means nothing on its layout,
        engine/layout.py); returns self."""
        check_block_size(self.block_size, model)
        check_mode_layout(self.mode, bool(getattr(model, "shift", True)), absolute_blocks(model))
        return self

    def engine_key(self) -> "DecodeConfig":
        """What rows must share to decode in one engine: everything but their token budget (and the
        seed of greedy rows, which draw nothing)."""
        sampling = self.sampling if not self.sampling.greedy else replace(self.sampling, seed=None)
        return replace(self, max_new_tokens=DEFAULTS.max_new_tokens, sampling=sampling)


DEFAULTS = DecodeConfig()
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "suppress")  # flat names of DecodeConfig.sampling's fields
_NUMBERS = {"block_size": int, "threshold": float, "steps": int, "max_new_tokens": int, "prefill_chunk": int,
            "edit_threshold": float, "max_post_steps": int, "temperature": float, "top_p": float, "top_k": int,
            "seed": int}  # settings that may come as text


def decode_config(model, tokenizer, config: DecodeConfig | None = None, /, **settings) -> DecodeConfig:
    """The decoding settings for this model: `config` (default: DecodeConfig's defaults) with the
    keyword `settings` (DecodeConfig.from_settings: any field, and temperature / top_p / top_k / seed)
    and the model's EOS ids. Checked once, by DecodeConfig."""
    if config is None and getattr(model, "decode_defaults", None):  # a family's published block size, threshold
        config = DecodeConfig(**model.decode_defaults)
    return DecodeConfig.from_settings(config, **settings, eos_token_ids=eos_ids(model, tokenizer))


def check_mode_layout(mode: str, shift: bool, absolute: bool) -> None:
    """ValueError (one line) for a mode that means nothing on a model's layout: `shift` (position i
    predicts token i+1) and `absolute` (blocks at absolute positions)."""
    if mode in ("ar", "self_spec") and not shift:
        raise ValueError(f"mode {mode} needs a model whose position i predicts token i+1; this one predicts each "
                         "masked position itself (no shift): use a diffusion mode (low_confidence)")
    if mode == "self_spec" and absolute:
        raise ValueError("mode self_spec drafts blocks that start anywhere; this model's blocks sit at absolute "
                         "positions (a draft would be cut by a block boundary): use ar or a diffusion mode")
    if mode == "editing" and (shift or not absolute):
        raise ValueError("mode editing needs a model that predicts each masked position itself in blocks at "
                         "absolute positions (LLaDA2.1, SDAR); this one does not: use low_confidence")


def infill_settings(model, threshold: float | None, block_size: int | None) -> tuple:
    """The threshold and block size a structured reply or a joint decision commits slots at: the
    given ones, else INFILL_THRESHOLD and 32 on a Clover model; a public family (blocks at absolute
    positions) keeps None for what is not given, meaning its published ones."""
    if absolute_blocks(model):
        return threshold, block_size
    return INFILL_THRESHOLD if threshold is None else threshold, block_size or 32


def absolute_blocks(model) -> bool:
    """Do the model's blocks sit at absolute positions (the public families) rather than right after
    the prompt (Clover)? Then structured output decodes in the family's own layout (engine/family_grammar.py)."""
    return getattr(model, "block_align", "relative") == "absolute"
