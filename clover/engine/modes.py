"""Decoding modes: how one step advances a `RowBatch` (engine/batch.py). Each mode holds only its
own typed per-row state, keeps it in row order when rows join (`join`) or leave (`select`). No mode
calls the model: `plan(batch)` says the forward it needs next (a `Forward`), `consume(batch, logits)`
takes that forward's logits and returns the (sequence, new tokens) events of a finished round, or
None while the round needs another forward (self_spec's draft before its verify). Whoever holds the
batch runs the forward (`RowBatch.run`: Engine.step, or the server's scheduler beside other jobs).

* `DiffusionMode` (`low_confidence`, `topk`, `entropy`, `margin`): the draft window is
  [last known token, MASK x (B-1)]; column j predicts target j; a fill policy (engine/policies.py)
  picks the targets each step fills. A finished block becomes clean and is committed *in the same
  forward* as the first step of the next block (clean_block_size = B).
  After the forward: each column's token and its score (greedy + a probability-scored policy: the
  token and its probability straight from the logits, ops/greedy_pick; entropy / margin: the
  distribution, `sample_and_score`; sampled: drawn for the head's columns), then the policy and the
  block bookkeeping as one pure function, `advance`; a compiled runner makes each pure function
  one graph (`runner.fuse`).
* `ARMode` (`ar`): greedy/sampled next-token decoding; the last token is committed as it is fed.
* `SelfSpecMode` (`self_spec`): prefix committed causally (clean_block_size = 1); each round
  drafts a block in one diffusion step, verifies it causally with the cache recording, keeps the
  agreeing prefix plus the AR correction and rolls the cache back to it. Lossless w.r.t. `ar`
  greedy. After a round that accepted whole blocks, the next draft rides along in the verify
  forward (one forward per round). `LookupSpecMode` (`self_spec` with `draft="lookup"`) drafts
  from the row's own context instead (engine/lookup.py): one forward per round, no draft forward.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from ..models.cache_clover import CloverCache, rolled_states
from ..models.family_seam import head_columns, spread
from ..ops.greedy_pick import greedy_pick
from .batch import Forward, RowBatch
from .layout import Layout
from .lookup import NgramIndex
from .policies import make_policy
from .sampling import banned_ids, sample
from .sequence import Sequence

Events = list[tuple[Sequence, list[int]]]


class Mode:
    """Shared by every mode: the block size, EOS ids and the sampler."""

    width = 1  # columns of the per-row window
    clean_block_size = 1  # clean window size of commits
    commits_window = False  # the window's columns are clean (committed by the forward that reads them)
    layout = Layout()  # where windows sit (engine/layout.py); make_mode sets the model's

    def __init__(self, cfg, mask_id: int, device, generator):
        self.cfg, self.block_size, self.mask_id, self.device = cfg, cfg.block_size, mask_id, device
        self.generator = generator
        self.eos = set(cfg.eos)
        self.banned = banned_ids(cfg.sampling, mask_id, device)  # never chosen, by `sample` or the greedy pick

    def sample(self, logits):
        return sample(logits, self.cfg.sampling, self.mask_id, self.generator)

    def _cut_at_eos(self, tokens: list[int]) -> list[int]:
        """`tokens` up to and including the first EOS."""
        for i, t in enumerate(tokens):
            if t in self.eos:
                return tokens[: i + 1]
        return tokens

    def tokens(self, logits):
        """The chosen token of each column: greedy straight from the logits (no distribution), else drawn."""
        if self.cfg.sampling.greedy:
            return greedy_pick(logits, self.banned)[0]
        return self.sample(logits)[0]

    def join(self, seqs: list[Sequence], first: bool) -> None:
        """New rows were appended to the batch (`first`: the batch was empty before)."""

    def select(self, idx: torch.Tensor) -> None:
        """Only rows `idx` go on (in that order)."""

    def block_view(self, row: int) -> list[tuple[int | None, int]]:
        return []

    def plan(self, batch: RowBatch) -> Forward:
        raise NotImplementedError

    def consume(self, batch: RowBatch, logits: torch.Tensor) -> Events | None:
        raise NotImplementedError

    def _append_each(self, batch: RowBatch, tokens: torch.Tensor) -> Events:
        """One AR step's token appended to each row."""
        events = []
        for seq, t in zip(batch.seqs, tokens.tolist()):
            seq.append([t], [0], self.eos)
            events.append((seq, [t]))
        return events


class TokenHook(Protocol):
    """What constrains `ar` (a grammar, engine/infill.Constraint): the next token of a row from its
    logits [1, V], and whether the row ends there (the token is None when it ends without one)."""

    def choose(self, logits: torch.Tensor, seq: Sequence) -> tuple[int | None, bool]: ...


class ARMode(Mode):
    commits_window = True

    def __init__(self, cfg, mask_id: int, device, generator, hook: TokenHook | None = None):
        super().__init__(cfg, mask_id, device, generator)
        self.hook = hook

    def plan(self, batch: RowBatch) -> Forward:
        return Forward(batch.window, 0, 1)

    def consume(self, batch: RowBatch, logits: torch.Tensor) -> Events:
        if self.hook is not None:
            return self._hooked(batch, logits[:, -1].float())
        tokens = self.tokens(logits[:, -1])
        batch.window = tokens[:, None]
        return self._append_each(batch, tokens)


    def _hooked(self, batch: RowBatch, logits: torch.Tensor) -> Events:
        """Each row's token as the hook chooses it; a row the hook ends finishes ("stop")."""
        events, window = [], batch.window.clone()
        for r, seq in enumerate(batch.seqs):
            t, done = self.hook.choose(logits[r: r + 1], seq)
            if t is not None:
                seq.append([t], [0], self.eos)
                window[r, 0] = t
            if done and not seq.finished:
                seq.finish("stop")
            events.append((seq, [] if t is None else [t]))
        batch.window = window
        return events


@dataclass
class SpecState:
    ready_draft: torch.Tensor | None = None  # the next block's draft, made by the last verify forward
    whole_last_round: bool = False  # every running row accepted its whole block last round
    draft: torch.Tensor | None = None  # this round's draft, once drafted (the verify forward comes next)
    fuse: bool = False  # the verify forward planned also drafts the next block


class SelfSpecMode(Mode):
    def __init__(self, cfg, mask_id: int, device, generator):
        super().__init__(cfg, mask_id, device, generator)
        self.width = cfg.block_size
        self.state = SpecState()
        self._rolled = None  # `rolled_states` as the runner calls it, made when first used

    def join(self, seqs: list[Sequence], first: bool) -> None:
        self.state.ready_draft = self.state.draft = None  # a draft made before covers the old rows only
        if first:
            self.state.whole_last_round = False

    def select(self, idx: torch.Tensor) -> None:
        if self.state.ready_draft is not None:
            self.state.ready_draft = self.state.ready_draft[idx]
        if self.state.draft is not None:
            self.state.draft = self.state.draft[idx]

    def plan(self, batch: RowBatch) -> Forward:
        """Draft (unless the last verify already drafted this block), then verify causally. When the
        last round accepted whole blocks, the next block's draft rides along in the verify forward,
        assuming this block is accepted whole too; it is used only if it was (otherwise the prefix
        it assumed has been rolled back)."""
        B, st, window = self.block_size, self.state, batch.window
        if st.draft is None and st.ready_draft is None:
            return Forward(window, B, B, B)  # the draft: draft[:, j] = guess for target j
        draft = st.draft = st.draft if st.draft is not None else st.ready_draft
        batch.cache.start_recording()
        verify_ids = torch.cat([window[:, :1], draft[:, :-1]], dim=1)
        st.fuse = st.ready_draft is not None or st.whole_last_round
        if st.fuse:
            next_window = torch.cat([draft[:, -1:], window[:, 1:]], dim=1)  # [d_B, MASK...]
            return Forward(torch.cat([verify_ids, next_window], dim=1), B, 2 * B, B)
        return Forward(verify_ids, 0, B)

    def consume(self, batch: RowBatch, logits: torch.Tensor) -> Events | None:
        st = self.state
        if st.draft is None and st.ready_draft is None:
            st.draft = self.tokens(logits)
            return None
        draft, fuse, st.draft = st.draft, st.fuse, None
        return self._verified(batch, draft, fuse, self.tokens(logits))

    def _verified(self, batch: RowBatch, draft: torch.Tensor, fuse: bool, tokens: torch.Tensor) -> Events:
        """Keep each row's agreeing prefix and its AR correction; roll the cache back to it."""
        B, st, window = self.block_size, self.state, batch.window
        ar, next_draft = tokens[:, :B], tokens[:, B:]  # ar[:, j] = greedy AR token for target j
        agree = (draft == ar).long().cumprod(1).sum(1)
        # the agreeing prefix equals ar[:, :agree]; ar[:, agree] is the correction (when agree < B)
        take = (agree + 1).clamp_max(B).tolist()
        events, keep = [], []
        for seq, row, n, a in zip(batch.seqs, ar.tolist(), take, agree.tolist()):
            out = self._cut_at_eos(row[: min(n, seq.remaining)])
            seq.append(out, [0 if j < a else 1 for j in range(len(out))], self.eos)  # step 1 = AR correction
            events.append((seq, out))
            keep.append(len(out))
        keep_t = torch.tensor(keep, device=self.device)
        self._rollback(batch, keep_t)  # keeps x_{n-1} and the accepted tokens but the last one
        st.whole_last_round = all(k == B for k, s in zip(keep, batch.seqs) if not s.finished)
        st.ready_draft = next_draft if fuse and st.whole_last_round else None
        batch.window = torch.full_like(window, self.mask_id)
        batch.window[:, 0] = ar.gather(1, (keep_t - 1)[:, None]).squeeze(1)
        return events


    def _rollback(self, batch: RowBatch, keep: torch.Tensor) -> None:
        """The cache back to `keep` tokens of the verified segment a row; a Clover cache's GDN states
        re-advanced by `rolled_states` as the runner calls it (compiled: one graph)."""
        if not isinstance(batch.cache, CloverCache):
            batch.cache.rollback(keep)
            return
        if self._rolled is None:
            self._rolled = batch.runner.fuse(rolled_states, ("rolled_states",))
        batch.cache.rollback(keep, states=self._rolled)


class LookupSpecMode(SelfSpecMode):
    """self_spec with drafts looked up in each row's own context (engine/lookup.py, `draft="lookup"`):
    a round is one verify forward of [last token, draft[:-1]] (no draft forward), or a plain AR step
    when no row's context has a suffix seen before (and while a prompt's last chunk waits to commit). Rows without a draft in a verifying batch get
    their last token repeated (rejected or not, they keep what `ar` makes)."""

    def __init__(self, cfg, mask_id: int, device, generator):
        super().__init__(cfg, mask_id, device, generator)
        self.index: list[NgramIndex] = []

    def join(self, seqs: list[Sequence], first: bool) -> None:
        super().join(seqs, first)
        new = [NgramIndex(s.prompt_ids) for s in seqs]
        self.index = new if first else self.index + new

    def select(self, idx: torch.Tensor) -> None:
        super().select(idx)
        self.index = [self.index[i] for i in idx.tolist()]

    def plan(self, batch: RowBatch) -> Forward:
        B, window = self.block_size, batch.window
        drafts = []
        for seq, ix in zip(batch.seqs, self.index):
            ix.extend(seq.token_ids[ix.generated:])
            drafts.append(ix.draft(B))
        # a prompt's last chunk still to commit (rows joined) rides with an AR step: a verify's rollback
        # counts only the columns it verifies
        if batch.pending is not None or all(d is None for d in drafts):
            self.state.draft = None
            return Forward(window[:, :1], 0, 1)  # an AR step
        rows = [d if d is not None else [ix.ctx[-1]] * B for d, ix in zip(drafts, self.index)]
        draft = self.state.draft = torch.tensor(rows, dtype=torch.long, device=self.device)
        batch.cache.start_recording()
        return Forward(torch.cat([window[:, :1], draft[:, :-1]], dim=1), 0, B)

    def consume(self, batch: RowBatch, logits: torch.Tensor) -> Events:
        draft, self.state.draft = self.state.draft, None
        if draft is not None:
            return self._verified(batch, draft, False, self.tokens(logits))
        tokens = self.tokens(logits[:, -1])
        events = self._append_each(batch, tokens)
        batch.window = torch.full_like(batch.window, self.mask_id)
        batch.window[:, 0] = tokens
        return events


class RowState:
    """A mode's per-row tensors (a dataclass of them, row-major): joined (`cat`) and selected
    (`take`) together, in the dataclass's field order."""

    def fields(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def cat(self, other):
        return type(self)(*(torch.cat([a, b]) for a, b in zip(self.fields(), other.fields())))

    def take(self, idx: torch.Tensor):
        return type(self)(*(t[idx] for t in self.fields()))


@dataclass
class BlockState(RowState):
    """Per row, the block being denoised: [rows, B] except `steps_done` [rows]."""

    filled: torch.Tensor  # target j is decided
    targets: torch.Tensor  # the decided tokens (meaningful where filled)
    fill_step: torch.Tensor  # the step of the block at which target j was filled
    steps_done: torch.Tensor  # steps taken in the current block
    eligible: torch.Tensor  # targets the block may fill (the budget; nothing after a filled EOS)


class DiffusionMode(Mode):
    def __init__(self, cfg, mask_id: int, device, generator):
        super().__init__(cfg, mask_id, device, generator)
        self.policy = make_policy(cfg.mode, cfg.block_size, cfg.threshold, cfg.steps)
        self.width = self.clean_block_size = cfg.block_size
        self.eos_t = torch.tensor(sorted(self.eos), dtype=torch.long, device=device)
        self.state: BlockState | None = None
        self.cols: torch.Tensor | None = None  # the head's columns of the forward planned last (None: all)
        self.commit_only = False  # the forward planned last commits the pending segment alone (no draft)
        self.awaiting: torch.Tensor | None = None  # [rows]: the window's first column comes from this forward's clean pass
        self.first_from_clean = False  # the forward planned last keeps its clean pass's last column first (awaiting rows)
        # `advance`, `sample_and_score`, `pick_and_advance` as the runner calls them (`fuse`), made when first used
        self._advance = self._scored = self._pick_advance = self._pick_sub = None

    def _eligible(self, seqs: list[Sequence], start: list[int] | None = None) -> torch.Tensor:
        """Targets a new block may fill: all B, or the remaining budget in a last partial block; from
        each row's `start` on (a first block's first target: Layout.first_target). With
        `commit_first`, never the last target (the next block's first column) and nothing while the
        row waits for its first column (start -1)."""
        remaining = torch.tensor([s.remaining for s in seqs], device=self.device)
        col = torch.arange(self.block_size, device=self.device)[None, :]
        if start is None:
            return col < remaining[:, None]
        begin = torch.tensor(start, device=self.device)[:, None]
        eligible = (col >= begin) & (col < begin + remaining[:, None])
        if self.layout.commit_first:
            eligible &= (col < self.block_size - 1) & (begin >= 0)
        return eligible

    def join(self, seqs: list[Sequence], first: bool) -> None:
        zeros = lambda dtype: torch.zeros(len(seqs), self.block_size, dtype=dtype, device=self.device)  # noqa: E731
        start = [self.layout.first_target(s.prompt_ids, self.block_size) for s in seqs] if self.layout.absolute else None
        new = BlockState(zeros(torch.bool), zeros(torch.long), zeros(torch.long),
                         torch.zeros(len(seqs), dtype=torch.long, device=self.device), self._eligible(seqs, start))
        self.state = new if first else self.state.cat(new)
        if self.layout.commit_first:
            waits = torch.tensor([b < 0 for b in start], device=self.device)
            self.awaiting = waits if first else torch.cat([self.awaiting, waits])

    def select(self, idx: torch.Tensor) -> None:
        self.state = self.state.take(idx)
        if self.awaiting is not None:
            self.awaiting = self.awaiting[idx]

    def block_view(self, row: int) -> list[tuple[int | None, int]]:
        st = self.state
        cols = st.eligible[row].nonzero().squeeze(1)
        filled, tokens, steps = (t[row, cols].tolist() for t in (st.filled, st.targets, st.fill_step))
        return [(t if f else None, s) for f, t, s in zip(filled, tokens, steps)]

    def plan(self, batch: RowBatch) -> Forward:
        B, st = self.block_size, self.state
        self.commit_only = self.first_from_clean = False
        sub_block = self.layout.sub_block if self.cfg.sampling.greedy else 0  # sampled: every masked column draws
        if self.awaiting is not None and bool(self.awaiting.any()):  # + the last clean column's logits
            self.cols = None
            if bool(self.awaiting.all()) and batch.pending is not None:  # nothing to draft yet: the clean pass alone
                self.commit_only = True
                return Forward(batch.window[:, :0], 0, 1, B)
            # a split step (RowBatch.split_commit) runs the window as a sub-block step of its own: its head on
            # the sub-block's columns (logits [rows, 1 + sub_block, V]); fused with the clean columns, every column's
            self.first_from_clean = True
            return Forward(batch.window, B, B + 1, B, sub_block_head=bool(sub_block))
        cols = None
        if not batch.runner.full_head and not sub_block:  # the head runs only on columns some row may fill this step
            cols = fillable(st.eligible, st.filled, sub_block).any(0).nonzero().squeeze(1)
            cols = None if cols.numel() == B else cols
        self.cols = cols
        # greedy without shift: only the masked targets' logits are read (the model may leave the others 0)
        masked_head = not self.layout.shift and self.cfg.sampling.greedy
        return Forward(batch.window, B, B, B, cols, sub_block_head=bool(sub_block) or masked_head)

    def consume(self, batch: RowBatch, logits: torch.Tensor) -> Events:
        if self.commit_only:  # every row waited: its window's first column, nothing drafted
            return self._first_columns(batch, self.awaiting, self.tokens(logits[:, -1:])[:, 0])
        waiting = None
        if self.first_from_clean:  # rows waiting for their first column: the clean pass's token
            waiting, first, logits = self.awaiting, self.tokens(logits[:, :1])[:, 0], logits[:, 1:]
        events = self._step(batch, logits)
        return events if waiting is None else events + self._first_columns(batch, waiting, first)

    def _first_columns(self, batch: RowBatch, waiting: torch.Tensor, first: torch.Tensor) -> Events:
        """Rows that waited get their window's first column (a token of theirs) and start filling."""
        events, tokens = [], first.tolist()
        for r in waiting.nonzero().squeeze(1).tolist():
            seq = batch.seqs[r]
            seq.append([tokens[r]], [0], self.eos)
            events.append((seq, [tokens[r]]))
        st = self.state
        batch.window = batch.window.clone()
        batch.window[:, 0] = torch.where(waiting, first, batch.window[:, 0])
        st.eligible = torch.where(waiting[:, None], self._eligible(batch.seqs, [0] * len(batch.seqs)), st.eligible)
        st.steps_done = torch.where(waiting, 0, st.steps_done)
        self.awaiting = self.awaiting & ~waiting
        return events

    def _step(self, batch: RowBatch, logits: torch.Tensor) -> Events:
        """`logits`: of every column [rows, B, V], of the columns `self.cols`, or (a step that asked
        for its head, `Forward.sub_block_head`, where the model computes only those) [rows, n, V] of
        each row's `head_columns` (a sub-block step's, or without shift its masked columns)."""
        st, runner, cols = self.state, batch.runner, self.cols
        compact = cols is None and logits.shape[1] != self.block_size
        if compact and self.cfg.sampling.greedy and self.policy.by_probability:
            if self._pick_sub is None:  # the greedy pick on the sub-block's columns, spread, and `advance` as one call
                self._pick_sub = runner.fuse(functools.partial(pick_sub_block_and_advance, self.policy, self.mask_id,
                                                               **self._window_args()),
                                             ("pick_sub_block", self.policy, self.layout, self.mask_id), shared=(1, 8))
            *fields, batch.window, done = self._pick_sub(logits, self.banned, *st.fields(), batch.window, self.eos_t)
        elif compact:  # a distribution-scored policy: the other columns' logits 0 (never chosen)
            cols = head_columns(batch.window, self.mask_id, logits.shape[1], **self._window_args())
            return self._step_scored(batch, spread(logits, cols, self.block_size), None)
        elif cols is None and self.cfg.sampling.greedy and self.policy.by_probability:
            if self._pick_advance is None:  # the greedy pick and `advance` as one call
                self._pick_advance = runner.fuse(functools.partial(pick_and_advance, self.policy, **self._window_args()),
                                                 ("pick_advance", self.policy, self.layout), shared=(1, 8))  # banned, eos_t
            *fields, batch.window, done = self._pick_advance(logits, self.banned, *st.fields(), batch.window, self.eos_t)
        else:
            return self._step_scored(batch, logits, cols)
        return self._advanced(batch, fields, done)

    def _step_scored(self, batch: RowBatch, logits: torch.Tensor, cols: torch.Tensor | None) -> Events:
        """`_step` through `_score` (sampled, or a distribution-scored policy) and `advance`."""
        tokens, score = self._score(batch.runner, logits, cols)
        if self._advance is None:
            self._advance = batch.runner.fuse(functools.partial(advance, self.policy, **self._window_args()),
                                              ("advance", self.policy, self.layout), shared=(8,))  # eos_t
        *fields, batch.window, done = self._advance(tokens, score, *self.state.fields(), batch.window, self.eos_t)
        return self._advanced(batch, fields, done)

    def _advanced(self, batch: RowBatch, fields: list, done: torch.Tensor) -> Events:
        self.state = BlockState(*fields)
        if self.awaiting is not None:
            done = done & ~self.awaiting  # nothing to fill yet: not a finished block
        return self._finish_blocks(batch, done) if bool(done.any()) else []

    def _window_args(self) -> dict:
        """`advance`'s layout arguments (engine/layout.py)."""
        return {"shift": self.layout.shift, "sub_block": self.layout.sub_block}

    def _score(self, runner, logits: torch.Tensor, cols: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each column's token and the policy's score of it, [rows, B], from the logits of the head's
        columns `cols` (None: all); the other columns get the mask token and score 0 (nobody has
        them masked: never chosen)."""
        sampling, st = self.cfg.sampling, self.state
        if sampling.greedy and self.policy.by_probability:  # the token's probability, no distribution
            tokens, score = greedy_pick(logits, self.banned)
        elif sampling.greedy:  # entropy / margin: the distribution, as one graph of a fixed layout
            if cols is not None:
                logits, cols = logits.new_zeros(*st.targets.shape, logits.shape[-1]).index_copy_(1, cols, logits), None
            if self._scored is None:
                self._scored = runner.fuse(functools.partial(sample_and_score, self.policy, sampling, self.mask_id),
                                           ("score", self.policy, sampling, self.mask_id))
            tokens, score = self._scored(logits)
        else:  # the generator draws for the head's columns only
            tokens, probs = self.sample(logits)
            score = self.policy.score(probs, tokens)
        if cols is not None:
            tokens = torch.full_like(st.targets, self.mask_id).index_copy_(1, cols, tokens)
            score = score.new_zeros(st.targets.shape).index_copy_(1, cols, score)
        return tokens, score

    def _finish_blocks(self, batch: RowBatch, done: torch.Tensor) -> Events:
        """Hand finished blocks to their sequences; rows that go on commit their window with the
        next forward (fused) and start a new block from their last target."""
        B, st = self.block_size, self.state
        # one host read: per row [done, eligible..., targets..., fill_step...]
        info = torch.cat([done[:, None], st.eligible, st.targets, st.fill_step], dim=1).tolist()
        events, go_on = [], []
        for seq, row in zip(batch.seqs, info):
            if row[0]:
                cols = [j for j in range(B) if row[1 + j]]
                tokens = [row[B + 1 + j] for j in cols]
                seq.append(tokens, [row[2 * B + 1 + j] for j in cols], self.eos)
                events.append((seq, tokens))
            go_on.append(bool(row[0]) and not seq.finished)
        if any(go_on):
            fresh = torch.full_like(batch.window, self.mask_id)
            start = None
            if self.layout.commit_first:  # the next window's first column waits for this block's clean pass
                start = [-1] * len(go_on)
            elif self.layout.shift:  # the block's last target is the next window's known column
                fresh[:, 0] = st.targets[:, -1]
            go = torch.tensor(go_on, device=self.device)
            if self.awaiting is not None:
                self.awaiting = self.awaiting | go
            if all(go_on):  # every row starts a new block (always, for one row that goes on)
                batch.pending, batch.window = (batch.window, None), fresh
                st.filled = torch.zeros_like(st.filled)
                st.steps_done = torch.zeros_like(st.steps_done)
                st.eligible = self._eligible(batch.seqs, start)
            else:
                batch.pending = (batch.window, ~go[:, None].expand(-1, B))
                batch.window = torch.where(go[:, None], fresh, batch.window)
                st.filled = st.filled & ~go[:, None]
                st.steps_done = torch.where(go, 0, st.steps_done)
                st.eligible = torch.where(go[:, None], self._eligible(batch.seqs, start), st.eligible)
        return events


def advance(policy, tokens, score, filled, targets, fill_step, steps_done, eligible, window, eos_t, shift=True,
            sub_block=0):
    """One denoising step after sampling, for every row at once: the policy chooses among the masked
    targets by the sampled tokens [R, B] and its scores of them [R, B] (`policy.score`); the chosen tokens
    are recorded and written into the window's next columns (`shift`; else into their own column:
    engine/layout.py); each row's block stops after its first
    filled EOS (`eos_t`: the EOS ids, possibly none). Returns the new BlockState fields, the window
    and which rows finished their block. Pure tensor code: no host sync, shapes fixed by the inputs."""
    masked = fillable(eligible, filled, sub_block)
    chosen = policy.choose(score, masked, steps_done, torch.isin(tokens, eos_t))
    targets = torch.where(chosen, tokens, targets)
    fill_step = torch.where(chosen, steps_done[:, None], fill_step)
    filled = filled | chosen
    if shift:
        window = torch.cat([window[:, :1], torch.where(chosen[:, :-1], tokens[:, :-1], window[:, 1:])], dim=1)
    else:
        window = torch.where(chosen, tokens, window)
    eos = (filled & torch.isin(targets, eos_t)).long()  # nothing after the first filled EOS is kept or filled
    eligible = eligible & ((eos.cumsum(1) - eos) == 0)
    done = ~(eligible & ~filled).any(1)
    return filled, targets, fill_step, steps_done + 1, eligible, window, done


def fillable(eligible, filled, sub_block=0):
    """The targets a step may fill [R, B]: eligible and still masked; with `sub_block`, only those of
    each row's first sub-block (of the window's columns: target j is column j + 1) with masks."""
    masked = eligible & ~filled
    if sub_block:
        group = (torch.arange(masked.shape[1], device=masked.device) + 1) // sub_block
        first = torch.where(masked, group, masked.shape[1]).min(1, keepdim=True).values
        masked = masked & (group == first)
    return masked


def pick_and_advance(policy, logits, banned, *state, shift=True, sub_block=0):
    """A greedy step of a probability-scored policy from the logits of every column [R, B, V]: each
    column's token and probability (ops/greedy_pick; `banned`: ids never chosen), then `advance`."""
    return advance(policy, *greedy_pick(logits, banned), *state, shift=shift, sub_block=sub_block)


def pick_sub_block_and_advance(policy, mask_id, logits, banned, *state, shift=True, sub_block=0):
    """`pick_and_advance` from the logits of a step's head columns alone [R, n, V], those
    `head_columns` of each row's window names (the state's sixth tensor; a sub-block step's, or
    without shift a masked-head step's): their tokens and probabilities go to those columns, the
    others get the mask token and 0 (not fillable: never chosen)."""
    window = state[5]
    cols = head_columns(window, mask_id, logits.shape[1], shift, sub_block)
    picked, prob = greedy_pick(logits, banned)
    tokens = torch.full_like(window, mask_id).scatter(1, cols, picked)
    score = prob.new_zeros(window.shape).scatter(1, cols, prob)
    return advance(policy, tokens, score, *state, shift=shift, sub_block=sub_block)


def sample_and_score(policy, sampling, mask_id, logits):
    """Greedy tokens of logits [R, B, V] and the policy's scores of them (from their distributions),
    pure, so a compiled runner makes it one graph (`runner.fuse`)."""
    tokens, probs = sample(logits, sampling, mask_id)
    return tokens, policy.score(probs, tokens)
