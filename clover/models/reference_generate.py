"""Each family's published generate algorithm, greedy (temperature 0), over Clover's model of it:
the baseline the engine is compared with (parity and speed). Written from the published code:

* `sdar_generate`: JetAstra/SDAR generate.py `block_diffusion_generate`: blocks at absolute
  positions, the full prompt blocks prefilled, each later block (the prompt's partial block first)
  denoised against the cache and committed clean once no mask is left; per step
  `low_confidence_dynamic` (every masked token above the threshold, at least the step's share of
  the block by confidence), `low_confidence_static` or `sequential`.
* `llada2_generate`: LLaDA2.0's `LLaDA2MoeModelLM.generate`: the same block layout, each step
  recomputing the whole prefix under the block mask (no cache, as published); tokens above the
  threshold, else the most confident ones. With `editing_threshold`, LLaDA2.1's editing decode
  (mask-to-token plus token-to-token edits, `max_post_steps`), as the block-refinement pipeline
  published for LLaDA2.1 runs it.
* `fast_dllm_generate`: Fast-dLLM v2's `generate` (no sub-block cache): blocks of 32 at absolute
  positions decoded in sub-blocks of 8 with the token shift; every masked token above the
  threshold plus the most confident one per step; a finished block is committed clean and its
  last logits give the next block's first token.

Greedy throughout, and the mask token is never predicted (see `_greedy`). Each returns
(ids [B, prompt + generated], forwards): the sequence as the published loop leaves it
and the model forwards it ran (tokens per forward = generated / forwards).
"""

from __future__ import annotations

import torch


def _greedy(logits, mask_id: int):
    """(argmax token, its probability); the mask token is never a prediction (a trained model does
    not predict it; a random one could, and the published loops would then never finish)."""
    logits = logits.float().clone()
    logits[..., mask_id] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    p, x = probs.max(dim=-1)
    return x, p


def transfer_counts(block: int, steps: int) -> list[int]:
    """Tokens to unmask per step: block // steps each, the remainder to the first steps."""
    base, extra = divmod(block, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


def _choose(strategy: str, conf, masked, count: int, threshold: float):
    """[B, L] bool: the positions one SDAR step unmasks."""
    pick = torch.zeros_like(masked)
    for j in range(conf.shape[0]):
        if strategy == "sequential":
            first = int(masked[j].nonzero()[0])
            pick[j, first:first + count] = True
        elif strategy == "low_confidence_dynamic" and int((conf[j] > threshold).sum()) >= count:
            pick[j] = conf[j] > threshold
        elif strategy in ("low_confidence_dynamic", "low_confidence_static"):
            pick[j, conf[j].topk(count).indices] = True
        else:
            raise ValueError(f"unknown remasking strategy {strategy!r}")
    return pick & masked


@torch.no_grad()
def sdar_generate(model, prompt, mask_id: int, gen_length: int, block_length: int = 4,
                  denoising_steps: int | None = None, threshold: float = 0.85,
                  strategy: str = "low_confidence_dynamic", stop_ids=()):
    steps = denoising_steps or block_length
    batch, plen = prompt.shape
    nblocks = -(-(plen + gen_length) // block_length)
    x = torch.full((batch, nblocks * block_length), mask_id, dtype=torch.long, device=prompt.device)
    x[:, :plen] = prompt
    cache, forwards = model.new_cache(batch, nblocks * block_length), 0
    first = plen // block_length
    if first:
        model(x[:, : first * block_length], cache=cache, commit=True, block_size=block_length)
        forwards += 1
    counts = transfer_counts(block_length, steps)
    for b in range(first, nblocks):
        cur = x[:, b * block_length:(b + 1) * block_length]
        for step in range(steps + 1):
            masked = cur == mask_id
            if not masked.any():
                model(cur, cache=cache, commit=True, block_size=block_length)
                forwards += 1
                break
            x0, p = _greedy(model(cur, cache=cache, block_size=block_length), mask_id)
            forwards += 1
            conf = torch.where(masked, p, float("-inf"))
            pick = _choose(strategy, conf, masked, counts[step], threshold)
            cur[pick] = x0[pick]
        if any((x[:, plen:] == s).any() for s in stop_ids):
            break
    return x, forwards


@torch.no_grad()
def llada2_generate(model, prompt, mask_id: int, gen_length: int, block_length: int = 32, steps: int = 32,
                    threshold: float = 0.95, eos_id: int | None = None, minimal_topk: int = 1,
                    editing_threshold: float | None = None, max_post_steps: int = 0):
    """LLaDA2.0's loop; with `editing_threshold`, LLaDA2.1's editing decode: every step also replaces
    an already decoded (not prompt) token of the block whose prediction differs from it with
    probability above `editing_threshold`, and after the block's last mask up to `max_post_steps`
    more forwards edit until one changes nothing."""
    steps = min(steps, gen_length // minimal_topk)
    editing = editing_threshold is not None and editing_threshold >= 0
    plen = prompt.shape[1]
    nblocks = -(-(plen + gen_length) // block_length)
    x = torch.full((1, nblocks * block_length), mask_id, dtype=torch.long, device=prompt.device)
    x[:, :plen] = prompt
    counts, forwards = transfer_counts(block_length, steps), 0
    for b in range(plen // block_length, nblocks):
        end, start = (b + 1) * block_length, b * block_length
        fixed = torch.arange(start, end, device=x.device)[None] < plen  # prompt columns: never edited
        step = post = 0
        while step < steps or (editing and post <= max_post_steps):
            active = x[:, start:end] == mask_id
            if not active.any():
                post += 1
                if not editing or post > max_post_steps:
                    break
            x0, p = _greedy(model(x[:, :end], block_size=block_length)[:, -block_length:], mask_id)
            forwards += 1
            pick = _fill_pick(active, p, counts[min(step, steps - 1)], threshold) if active.any() and step < steps \
                else torch.zeros_like(active)
            edit = (~active & ~fixed & (p > editing_threshold) & (x0 != x[:, start:end])) if editing \
                else torch.zeros_like(active)
            x[:, start:end][pick | edit] = x0[pick | edit]
            if not active.any() and not edit.any():
                break
            step += int(bool(active.any()))
        if eos_id is not None and (x[0, plen:end] == eos_id).any():
            break
    return x, forwards


def _fill_pick(active, p, count: int, threshold: float):
    """LLaDA2's mask-to-token rule: every masked token above the threshold if there are `count` of
    them, else the `count` most confident."""
    conf = torch.where(active, p, float("-inf"))[0]
    pick = torch.zeros_like(active)
    if int((conf > threshold).sum()) >= count:
        pick[0] = conf > threshold
    else:
        pick[0, conf.topk(min(count, int(active.sum()))).indices] = True
    return pick


@torch.no_grad()
def fast_dllm_generate(model, prompt, mask_id: int, max_new_tokens: int, block_size: int = 32,
                       small_block_size: int = 8, threshold: float = 0.9, stop_token: int | None = None):
    """Published loop; a prompt of exactly one block is prefilled like longer ones (the published
    code would leave it unseen)."""
    x, plen0 = prompt.clone(), prompt.shape[1]
    cache, forwards = model.new_cache(x.shape[0], plen0 + max_new_tokens + block_size), 0
    if x.shape[1] >= block_size:
        full = x.shape[1] // block_size * block_size
        logits = model(x[:, :full], cache=cache, commit=True, block_size=block_size)
        forwards += 1
        if x.shape[1] % block_size == 0:
            x = torch.cat([x, _greedy(logits[:, -1:], mask_id)[0]], dim=1)
    for _ in range(max_new_tokens // block_size):
        if _stopped(x, plen0, stop_token, mask_id, whole=True):
            break
        plen = x.shape[1]
        fill = torch.full((x.shape[0], block_size - plen % block_size), mask_id, dtype=torch.long, device=x.device)
        x = torch.cat([x, fill], dim=1)
        forwards += _fill_block(model, x, cache, plen, mask_id, block_size, small_block_size, threshold, stop_token)
        if not (x[:, -block_size:] == mask_id).any() and not _stopped(x, plen, stop_token, mask_id):
            logits = model(x[:, -block_size:], cache=cache, commit=True, block_size=block_size)
            forwards += 1
            x = torch.cat([x, _greedy(logits[:, -1:], mask_id)[0]], dim=1)
    return x, forwards


def _fill_block(model, x, cache, plen, mask_id, block, sub, threshold, stop_token) -> int:
    """Denoise the last block of x in place, sub-block by sub-block; returns the forwards run."""
    forwards = 0
    for s in range(0, block, sub):
        lo, hi = x.shape[1] - block + s, x.shape[1] - block + s + sub
        while (x[:, lo:hi] == mask_id).any() and not _stopped(x, plen, stop_token, mask_id):
            masked = x[:, -block:] == mask_id
            logits = model(x[:, -block:], cache=cache, block_size=block)
            forwards += 1
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)[:, s:s + sub]  # the token shift
            x1, p = _greedy(logits, mask_id)
            p = torch.where(masked[:, s:s + sub], p, float("-inf"))
            pick = p > threshold
            pick[torch.arange(x.shape[0]), p.argmax(-1)] = True
            pick &= masked[:, s:s + sub]
            x[:, lo:hi][pick] = x1[pick]
    return forwards


def _stopped(x, plen, stop_token, mask_id, whole: bool = False) -> bool:
    """The published stop test: the stop token is in the generated part and, unless `whole`, no
    row has a mask before the column of its first occurrence."""
    if stop_token is None:
        return False
    hits = (x[:, plen:] == stop_token).nonzero()
    if not len(hits):
        return False
    return whole or not (x[:, plen:plen + int(hits[0, 1])] == mask_id).any()


class TransformersBlockLM:
    """transformers' own Qwen3 / Qwen3-MoE / Qwen2 causal LM (the published SDAR and Fast-dLLM v2
    layouts) behind the calls the loops above make: `new_cache`, and a forward with the block mask
    as a 4D additive mask over its DynamicCache, a draft pass cropped off again. The published
    algorithm over transformers' model: the baseline Clover's engine is timed against. Rows of
    equal length only (no padding)."""

    def __init__(self, hf_model):
        self.hf = hf_model

    def new_cache(self, batch_size: int, capacity: int = 0):
        from transformers import DynamicCache

        return DynamicCache(config=self.hf.config)

    def __call__(self, ids, cache=None, commit=False, block_size: int = 4):
        done = cache.get_seq_length() if cache is not None else 0
        pos = torch.arange(done, done + ids.shape[1], device=ids.device)
        keys = torch.arange(done + ids.shape[1], device=ids.device)
        visible = (keys[None, :] // block_size <= pos[:, None] // block_size) | (keys[None, :] < done)
        mask = torch.zeros(visible.shape, dtype=self.hf.dtype, device=ids.device).masked_fill(~visible, float("-inf"))
        out = self.hf(input_ids=ids, attention_mask=mask[None, None].expand(ids.shape[0], 1, -1, -1),
                      position_ids=pos[None].expand(ids.shape[0], -1), cache=cache, use_cache=cache is not None)
        drop = 0 if commit is True else ids.shape[1] - (int(commit) if commit else 0)
        if cache is not None and drop:
            cache.crop(-drop)
        return out.logits
