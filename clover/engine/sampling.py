"""Token choice for one forward's logits: greedy (temperature 0) or temperature / top-k / top-p sampling.

Returns the chosen tokens and the model's own distribution (softmax of the logits, the banned ids at 0),
because the fill policies score positions by it (probability, entropy, margin). The confidence is judged
before temperature, top-k and top-p reshape the draw, as LLaDA's published generate does:
a truncated distribution is one-hot at top_k=1 (every position would look certain and the threshold rule
would fill a whole block in one step), and a cold one grows just as sure. So top_k=1 (or top_p near 0)
decodes exactly what greedy decodes, in the same steps, and temperature -> 0 tends to greedy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..settings import SamplingParams  # noqa: F401 - re-exported (clover.engine)


def make_generator(params: SamplingParams, device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


@dataclass(frozen=True)
class Draw:
    """How a sampled structured reply chooses its tokens among those its grammar allows: `params` and
    one generator (seeded with the request's seed) that every token and every try of the reply draws from."""
    params: SamplingParams
    generator: torch.Generator

    @classmethod
    def of(cls, params: SamplingParams) -> Draw | None:
        """None for a greedy request."""
        return None if params.greedy else cls(params, make_generator(params, "cpu"))

    @classmethod
    def each(cls, params: SamplingParams, n: int) -> list[Draw | None]:
        """[None] for a greedy request (one reply, copied to its n choices); else a draw per choice, choice
        i seeded with seed + i (choice 0: the n = 1 reply of the same seed)."""
        if params.greedy:
            return [None]
        return [cls.of(params if params.seed is None else replace(params, seed=params.seed + i)) for i in range(n)]


def banned_ids(params: SamplingParams, mask_token_id: int, device) -> torch.Tensor:
    """The token ids `sample` never chooses (the mask token and `params.suppress`), sorted, as a tensor
    for ops/greedy_pick."""
    return torch.tensor(sorted({mask_token_id, *params.suppress}), dtype=torch.long, device=device)


def sample(logits: torch.Tensor, params: SamplingParams, mask_token_id: int,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (tokens [...], probs [..., V] fp32): the tokens drawn with `params`, and the
    model's distribution the policies score them by (module docstring). The mask token and
    `params.suppress` are never chosen (probability 0); greedy ties go to the lowest token id
    (torch.argmax returns the first maximum)."""
    logits = logits.to(torch.float32, copy=True)
    logits[..., mask_token_id] = float("-inf")
    if params.suppress:
        logits[..., list(params.suppress)] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    if params.greedy:
        return probs.argmax(-1), probs
    draw = draw_distribution(logits, params)
    tokens = torch.multinomial(draw.reshape(-1, draw.shape[-1]), 1, generator=generator).view(draw.shape[:-1])
    return tokens, probs


def draw_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] fp32 (the ids never chosen already -inf) -> the distribution a sampled token is drawn
    from: softmax of the logits over `params.temperature` (> 0), cut to the `top_k` likeliest and to the
    smallest set whose probability reaches `top_p` (the token that crosses it kept)."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)
