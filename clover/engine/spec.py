"""Self-speculative decoding (`self_spec`): lossless w.r.t. greedy `ar`. Each round verifies a row's
guesses for its next tokens causally (the cache recording), keeps the agreeing prefix plus the AR
token after it and rolls the cache back to what it kept (engine/modes.py explains plan / consume).

* `SelfSpecMode` (the model drafts): a round is one forward of 2B columns, [last, g_0..g_{B-2}] clean
  and recorded, then a window of B masks. The clean columns' logits are greedy `ar` for targets
  0..B-1: the B-1 guesses checked and one token more (the last column's: a row that accepts every
  guess takes B tokens, a row with no guesses still takes one). The mask window right after them
  drafts the row's next guesses (targets B.., from the prefix through g_{B-2}), assuming every guess
  is accepted: used only if it was. A row whose guesses were rejected, or that just joined, verifies
  no guess next round (its guess columns are padding): it takes the one `ar` token and gets a fresh
  draft; the first round of a prompt is such a round, its last prefill chunk riding along. A row
  whose round held fewer than half its guesses falls back to a draft alone then a verify alone
  (until one holds half): where drafts keep failing (free text), a round's draft window costs more
  than its one token. Each row's steps depend on its own tokens only; a forward is a draft alone or
  a verify alone when every row's step is. (2B columns: a clean block of B is a steady compiled
  shape for B a power of two, and 2B fits a compiled forward's 64 columns up to B = 32.)
* `LookupSpecMode` (`draft="lookup"`): guesses looked up in the row's own context (engine/lookup.py):
  one verify forward a round, no draft, or a plain AR step when no row has a draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.cache_clover import CloverCache, rolled_states
from .batch import Forward, Pending, RowBatch
from .lookup import NgramIndex
from .modes import Events, Mode
from .sequence import Sequence


class SpecBase(Mode):
    """What both drafters share: taking a verified prefix and rolling the cache back to it."""

    def __init__(self, cfg, mask_id: int, device, generator):
        super().__init__(cfg, mask_id, device, generator)
        self._rolled = None  # `rolled_states` as the runner calls it, made when first used

    def _accept(self, batch: RowBatch, ar: torch.Tensor, agree: list[int], take: list[int],
                committed: torch.Tensor | None = None) -> Events:
        """Each row takes `ar[r, :take[r]]` (greedy `ar` tokens from its first target on; the first
        `agree[r]` of them were guessed), cut at an EOS and its budget; the cache keeps the prompt
        tokens the forward `committed` [rows] first, then the row's last token and what it took but
        the last one, which becomes the window's first column."""
        events, keep = [], []
        for seq, row, n, a in zip(batch.seqs, ar.tolist(), take, agree):
            out = self._cut_at_eos(row[: min(n, seq.remaining)])
            if out:  # a row that only drafted takes nothing
                seq.append(out, [0 if j < a else 1 for j in range(len(out))], self.eos)  # step 1: not guessed
                events.append((seq, out))
            keep.append(len(out))
        keep_t = torch.tensor(keep, device=self.device)
        last = torch.where(keep_t > 0, ar.gather(1, (keep_t - 1).clamp_min(0)[:, None]).squeeze(1), batch.window[:, 0])
        self._rollback(batch, keep_t if committed is None else keep_t + committed)
        batch.window = torch.full_like(batch.window, self.mask_id)
        batch.window[:, 0] = last
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


DRAFT, VERIFY, ROUND = 0, 1, 2  # what a row does in its next forward (`SpecState.step`)


@dataclass
class SpecState:
    guess: torch.Tensor  # [rows, B]: each row's guesses for its next targets (the first B-1 are verified)
    count: torch.Tensor  # [rows]: guesses the row verifies next, B-1 or 0 (-1: none, not even its last token)
    step: list[int]  # per row: DRAFT (a draft alone), VERIFY (a verify alone) or ROUND (verify + draft)
    committed: torch.Tensor | None = None  # [rows]: prompt tokens the planned forward commits first (None: none)
    kind: int = ROUND  # the planned forward: DRAFT or VERIFY when every row does that, else ROUND


class SelfSpecMode(SpecBase):
    def __init__(self, cfg, mask_id: int, device, generator):
        super().__init__(cfg, mask_id, device, generator)
        self.width = 2 * cfg.block_size  # the columns of a round (the batch reserves them)
        self.state: SpecState | None = None

    def join(self, seqs: list[Sequence], first: bool) -> None:
        new = SpecState(torch.full((len(seqs), self.block_size), self.mask_id, dtype=torch.long, device=self.device),
                        torch.zeros(len(seqs), dtype=torch.long, device=self.device), [ROUND] * len(seqs))
        if not first:
            old = self.state
            new = SpecState(torch.cat([old.guess, new.guess]), torch.cat([old.count, new.count]), old.step + new.step)
        self.state = new

    def select(self, idx: torch.Tensor) -> None:
        st = self.state
        st.guess, st.count, st.step = st.guess[idx], st.count[idx], [st.step[i] for i in idx.tolist()]

    def plan(self, batch: RowBatch) -> Forward:
        """Per row: a round ([last, g_0..g_{B-2}] recorded, or [padding x (B-1), last] with no guesses,
        after its prompt's last chunk when it just joined; then B masks drafting its next guesses), or
        while its drafts fail (`_next_steps`) the pair a draft alone ([last, MASK...], its verify
        columns padding), then a verify alone (its draft columns unused). A forward is a draft alone
        or a verify alone when every row's is (cheaper: no draft window, or no recorded columns)."""
        B, st, window = self.block_size, self.state, batch.window[:, :self.block_size]
        st.kind = st.step[0] if len(set(st.step)) == 1 and batch.pending is None else ROUND
        if st.kind == DRAFT:
            return Forward(window, B, B, B)  # tokens[:, j] = guess for target j
        verify = torch.cat([window[:, :1], st.guess[:, :-1]], dim=1)
        batch.cache.start_recording()
        if batch.pending is None and bool((st.count == B - 1).all()):
            batch.pending, st.committed = (verify, None), None
        else:
            batch.pending, st.committed = spec_segment(batch.pending, verify, st.count)
        width = min(B, batch.pending[0].shape[1])
        if st.kind == VERIFY:
            return Forward(verify[:, :0], 0, width)
        drafts = torch.tensor([s == DRAFT for s in st.step], device=self.device)[:, None]
        masks = torch.where(drafts, window, torch.full_like(window, self.mask_id))
        return Forward(masks, B, B + width, B)

    def consume(self, batch: RowBatch, logits: torch.Tensor) -> Events | None:
        B, st = self.block_size, self.state
        tokens = self.tokens(logits)
        if st.kind == DRAFT:
            st.guess, st.count, st.step = tokens, torch.full_like(st.count, B - 1), [VERIFY] * len(st.step)
            return None
        verified = tokens if st.kind == VERIFY else tokens[:, :-B]
        # the verify columns are right-aligned: a row with k guesses has its targets 0..k at columns B-1-k..B-1
        # (of B: a segment narrower than B is as if left-padded)
        verified = F.pad(verified, (B - verified.shape[1], 0))
        cols = torch.arange(B, device=self.device)[None, :]
        ar = verified.gather(1, (B - 1 - st.count[:, None] + cols).clamp(0, B - 1))
        hit = (st.guess[:, :-1] == ar[:, :-1]) & (cols[:, :-1] < st.count[:, None])
        agree = hit.long().cumprod(1).sum(1)
        agree_l, count_l = agree.tolist(), st.count.tolist()
        take = [a + 1 if k >= 0 else 0 for a, k in zip(agree_l, count_l)]
        events = self._accept(batch, ar, agree_l, take, st.committed)
        if st.kind == ROUND:  # the drafted guesses (used by the rows whose next step says so)
            st.guess = tokens[:, -B:]
        st.step, counts = self._next_steps(agree_l, count_l)
        st.count = torch.tensor(counts, device=self.device)
        return events

    def _next_steps(self, agree: list[int], count: list[int]) -> tuple[list[int], list[int]]:
        """Each row's next step and guess count: after a round whose guesses all held, a round on the
        guesses drafted in it; after a draft, its verify; after a verify or round that held at least
        half its guesses, a round with no guesses (one `ar` token and a fresh draft), else a draft
        alone (drafts that keep failing: a round's draft window would cost more than its token)."""
        B, steps, counts = self.block_size, [], []
        for step, a, k in zip(self.state.step, agree, count):
            if k < 0 or (step == ROUND and a == k):  # a draft's guesses, or the guesses drafted with them
                steps.append(VERIFY if k < 0 else ROUND)
                counts.append(B - 1)
            else:
                steps.append(ROUND if 2 * a >= k else DRAFT)
                counts.append(0 if 2 * a >= k else -1)
        return steps, counts


def spec_segment(pending: Pending | None, verify: torch.Tensor, count: torch.Tensor) -> tuple[Pending, torch.Tensor]:
    """The clean segment of a round: per row its prompt's last chunk (`pending`: ids, left padding;
    None: nothing), then its last token and its first `count[r]` guesses (`verify`: [rows, B]), left-
    padded as one (less the columns every row pads). Returns the segment and the real prompt tokens in
    it per row."""
    rows, width = verify.shape
    cols = torch.arange(width, device=verify.device)[None, :]
    skip = width - 1 - count[:, None]  # guess columns a row does not verify
    ids = verify.gather(1, (cols - skip).clamp_min(0))  # right-aligned: [.., last, g_0..g_{count-1}]
    pad = cols < skip
    committed = torch.zeros(rows, dtype=torch.long, device=verify.device)
    if pending is not None:
        p_ids, p_pad = pending
        p_pad = p_pad if p_pad is not None else torch.zeros_like(p_ids, dtype=torch.bool)
        ids, pad = torch.cat([p_ids, ids], dim=1), torch.cat([p_pad, pad], dim=1)
        order = torch.sort((~pad).long(), dim=1, stable=True).indices  # padding first, real columns in order
        ids, pad, committed = ids.gather(1, order), pad.gather(1, order), (~p_pad).sum(1)
    lead = int(pad.all(0).long().cumprod(0).sum())  # columns that are padding in every row: not run
    pad = pad[:, lead:]
    return (ids[:, lead:], pad if bool(pad.any()) else None), committed


class LookupSpecMode(SpecBase):
    """self_spec with drafts looked up in each row's own context (engine/lookup.py, `draft="lookup"`):
    a round is one verify forward of [last token, draft[:-1]] (no draft forward), or a plain AR step
    when no row's context has a suffix seen before (and while a prompt's last chunk waits to commit).
    Rows without a draft in a verifying batch get their last token repeated (rejected or not, they
    keep what `ar` makes)."""

    def __init__(self, cfg, mask_id: int, device, generator):
        super().__init__(cfg, mask_id, device, generator)
        self.width = cfg.block_size
        self.index: list[NgramIndex] = []
        self.draft: torch.Tensor | None = None  # the drafts the planned forward verifies (None: an AR step)

    def join(self, seqs: list[Sequence], first: bool) -> None:
        new = [NgramIndex(s.prompt_ids) for s in seqs]
        self.index = new if first else self.index + new

    def select(self, idx: torch.Tensor) -> None:
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
            self.draft = None
            return Forward(window[:, :1], 0, 1)  # an AR step
        rows = [d if d is not None else [ix.ctx[-1]] * B for d, ix in zip(drafts, self.index)]
        self.draft = torch.tensor(rows, dtype=torch.long, device=self.device)
        batch.cache.start_recording()
        return Forward(torch.cat([window[:, :1], self.draft[:, :-1]], dim=1), 0, B)

    def consume(self, batch: RowBatch, logits: torch.Tensor) -> Events:
        draft, self.draft = self.draft, None
        if draft is not None:
            ar = self.tokens(logits)
            agree = (draft == ar).long().cumprod(1).sum(1).tolist()
            return self._accept(batch, ar, agree, [min(a + 1, self.block_size) for a in agree])
        tokens = self.tokens(logits[:, -1])
        events = self._append_each(batch, tokens)
        batch.window = torch.full_like(batch.window, self.mask_id)
        batch.window[:, 0] = tokens
        return events
