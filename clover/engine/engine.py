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

import functools

import torch

from ..settings import DEFAULTS, MODES, DecodeConfig  # noqa: F401 - re-exported (clover.engine)
from .batch import Prefill, RowBatch
from .editing import EditingMode
from .layout import Layout
from .model_api import seam_of
from .modes import ARMode, DiffusionMode, LookupSpecMode, Mode, SelfSpecMode, TokenHook
from .policies import SCORES
from .runner import make_runner
from .sampling import make_generator
from .sequence import Sequence, sequences


def make_mode(cfg, mask_id: int, device, generator, hook: TokenHook | None = None, layout: Layout = Layout()) -> Mode:
    """`layout`: the model's for this mode (`Layout.of`, which refuses a mode that means nothing on it)."""
    if hook is not None and cfg.mode != "ar":
        raise ValueError(f"a token hook constrains ar decoding, not {cfg.mode}")
    if cfg.mode in SCORES:
        mode = DiffusionMode(cfg, mask_id, device, generator)
    elif cfg.mode == "self_spec":
        mode = (LookupSpecMode if cfg.draft == "lookup" else SelfSpecMode)(cfg, mask_id, device, generator)
    elif cfg.mode == "ar":
        mode = ARMode(cfg, mask_id, device, generator, hook)
    elif cfg.mode == "editing":
        mode = EditingMode(cfg, mask_id, device, generator, layout)
    else:
        raise ValueError(f"unknown mode {cfg.mode!r}")
    mode.layout = layout
    return mode


def without_grad(fn):
    """`fn` under torch.no_grad(), entered only where grad is on: a caller already without it (the
    server's decoding loop, in inference mode for good) does not enter and leave it at every step."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


class Engine:
    def __init__(self, model, config: DecodeConfig, defer_compile: bool = False, hook=None):
        """`defer_compile` (runner "compiled"): a step of a shape with no graph yet runs eagerly and the
        shape waits for `runner.compile_deferred` (the server compiles when idle). `hook`: constrains
        `ar` decoding (modes.TokenHook: a grammar)."""
        self.seam = seam_of(model)  # the model seam (engine/model_api.py): all the engine reads of the model
        cfg = config.check(model)
        self.model, self.cfg = model, cfg
        self.runner = make_runner(cfg.runner, model, defer=defer_compile)
        self.mask_id = self.seam.mask_id
        self.device = model.device
        self.eos = set(cfg.eos)
        layout = Layout.of(self.seam, cfg.mode)
        self.mode = make_mode(cfg, self.mask_id, self.device, make_generator(cfg.sampling, self.device), hook, layout)
        self.batch = RowBatch.for_runner(self.runner, self.mode.width, self.mode.clean_block_size, self.mask_id, self.device,
                                         cfg.prefill_chunk)
        self.batch.layout = layout
        self.added = 0
        self.joining: list[Prefill] = []  # long prompts prefilling chunk by chunk between steps (`add(interleave=)`)

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
    @without_grad
    def add(self, prompts: list[list[int]], max_new_tokens: list[int] | None = None,
            interleave: bool = False) -> list[Sequence]:
        """Validate every prompt before any work, prefill them as a batch and join the running rows
        (continuous batching: requests may be added between steps). `max_new_tokens` gives each row
        its own budget (default: the config's). `interleave`: a prompt that takes more than one
        prefill forward prefills one chunk per `step`, after the running rows' decoding forward, and
        joins them when only its last clean window is left, which rides with their next forward (a
        long prompt never stalls them for longer than a chunk); until then it is in `prefilling`."""
        budgets = [self.cfg.max_new_tokens] * len(prompts) if max_new_tokens is None else list(max_new_tokens)
        seqs = sequences(prompts, budgets, self.seam.context, self.added)
        self.added += len(seqs)
        later = [s for s in seqs if interleave and self.batch.prefill_forwards(s.prompt_ids)]
        self.joining += [Prefill(self.batch, [s], self._capacity([s]), tail=self.batch.clean_block_size) for s in later]
        now = [s for s in seqs if not any(s is t for t in later)]
        if now:
            first = not self.batch.seqs
            self.batch.join(now, capacity=self._capacity(now))
            self.mode.join(now, first)
        return seqs

    def _capacity(self, seqs: list[Sequence]) -> int:
        return max(len(s.prompt_ids) + s.max_new_tokens for s in seqs) + self.batch.width

    def _admit(self, prefill: Prefill) -> None:
        first = not self.batch.seqs
        self.batch.admit(prefill)
        self.mode.join(prefill.seqs, first)

    @property
    def prefilling(self) -> list[Sequence]:
        """Rows added with `interleave` whose prefill has chunks left (not in `seqs` yet)."""
        return [s for p in self.joining for s in p.seqs]

    def block_view(self, row: int = 0) -> list[tuple[int | None, int]]:
        """The current block of a running row as (token or None while masked, fill step) pairs."""
        return self.mode.block_view(row) if row < len(self.seqs) else []

    def finish(self, seq: Sequence, reason: str = "cancelled") -> None:
        """End a running row between steps (client gone, stop string matched): it leaves the batch
        and its cache rows are freed."""
        if seq.finished:
            return
        for p in self.joining:
            if p.seqs[0] is seq:  # one row per prefill in `joining`
                seq.finish(reason)
                self.joining.remove(p)
                return
        if not any(s is seq for s in self.seqs):
            return
        seq.finish(reason)
        self._drop_finished()

    # ---- step ---------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return bool(self.seqs or self.joining)

    @without_grad
    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Advance every running row, then one prefill chunk of the first prompt in `prefilling` (its
        rows join once only the last clean window is left); returns (sequence, new tokens) for rows that
        produced output."""
        events = []
        if self.seqs:
            events = None
            while events is None:  # one round: one forward, two for a self_spec draft + verify
                events = self.mode.consume(self.batch, self.batch.run(self.mode.plan(self.batch)))
            self._drop_finished()
        if self.joining:
            prefill = self.joining[0]
            prefill.advance()
            if not prefill.chunks_left:
                self._admit(self.joining.pop(0))
        return events

    def steps(self):
        """This engine as a job (engine/slots.py): yields each forward its mode plans and takes the
        logits back, until every row has finished."""
        while self.running:
            events = None
            while events is None:
                events = self.mode.consume(self.batch, (yield self.mode.plan(self.batch)))
            self._drop_finished()

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

