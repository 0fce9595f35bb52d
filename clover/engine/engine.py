"""The decoding engine. Reads top to bottom: add requests (validate, prefill) -> step (one model
forward per denoising step / AR step, one or two per self-spec round) -> postprocess (hand finished
blocks to their Sequence, start the next block, drop finished rows).

Batch state lives on-device as [rows, window] tensors; the host sees one small sync per step (did a
block finish?). Every row advances its own block and leaves the batch when it finishes; new
requests may join between steps (`add`), so a server can batch continuously.

Modes (all share prefill, caches and bookkeeping):
* diffusion (`low_confidence`, `topk`, `entropy`, `margin`): the draft window is
  [last known token, MASK x (B-1)]; column j predicts target j. A finished block becomes clean and
  is committed *in the same forward* as the first step of the next block (clean_block_size = B).
* `ar`: greedy/sampled next-token decoding; the last token is committed as it is fed.
* `self_spec`: prefix committed causally (clean_block_size = 1); each round drafts a block in one
  diffusion step, verifies it causally with the cache recording, keeps the agreeing prefix plus the
  AR correction and rolls the cache back to it. Lossless w.r.t. `ar` greedy. After a round that
  accepted whole blocks, the next draft rides along in the verify forward (one forward per round).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .policies import SCORES, make_policy
from .runner import RUNNERS, make_runner
from .sampling import SamplingParams, make_generator, sample
from .sequence import Sequence

MODES = ("low_confidence", "topk", "entropy", "margin", "self_spec", "ar")


@dataclass
class DecodeConfig:
    mode: str = "low_confidence"
    block_size: int = 32
    threshold: float = 0.95
    steps: int | None = None  # per block, for topk / entropy / margin
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    prefill_chunk: int = 512  # prompt tokens per prefill forward (rounded to whole windows)
    runner: str = "eager"  # how the model is called: "eager" or "compiled" (engine/runner.py)

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


class Engine:
    def __init__(self, model, config: DecodeConfig):
        cfg, mc = config, model.config
        cfg.validate()
        if cfg.block_size > mc.max_block_size:
            raise ValueError(f"block_size must be in [1, {mc.max_block_size}], got {cfg.block_size}")
        self.model, self.cfg = model, cfg
        self.runner = make_runner(cfg.runner, model)
        self.policy = make_policy(cfg.mode, cfg.block_size, cfg.threshold, cfg.steps) if cfg.mode in SCORES else None
        self.width = 1 if cfg.mode == "ar" else cfg.block_size  # columns of the per-row window
        self.clean_bs = cfg.block_size if self.policy else 1  # AR and self-spec commit causally
        self.mask_id = mc.mask_token_id
        self.device = model.device
        self.eos = set(cfg.eos_token_ids)
        self.eos_t = torch.tensor(sorted(self.eos), device=self.device) if self.eos else None
        self.generator = make_generator(cfg.sampling, self.device)
        self.seqs: list[Sequence] = []  # running rows, in cache row order
        self.added = 0
        self.pending = self.ready_draft = None

    # ---- add requests ----------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, prompts: list[list[int]], max_new_tokens: list[int] | None = None) -> list[Sequence]:
        """Validate every prompt before any work, prefill them as a batch and join the running rows
        (continuous batching: requests may be added between steps). `max_new_tokens` gives each row
        its own budget (default: the config's)."""
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
        seqs = [Sequence(self.added + i, list(p), n) for i, (p, n) in enumerate(zip(prompts, budgets))]
        self.added += len(seqs)
        longest = max(len(p) + n for p, n in zip(prompts, budgets))
        cache = self.runner.new_cache(len(seqs), capacity=longest + self.width)
        pending = self._prefill(seqs, cache)
        window = torch.full((len(seqs), self.width), self.mask_id, dtype=torch.long, device=self.device)
        window[:, 0] = torch.tensor([p[-1] for p in prompts], device=self.device)
        state = self._new_block_state(seqs) if self.policy else {}
        if self.seqs:  # join the running rows
            self.cache.append_rows(cache)
            self.pending = _stack_pending(self.pending, len(self.seqs), pending, len(seqs), self.device)
            window = torch.cat([self.window, window])
            state = {name: torch.cat([getattr(self, name), value]) for name, value in state.items()}
        else:
            self.cache, self.pending, self.whole_last_round = cache, pending, False
        self.window = window
        for name, value in state.items():
            setattr(self, name, value)
        self.ready_draft = None  # a draft fused into the last verify covers the old rows only
        self.seqs += seqs
        return seqs

    def _prefill(self, seqs: list[Sequence], cache) -> tuple | None:
        """Commit prompt[:-1] (left-padded) in chunks whose boundaries fall on clean windows counted
        from the end; returns the last chunk, to be fused with the first decoding forward."""
        cleans = [s.prompt_ids[:-1] for s in seqs]
        width = max(map(len, cleans))
        if width == 0:
            return None
        ids = torch.zeros(len(cleans), width, dtype=torch.long)
        pad = torch.ones(len(cleans), width, dtype=torch.bool)
        for r, c in enumerate(cleans):
            if c:
                ids[r, width - len(c):] = torch.tensor(c)
                pad[r, width - len(c):] = False
        ids, pad = ids.to(self.device), pad.to(self.device)
        chunk = max(self.clean_bs, self.cfg.prefill_chunk // self.clean_bs * self.clean_bs)
        cuts = [0] + list(range(width % chunk or chunk, width, chunk)) + [width]
        for a, b in zip(cuts[:-2], cuts[1:-1]):
            self.runner.forward(ids[:, a:b], cache, clean_block_size=self.clean_bs,
                                pad=pad[:, a:b] if pad[:, a:b].any() else None, keep=1)
        a = cuts[-2]
        return ids[:, a:], pad[:, a:] if pad[:, a:].any() else None

    def _new_block_state(self, seqs: list[Sequence]) -> dict[str, torch.Tensor]:
        rows, B = len(seqs), self.cfg.block_size
        zeros = lambda dtype: torch.zeros(rows, B, dtype=dtype, device=self.device)  # noqa: E731
        return dict(filled=zeros(torch.bool), targets=zeros(torch.long), fill_step=zeros(torch.long),
                    steps_done=torch.zeros(rows, dtype=torch.long, device=self.device), eligible=self._eligible(seqs))

    def _eligible(self, seqs: list[Sequence]) -> torch.Tensor:
        """Targets a new block may fill: all B, or the remaining budget in a last partial block."""
        remaining = torch.tensor([s.remaining for s in seqs], device=self.device)
        return torch.arange(self.cfg.block_size, device=self.device)[None, :] < remaining[:, None]

    def block_view(self, row: int = 0) -> list[tuple[int | None, int]]:
        """The current block of a running row as (token or None while masked, fill step) pairs."""
        if not self.policy or row >= len(self.seqs):
            return []
        n = int(self.eligible[row].sum())
        filled, tokens, steps = (t[row, :n].tolist() for t in (self.filled, self.targets, self.fill_step))
        return [(t if f else None, s) for f, t, s in zip(filled, tokens, steps)]

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
        if self.cfg.mode == "ar":
            events = self._step_ar()
        elif self.cfg.mode == "self_spec":
            events = self._step_self_spec()
        else:
            events = self._step_diffusion()
        self._drop_finished()
        return events

    def _forward(self, window: torch.Tensor, draft_len: int, keep: int, index: torch.Tensor | None = None) -> torch.Tensor:
        """One model call on [pending clean segment ; window]; the pending segment is consumed."""
        ids, pad = window, None
        if self.pending is not None:
            clean, clean_pad = self.pending
            ids = torch.cat([clean, window], dim=1)
            if clean_pad is not None:
                pad = torch.cat([clean_pad, clean_pad.new_zeros(window.shape)], dim=1)
            self.pending = None
        for s in self.seqs:
            s.forward_passes += 1
        return self.runner.forward(ids, self.cache, block_size=self.cfg.block_size if draft_len else None,
                                   draft_len=draft_len, clean_block_size=self.clean_bs, pad=pad, keep=keep,
                                   index=index)

    def _sample(self, logits):
        return sample(logits, self.cfg.sampling, self.mask_id, self.generator)

    def _step_ar(self):
        tokens, _ = self._sample(self._forward(self.window, 0, 1)[:, -1])
        self.window = tokens[:, None]
        events = []
        for seq, t in zip(self.seqs, tokens.tolist()):
            seq.append([t], [0], self.eos)
            events.append((seq, [t]))
        return events

    def _step_self_spec(self):
        """Draft (unless the last verify already drafted this block), then verify causally. When the
        last round accepted whole blocks, the next block's draft rides along in the verify forward,
        assuming this block is accepted whole too; it is used only if it was (otherwise the prefix
        it assumed has been rolled back)."""
        B = self.cfg.block_size
        draft = self.ready_draft
        if draft is None:
            draft, _ = self._sample(self._forward(self.window, B, B))  # draft[:, j] = guess for target j
        self.cache.start_recording()
        verify_ids = torch.cat([self.window[:, :1], draft[:, :-1]], dim=1)
        fuse = self.ready_draft is not None or self.whole_last_round
        if fuse:
            next_window = torch.cat([draft[:, -1:], self.window[:, 1:]], dim=1)  # [d_B, MASK...]
            tokens, _ = self._sample(self._forward(torch.cat([verify_ids, next_window], dim=1), B, 2 * B))
        else:
            tokens, _ = self._sample(self._forward(verify_ids, 0, B))
        ar, next_draft = tokens[:, :B], tokens[:, B:]  # ar[:, j] = greedy AR token for target j
        agree = (draft == ar).long().cumprod(1).sum(1)
        # the agreeing prefix equals ar[:, :agree]; ar[:, agree] is the correction (when agree < B)
        take = (agree + 1).clamp_max(B).tolist()
        events, keep = [], []
        for seq, row, n, a in zip(self.seqs, ar.tolist(), take, agree.tolist()):
            out = self._cut_at_eos(row[: min(n, seq.remaining)])
            seq.append(out, [0 if j < a else 1 for j in range(len(out))], self.eos)  # step 1 = AR correction
            events.append((seq, out))
            keep.append(len(out))
        keep_t = torch.tensor(keep, device=self.device)
        self.cache.rollback(keep_t)  # keeps x_{n-1} and the accepted tokens but the last one
        self.whole_last_round = all(k == B for k, s in zip(keep, self.seqs) if not s.finished)
        self.ready_draft = next_draft if fuse and self.whole_last_round else None
        self.window = torch.full_like(self.window, self.mask_id)
        self.window[:, 0] = ar.gather(1, (keep_t - 1)[:, None]).squeeze(1)
        return events

    def _cut_at_eos(self, tokens: list[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t in self.eos:
                return tokens[: i + 1]
        return tokens

    def _step_diffusion(self):
        B = self.cfg.block_size
        masked = self.eligible & ~self.filled
        # the head runs only on columns some row still has masked; the others can't be chosen
        cols = masked.any(0).nonzero().squeeze(1)
        if cols.numel() == B:
            cols = None
        tokens, probs = self._sample(self._forward(self.window, B, B, cols))
        chosen = self.policy.select(probs, tokens, masked, self.steps_done, cols)
        if cols is not None:
            tokens = torch.full_like(self.targets, self.mask_id).index_copy_(1, cols, tokens)
        self.targets = torch.where(chosen, tokens, self.targets)
        self.fill_step = torch.where(chosen, self.steps_done[:, None], self.fill_step)
        self.filled |= chosen
        self.window[:, 1:] = torch.where(chosen[:, :-1], tokens[:, :-1], self.window[:, 1:])
        self.steps_done += 1
        if self.eos_t is not None:  # nothing after the first filled EOS is kept or filled
            eos = (self.filled & torch.isin(self.targets, self.eos_t)).long()
            self.eligible &= (eos.cumsum(1) - eos) == 0
        done = ~(self.eligible & ~self.filled).any(1)
        return self._finish_blocks(done) if bool(done.any()) else []

    # ---- postprocess ------------------------------------------------------------------------------
    def _finish_blocks(self, done: torch.Tensor):
        """Hand finished blocks to their sequences; rows that go on commit their window with the
        next forward (fused) and start a new block from their last target."""
        B = self.cfg.block_size
        rows = done.nonzero().squeeze(1).tolist()
        counts = self.eligible[done].sum(1).tolist()
        events = []
        for r, toks, steps, n in zip(rows, self.targets[done].tolist(), self.fill_step[done].tolist(), counts):
            seq = self.seqs[r]
            seq.append(toks[:n], steps[:n], self.eos)
            events.append((seq, toks[:n]))
        go_on = torch.tensor([r in rows and not s.finished for r, s in enumerate(self.seqs)], device=self.device)
        if bool(go_on.any()):
            self.pending = (self.window, None if bool(go_on.all()) else ~go_on[:, None].expand(-1, B))
            fresh = torch.full_like(self.window, self.mask_id)
            fresh[:, 0] = self.targets[:, -1]
            self.window = torch.where(go_on[:, None], fresh, self.window)
            self.filled &= ~go_on[:, None]
            self.steps_done = torch.where(go_on, 0, self.steps_done)
            self.eligible = torch.where(go_on[:, None], self._eligible(self.seqs), self.eligible)
        return events

    def _drop_finished(self) -> None:
        keep = [r for r, s in enumerate(self.seqs) if not s.finished]
        if len(keep) == len(self.seqs):
            return
        self.seqs = [self.seqs[r] for r in keep]
        if not keep:
            self.pending = self.cache = None  # nothing runs: free the cache
            return
        idx = torch.tensor(keep, device=self.device)
        self.cache.select_rows(idx)
        self.window = self.window[idx]
        if self.ready_draft is not None:
            self.ready_draft = self.ready_draft[idx]
        if self.policy:
            for name in ("filled", "targets", "fill_step", "steps_done", "eligible"):
                setattr(self, name, getattr(self, name)[idx])
        if self.pending is not None:
            clean, pad = self.pending
            pad = pad[idx] if pad is not None else None
            if pad is None or not bool(pad.all()):  # someone still commits
                self.pending = (clean[idx], pad if pad is not None and bool(pad.any()) else None)
            else:
                self.pending = None

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


def _stack_pending(a, rows_a: int, b, rows_b: int, device):
    """Pending clean segments of two row groups as one, left-padded to a common width."""
    parts = []
    for p, rows in ((a, rows_a), (b, rows_b)):
        ids, pad = p if p is not None else (torch.zeros(rows, 0, dtype=torch.long, device=device), None)
        parts.append((ids, pad if pad is not None else torch.zeros_like(ids, dtype=torch.bool)))
    width = max(ids.shape[1] for ids, _ in parts)
    ids = torch.cat([F.pad(i, (width - i.shape[1], 0)) for i, _ in parts])
    pad = torch.cat([F.pad(m, (width - m.shape[1], 0), value=True) for _, m in parts])
    if width == 0 or bool(pad.all()):
        return None
    return ids, pad if bool(pad.any()) else None
