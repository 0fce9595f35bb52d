"""Token choice for one forward's logits: greedy (temperature 0) or temperature / top-k / top-p sampling.

Returns the chosen tokens and the probability distribution they were drawn from, because the fill
policies score positions by that distribution (probability, entropy, margin).
"""

from __future__ import annotations

import torch

from ..settings import SamplingParams  # noqa: F401 - re-exported (clover.engine)


def make_generator(params: SamplingParams, device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


def banned_ids(params: SamplingParams, mask_token_id: int, device) -> torch.Tensor:
    """The token ids `sample` never chooses (the mask token and `params.suppress`), sorted, as a tensor
    for ops/greedy_pick."""
    return torch.tensor(sorted({mask_token_id, *params.suppress}), dtype=torch.long, device=device)


def sample(logits: torch.Tensor, params: SamplingParams, mask_token_id: int,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (tokens [...], probs [..., V] fp32). The mask token and `params.suppress` are
    never chosen (probability 0); greedy ties go to the lowest token id (torch.argmax returns the first maximum)."""
    logits = logits.to(torch.float32, copy=True)
    logits[..., mask_token_id] = float("-inf")
    if params.suppress:
        logits[..., list(params.suppress)] = float("-inf")
    if params.greedy:
        probs = torch.softmax(logits, dim=-1)
        return probs.argmax(-1), probs
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= params.top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    tokens = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).view(probs.shape[:-1])
    return tokens, probs
