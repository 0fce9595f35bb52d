"""Grammar-constrained decoding in a public family's own block layout (SDAR, LLaDA2: no shift;
Fast-dLLM v2: shift; blocks at absolute positions, engine/layout.py): the grammar path of
structured output (response_format JSON, forced tool calls) for models whose windows are not laid
out as Clover's.

The windows are the family's: the prompt's whole blocks are prefilled, the first window holds the
prompt's last partial block and masks the rest, every later window is [MASK x B]. Each forward
fills a LEFT PREFIX of the block's masked columns: the first masked column always (at least one
token per forward), then each next column while its grammar-allowed choice is confident (its
probability among the tokens the grammar allows there >= the threshold), the grammar advanced by
every committed token before the next column's mask is made. This is the published `sequential`
remasking (left to right) with a grammar mask, sped up by the confident-prefix rule; every token
is accepted by the grammar as it is committed, so the reply is valid by construction. A finished
block is committed clean with the next forward (the row batch's pending segment), as the
families' own loops do.

The grammar is a row's `Constraint` (engine/constraint.py): `allow` masks a column's logits in place,
`accept` advances it, `pick` chooses (greedy, sampled with its generator, or a closer near the end
of the budget). `decode_blocks_task` is one job of the slot mode (engine/slots.py): it plans a
forward, takes its logits back; the scheduler batches it with other requests' jobs.
"""

from __future__ import annotations

import torch

from ..settings import DEFAULTS
from .batch import Forward, RowBatch
from .constraint import Constraint
from .layout import Layout
from .model_api import seam_of
from .runner import make_runner
from .sequence import sequences
from .slots import SlotJob


def family_defaults(model) -> tuple[int, float]:
    """(block size, threshold) the family publishes (its folder's), else the engine's defaults."""
    d = getattr(model, "decode_defaults", {}) or {}
    return int(d.get("block_size") or model.config.block_size), float(d.get("threshold") or DEFAULTS.threshold)


def decode_blocks_task(model, prompt: list[int], rule, threshold: float | None = None,
                       block_size: int | None = None):
    """`yield from` in a task: decode `rule`'s grammar after `prompt` in the model's block layout;
    returns (tokens without the stop token, complete, forwards) as `decode_constrained` does. The
    block size and threshold default to the family's published ones."""
    bs, th = family_defaults(model)
    block_size, threshold = block_size or bs, th if threshold is None else threshold

    def start(runner: str = "eager", defer: bool = False):
        seam = seam_of(model)
        layout = Layout.of(seam)
        seqs = sequences([prompt], [rule.max_new_tokens + 1], seam.context)
        batch = RowBatch.for_runner(make_runner(runner, model, defer=defer), block_size, block_size, seam.mask_id,
                                    model.device, DEFAULTS.prefill_chunk)
        batch.layout = layout
        batch.join(seqs, capacity=len(prompt) + rule.max_new_tokens + 2 * block_size)
        return batch, _steps(batch, rule, layout, block_size, threshold)

    return (yield SlotJob(start))


def _steps(batch: RowBatch, rule, layout: Layout, block_size: int, threshold: float):
    """The row's forwards, block after block: yields each Forward, fills the confident prefix of the
    block's masked columns from its logits; returns (tokens, complete, forwards)."""
    col = layout.fixed(batch.seqs[0].prompt_ids, block_size)  # the first column still masked
    while True:
        # with shift, column c is predicted by column c - 1: the block's first by the last clean column before it
        extra = 1 if layout.shift and batch.pending is not None else 0
        logits = yield Forward(batch.window, block_size, block_size + extra, block_size)
        rule.forwards += 1
        first = col - 1 + extra if layout.shift else col
        new, ended = fill_prefix(rule, logits[0, first: first + block_size - col], threshold)
        window = batch.window.clone()
        window[0, col: col + len(new)] = torch.tensor(new, dtype=window.dtype)
        batch.window, col = window, col + len(new)
        if ended:
            return rule.tokens, rule.complete, rule.forwards
        if col == block_size:  # the block is whole: committed clean with the next forward
            batch.commit_next((window, None), block_size)
            batch.window, col = torch.full_like(window, batch.mask_id), 0


def fill_prefix(rule, logits: torch.Tensor, threshold: float) -> tuple[list[int], bool]:
    """From the logits [m, V] of a block's masked columns, left to right: the tokens committed (the
    first column's always, each next one while confident) and whether the row ended (a stop token,
    the grammar's end or dead end, or the budget)."""
    new: list[int] = []
    for i in range(logits.shape[0]):
        row = logits[i: i + 1].float().clone()
        row[:, rule.mask] = float("-inf")
        rule.allow(row)
        t = rule.pick(row, rule.tokens, rule.max_new_tokens - len(rule.tokens))
        if not torch.isfinite(row[0, t]):
            return new, True  # the grammar allows nothing here
        if i > 0 and float(torch.softmax(row, -1)[0, t]) < threshold:
            return new, False
        ok = rule.accept(t)
        if t in rule.stops:
            rule.complete = True
            return new, True
        rule.tokens.append(t)
        new.append(t)
        rule.complete = not ok
        if not ok or len(rule.tokens) >= rule.max_new_tokens:
            return new, True
    return new, False


def choose_token_task(model, prompt: list[int], options: list[int], block_size: int | None = None):
    """`yield from` in a task: which of the single tokens `options` the model puts right after
    `prompt`, in its own layout (one forward, blocks of `block_size`, default the family's):
    (index of the option, forwards)."""
    rule = option_rule(model, options)
    tokens, _, forwards = yield from decode_blocks_task(model, prompt, rule, block_size=block_size)
    return options.index(tokens[0]), forwards


def option_rule(model, options: list[int], draw=None) -> Constraint:
    """One token among `options` as a `Constraint`: the likeliest, or drawn with `draw` (engine/sampling.Draw)."""
    allowed = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    allowed[options] = True

    def allow(logits: torch.Tensor) -> None:
        logits[:, ~allowed.to(logits.device)] = float("-inf")

    return Constraint(allow, lambda t: False, set(), draw and draw.generator, None, 0, 1, model.config.mask_token_id,
                      draw and draw.params)
