"""LLaDA2.1's editing decode as an engine mode (`editing`): mask-to-token filling by the
low_confidence rule plus token-to-token edits, in the families' no-shift, absolute-block layout
(engine/layout.py: column j of the window predicts itself).

Each forward over the block's window [prompt tail or nothing, decoded tokens, masks]:
* fill: the masked columns the low_confidence rule picks (every one above `threshold`, else the
  most confident one);
* edit: every already-decoded, non-prompt column whose prediction differs from its token with
  probability above `edit_threshold` takes the prediction;
* once the block has no mask left, up to `max_post_steps` more forwards only edit; the block is
  finished by the first of them that changes nothing (or the last allowed one). With
  `max_post_steps` 0 a block ends with its last mask filled.
A finished block is cut after its first EOS, handed to its sequence and committed clean with the
next forward (the row batch's pending segment), as DiffusionMode does.

`clover.models.reference_generate.llada2_generate(..., editing_threshold=, max_post_steps=)` is
the published algorithm as a naive loop (the whole prefix recomputed every forward);
tests/test_editing_mode.py checks that this mode gives its tokens in its number of forwards.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..ops.greedy_pick import greedy_pick
from .batch import Forward, RowBatch
from .layout import Layout
from .modes import Events, Mode, RowState
from .policies import make_policy
from .sequence import Sequence


@dataclass
class EditState(RowState):
    """Per row, the block being decoded: [rows, B] except the step counters [rows]."""

    eligible: torch.Tensor  # columns the block decodes and may edit (not the prompt's, within the budget)
    fill_step: torch.Tensor  # the forward of the block that last wrote column j
    steps_done: torch.Tensor  # forwards of the block that had a mask to fill
    post: torch.Tensor  # forwards of the block after its last mask (edits only)


class EditingMode(Mode):
    def __init__(self, cfg, mask_id: int, device, generator, layout: Layout):
        assert not layout.shift and layout.absolute, "Layout.of refuses editing on this layout"
        super().__init__(cfg, mask_id, device, generator)
        self.layout = layout
        self.policy = make_policy("low_confidence", cfg.block_size, cfg.threshold)
        self.width = self.clean_block_size = cfg.block_size
        self.state: EditState | None = None
        self._step = None  # `edit_step` as the runner calls it (`fuse`), made when first used
        self._window_tokens: torch.Tensor | None = None  # the window as last seen (for block_view)

    def _new(self, seqs: list[Sequence], start: list[int]) -> EditState:
        """A new block per row: columns from `start` (the prompt's tail before) within its budget."""
        col = torch.arange(self.block_size, device=self.device)[None, :]
        begin = torch.tensor(start, device=self.device)[:, None]
        remaining = torch.tensor([s.remaining for s in seqs], device=self.device)[:, None]
        zeros = torch.zeros(len(seqs), dtype=torch.long, device=self.device)
        return EditState((col >= begin) & (col < begin + remaining), torch.zeros_like(col.expand(len(seqs), -1)),
                         zeros, zeros.clone())

    def join(self, seqs: list[Sequence], first: bool) -> None:
        new = self._new(seqs, [self.layout.first_target(s.prompt_ids, self.block_size) for s in seqs])
        self.state = new if first else self.state.cat(new)

    def select(self, idx: torch.Tensor) -> None:
        self.state = self.state.take(idx)

    def block_view(self, row: int) -> list[tuple[int | None, int]]:
        cols = self.state.eligible[row].nonzero().squeeze(1)
        window = self._window_tokens[row, cols].tolist() if self._window_tokens is not None else []
        return [(None if t == self.mask_id else t, s) for t, s in zip(window, self.state.fill_step[row, cols].tolist())]

    def plan(self, batch: RowBatch) -> Forward:
        self._window_tokens = batch.window
        return Forward(batch.window, self.block_size, self.block_size, self.block_size)

    def consume(self, batch: RowBatch, logits: torch.Tensor) -> Events:
        if self.cfg.sampling.greedy:
            tokens, prob = greedy_pick(logits, self.banned)
        else:
            tokens, probs = self.sample(logits)
            prob = probs.gather(-1, tokens[..., None]).squeeze(-1)
        if self._step is None:
            self._step = batch.runner.fuse(
                functools.partial(edit_step, self.policy, self.cfg.edit_threshold, self.cfg.max_post_steps,
                                  self.mask_id), ("edit", self.policy, self.cfg.edit_threshold, self.cfg.max_post_steps))
        st = self.state
        batch.window, fill_step, steps_done, post, done = self._step(tokens, prob, batch.window, *st.fields())
        self.state = EditState(st.eligible, fill_step, steps_done, post)
        self._window_tokens = batch.window
        return self._finish_blocks(batch, done) if bool(done.any()) else []

    def _finish_blocks(self, batch: RowBatch, done: torch.Tensor) -> Events:
        """Hand finished blocks (cut after their first EOS) to their sequences; rows that go on
        commit their window with the next forward and start a block of masks."""
        B, st = self.block_size, self.state
        info = torch.cat([done[:, None], st.eligible, batch.window, st.fill_step], dim=1).tolist()  # one host read
        events, go_on = [], []
        for seq, row in zip(batch.seqs, info):
            if row[0]:
                cols = [j for j in range(B) if row[1 + j]]
                tokens = self._cut_at_eos([row[B + 1 + j] for j in cols])
                seq.append(tokens, [row[2 * B + 1 + j] for j in cols][: len(tokens)], self.eos)
                events.append((seq, tokens))
            go_on.append(bool(row[0]) and not seq.finished)
        if any(go_on):
            go = torch.tensor(go_on, device=self.device)
            batch.pending = (batch.window, None if all(go_on) else ~go[:, None].expand(-1, B))
            batch.window = torch.where(go[:, None], torch.full_like(batch.window, self.mask_id), batch.window)
            fresh = self._new(batch.seqs, [0] * len(go_on))
            self.state = EditState(*(torch.where(go[:, None] if a.dim() == 2 else go, a, b)
                                     for a, b in zip(fresh.fields(), st.fields())))
        return events


def edit_step(policy, edit_threshold: float, max_post_steps: int, mask_id: int, tokens, prob, window, eligible,
              fill_step, steps_done, post):
    """One forward's fills and edits for every row at once, from each column's predicted token and
    its probability [R, B]. Returns the window, the step counters and which rows finished their
    block. Pure tensor code (no host sync, shapes fixed by the inputs)."""
    masked = eligible & (window == mask_id)
    had = masked.any(1)
    fill = policy.choose(prob, masked, steps_done)
    edit = eligible & ~masked & (prob > edit_threshold) & (tokens != window)
    write = fill | edit
    window = torch.where(write, tokens, window)
    fill_step = torch.where(write, (steps_done + post)[:, None], fill_step)
    post = post + (~had).long()
    left = (eligible & (window == mask_id)).any(1)
    done = ~left & ((had & (max_post_steps == 0)) | (~had & (~edit.any(1) | (post >= max_post_steps))))
    return window, fill_step, steps_done + had.long(), post, done
