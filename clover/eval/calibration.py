"""Calibrated commits (`clover bench calibration`): does a committed token's confidence mean what it says?

A `low_confidence` forward at threshold t commits every masked position whose top probability clears t
(at least one). Among the tokens committed in parallel (more than one in that forward: the same
(block, step) in the trajectory), the share that differ from `ar`'s choice should be at most 1 - t.
`ar`'s choice is the greedy token the model gives at block size 1 after the same prefix (one causal
forward over the prompt and the committed tokens: what `self_spec` would accept). Also reported: the
share that differ from the `ar` output at the same position (position-wise against a separate `ar`
decode, only where it has a token), which also counts a token right after an earlier divergence as wrong.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..settings import DEFAULTS
from .generation import generate_until


def committed_in_parallel(trajectory) -> list[bool]:
    """Per token: was it committed in a forward that committed more than one (same (block, step))?"""
    count = Counter(map(tuple, trajectory))
    return [count[tuple(t)] > 1 for t in trajectory]


@torch.no_grad()
def ar_choices(model, prompt_ids: list[int], token_ids: list[int]) -> list[int]:
    """The greedy block-size-1 token at each position of `token_ids`, given the prompt and the tokens
    before it (one causal forward)."""
    ids = torch.tensor([prompt_ids + token_ids[:-1]], device=model.device)
    logits = model(ids).logits[0, len(prompt_ids) - 1:]
    return logits.argmax(-1).tolist()


def _decode(model, tokenizer, exs, mode, block_size, threshold, batch, eos):
    seqs = []
    for s in range(0, len(exs), batch):
        chunk = exs[s:s + batch]
        seqs += generate_until(model, tokenizer, [e["prompt"] + "\n" for e in chunk], [e["budget"] for e in chunk],
                               ["\n"], mode, block_size, threshold, eos_token_ids=eos)[1]
    return seqs


def calibration(model, tokenizer, exs: list[dict], block_size: int, thresholds, batch: int = 64, eos=()) -> list[dict]:
    """One row per threshold: tokens, tokens committed in parallel, the share of those that differ from
    ar's choice (`error_rate`, the calibration figure, against `bound` = 1 - t) and from the ar output."""
    ar = _decode(model, tokenizer, exs, "ar", 1, DEFAULTS.threshold, batch, eos)
    rows = []
    for t in thresholds:
        seqs = _decode(model, tokenizer, exs, "low_confidence", block_size, t, batch, eos)
        n = par = wrong = vs_out = vs_out_n = forwards = 0
        for seq, ref in zip(seqs, ar):
            flags = committed_in_parallel(seq.trajectory)
            choice = ar_choices(model, seq.prompt_ids, seq.token_ids) if any(flags) else []
            for i, (tok, p) in enumerate(zip(seq.token_ids, flags)):
                if not p:
                    continue
                par += 1
                wrong += tok != choice[i]
                if i < len(ref.token_ids):
                    vs_out_n += 1
                    vs_out += tok != ref.token_ids[i]
            n += len(seq.token_ids)
            forwards += seq.forward_passes
        rate = wrong / par if par else 0.0
        rows.append({"threshold": t, "block_size": block_size, "tokens": n, "parallel": par,
                     "parallel_share": par / max(n, 1), "error_rate": rate, "bound": 1 - t,
                     "calibrated": rate <= 1 - t + 1e-12, "error_rate_vs_ar_output": vs_out / vs_out_n if vs_out_n else 0.0,
                     "tpf": n / max(forwards, 1)})
    return rows
