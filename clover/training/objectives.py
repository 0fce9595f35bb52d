"""Training objectives: causal LM (`ar`) and vectorised block diffusion (`block_diffusion`).

Block diffusion, with the model's token shift (logits at column i predict token i+1):
* windows of `block` columns are anchored at the END of the row (the first may be partial);
* window k covers input columns [s, e) and owns the TARGETS s+1..e (the last column of the row has
  no target);
* one noise level t_k ~ U[t_min, t_max] per (row, window); each eligible target (loss mask 1) of
  window k is masked with probability t_k, or, in a `suffix_frac` share of windows, the window's last
  ~t_k fraction of targets is masked: the mid-block state of left-to-right filling, a known prefix
  and a masked rest (random masking mostly shows the model later tokens of the block as well);
* input column c of x_t holds <mask> iff its token is a masked target of c's own window, i.e. c is
  not the first column of its window (that one is the previous window's last target: always clean)
  and target c is masked; the window's last target (token e) never appears in its input;
* loss = sum over masked targets of CE / t_k, divided by the number of eligible targets
  (the per-token masked-diffusion ELBO estimate; with complementary masking the pair is averaged:
  each row is duplicated with the eligible-but-unmasked targets masked instead, weight 1/(1-t_k),
  and the sum is divided by twice the eligible count).
Block size 1 is the AR objective (every target always predicted, weight 1) and runs the AR path.

Confidence term (`conf_weight`, LLaDA2.0's confidence-aware parallel training): plus conf_weight x the
mean entropy of the predicted distribution over the masked targets the model already gets right
(argmax = target). The ELBO gives little incentive to push a right answer from p = 0.8 to 0.99, but
low_confidence decoding fills only what clears 0.95: sharpening right answers is what lets it fill
several tokens per step. Wrong predictions are left alone, so uncertainty stays where it is earned.
It is also dParallel's certainty forcing (arXiv 2509.26488: minimise the entropy where argmax = target).

Self-distillation (`distill_loss`, objective "distill", clover/training/distill.py): the same block
objective, with its confidence term, on the teacher's greedy `ar` output, plus `ar_weight` x the AR
loss of the same rows, so block size 1 keeps predicting what the teacher predicted, plus `ar_kl_weight` x
KL(teacher || student) of the next-token distributions at block size 1 on the same rows (the frozen
teacher's logits computed in the step): its whole distribution, not only its argmax, so block size 1
stays close to the model it started as, also on replayed rows and on tokens it was not greedy about.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from ..distributed.shard import Shard
from ..models.modeling_clover import window_ids


def ar_loss(model, ids: torch.Tensor, loss_mask: torch.Tensor, shard: Shard | None = None) -> tuple[torch.Tensor, int]:
    """Mean next-token CE over targets with loss_mask (targets = ids[:, 1:]). Returns (loss, count);
    with a `shard`, its share of the loss and the global count."""
    ce, _, n = ar_terms(model, ids, loss_mask, shard)
    return ce, n


def ar_terms(model, ids, loss_mask, shard: Shard | None = None, teacher=None):
    """(mean next-token CE, mean KL(teacher || model) or None, count) over the targets with loss_mask,
    from one forward of `model` at block size 1 (and one of the frozen `teacher`, when given, on the
    same rows). With a `shard`, its share of each mean and the global count."""
    n_all = int(loss_mask[:, 1:].sum())
    if shard is not None:
        ids, loss_mask = shard.take(ids), shard.take(loss_mask)
    logits = model(ids).logits
    # targets shifted left and padded (the last column has none) instead of slicing the logits: a
    # [B, L-1, V] slice would be copied to flatten it and its gradient zero-filled at full size
    tgt = F.pad(ids[:, 1:], (0, 1))
    m = F.pad(loss_mask[:, 1:], (0, 1))
    ce = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten(), reduction="none").view_as(tgt)
    kl = None
    if teacher is not None:
        with torch.no_grad():
            t_logits = teacher(ids).logits
        kl = kl_from_logits(logits, t_logits, m, n_all)
    return (ce * m).sum() / max(n_all, 1), kl, n_all


def kl_from_logits(logits, teacher_logits, mask, n):
    """sum over columns with `mask` of KL(softmax(teacher_logits) || softmax(logits)), divided by n:
    the teacher's whole next-token distribution as the target, not only its argmax."""
    log_s = logits.float().log_softmax(-1)
    log_t = teacher_logits.float().log_softmax(-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    return (kl * mask).sum() / max(n, 1)


def sample_noise(ids, loss_mask, block, t_min, t_max, mask_id, generator, complementary=False, suffix_frac=0.0):
    """Returns (x_t, target_masked, weight) for the vectorised objective.

    target_masked[b, c] says whether the target of column c (token c+1) is masked; weight[b, c] is
    its ELBO weight 1/t (0 where not masked). With `complementary` the batch doubles.
    """
    batch, length = ids.shape
    wid = window_ids(length, block, ids.device)
    nwin = int(wid[-1]) + 1
    t = t_min + (t_max - t_min) * torch.rand(batch, nwin, generator=generator, device=ids.device)
    t_col = t[:, wid]  # noise level of each column's window (targets belong to their column's window)
    eligible = torch.zeros_like(loss_mask)
    eligible[:, :-1] = loss_mask[:, 1:]
    u = torch.rand(batch, length, generator=generator, device=ids.device)
    if suffix_frac > 0:
        # u becomes a column's place in its window (0 first .. 1 last): "u < t" then masks the last
        # ~t fraction of the window's columns, i.e. a suffix
        size = torch.bincount(wid, minlength=nwin)
        start = torch.cumsum(size, 0) - size
        place = 1 - (torch.arange(length, device=ids.device) - start[wid] + 0.5) / size[wid]
        suffix = torch.rand(batch, nwin, generator=generator, device=ids.device) < suffix_frac
        u = torch.where(suffix[:, wid], place.expand(batch, -1), u)
    masked = (u < t_col) & eligible
    weight = masked / t_col
    if complementary:
        comp = eligible & ~masked
        masked = torch.cat([masked, comp])
        weight = torch.cat([weight, comp / (1 - t_col)])
        ids = torch.cat([ids, ids])
    # input column c is masked iff target of column c-1 is masked and c-1 is in c's window
    same = torch.zeros(length, dtype=torch.bool, device=ids.device)
    same[1:] = wid[1:] == wid[:-1]
    in_mask = torch.zeros_like(masked)
    in_mask[:, 1:] = masked[:, :-1] & same[1:]
    xt = ids.masked_fill(in_mask, mask_id)
    return xt, masked, weight


def diffusion_loss_from_logits(logits, ids, masked, weight, n_eligible, conf_weight=0.0, stats=None, shard=None):
    """The ELBO estimate, plus the confidence term when `conf_weight` > 0 (its mean entropy and the
    share of masked targets it covers go to `stats` when given). With a `shard` the inputs are its
    rows, `n_eligible` is global and the confidence term's count of right predictions is summed
    over the processes."""
    tgt = torch.zeros_like(ids)
    tgt[:, :-1] = ids[:, 1:]
    ce = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten(), reduction="none").view_as(tgt)
    elbo = (ce * weight).sum() / max(n_eligible, 1)
    if not conf_weight:
        return elbo
    logp = logits.float().log_softmax(-1)
    right = masked & (logp.argmax(-1) == tgt)
    entropy = -(logp.exp() * logp).sum(-1)
    n_right = int(right.sum()) if shard is None else int(shard.all_sum(int(right.sum())))
    conf = (entropy * right).sum() / max(n_right, 1)
    if stats is not None:
        n_masked = int(masked.sum()) if shard is None else int(shard.all_sum(int(masked.sum())))
        stats["conf_entropy"] = float(conf.detach()) if shard is None else shard.all_sum(float(conf.detach()))
        stats["right_share"] = n_right / max(n_masked, 1)
    return elbo + conf_weight * conf


def block_diffusion_loss(model, ids, loss_mask, block, t_min=0.1, t_max=1.0, generator=None,
                         complementary=False, suffix_frac=0.0, conf_weight=0.0, stats=None,
                         shard: Shard | None = None) -> tuple[torch.Tensor, int]:
    """Vectorised [x_t ; x_0] loss (see module docstring). Returns (loss, eligible targets)."""
    if block == 1:
        return ar_loss(model, ids, loss_mask, shard)
    mask_id = model.config.mask_token_id
    xt, masked, weight = sample_noise(ids, loss_mask, block, t_min, t_max, mask_id, generator, complementary,
                                      suffix_frac)
    x0 = torch.cat([ids, ids]) if complementary else ids
    n = int(loss_mask[:, 1:].sum()) * (2 if complementary else 1)
    if shard is not None:
        copies = 2 if complementary else 1
        x0, xt, masked, weight = (shard.take(t, copies) for t in (x0, xt, masked, weight))
    logits = model(x0, noisy_input_ids=xt, block_size=block).logits
    return diffusion_loss_from_logits(logits, x0, masked, weight, n, conf_weight, stats, shard), n


def distill_loss(model, ids, loss_mask, block, ar_weight=0.0, stats=None, teacher=None, kl_weight=0.0,
                 **bd) -> tuple[torch.Tensor, int]:
    """block_diffusion_loss (keywords `bd`: noise, confidence term) + ar_weight x ar_loss on the same
    rows + kl_weight x the KL from the frozen `teacher`'s next-token distribution at block size 1
    (both from one forward at block size 1); their parts go to `stats` as bd_loss / ar_loss / ar_kl.
    At block size 1 the block loss is the AR loss itself: it is counted once."""
    shard = bd.get("shard")
    use_kl = bool(kl_weight) and teacher is not None
    if block == 1:
        if not use_kl:
            return ar_loss(model, ids, loss_mask, shard)
        ce, kl, n = ar_terms(model, ids, loss_mask, shard, teacher)
        if stats is not None:
            stats["ar_loss"], stats["ar_kl"] = float(ce.detach()), float(kl.detach())
        return ce + kl_weight * kl, n
    loss, n = block_diffusion_loss(model, ids, loss_mask, block, stats=stats, **bd)
    if not (ar_weight or use_kl):
        return loss, n
    ce, kl, _ = ar_terms(model, ids, loss_mask, shard, teacher if use_kl else None)
    if stats is not None:
        stats["bd_loss"], stats["ar_loss"] = float(loss.detach()), float(ce.detach())
        if use_kl:
            stats["ar_kl"] = float(kl.detach())
    total = loss + ar_weight * ce
    return (total + kl_weight * kl if use_kl else total), n


def block_diffusion_loss_naive(model, ids, xt, masked, weight, block, n_eligible):
    """Reference: the same noise, one window at a time through the stream path (no cache)."""
    length = ids.shape[1]
    wid = window_ids(length, block, ids.device).tolist()
    parts, s = [], 0
    while s < length:
        e = s
        while e < length and wid[e] == wid[s]:
            e += 1
        inp = torch.cat([ids[:, :s], xt[:, s:e]], dim=1)
        parts.append(model(inp, block_size=block, draft_len=e - s, clean_block_size=block).logits[:, s:])
        s = e
    logits = torch.cat(parts, dim=1)
    return diffusion_loss_from_logits(logits, ids, masked, weight, n_eligible), logits


def self_spec_loss(model, ids, loss_mask, block, t_min=0.1, t_max=1.0, generator=None,
                   shard: Shard | None = None) -> tuple[torch.Tensor, int]:
    """Self-speculation samples (docs/architecture.md section 5): a prefix committed causally (clean block
    size 1, as `self_spec` decoding commits it) followed by ONE noisy window of `block` columns at a
    random place, noised by the same rules as `sample_noise`. Costs a forward over the prefix for one
    window's loss, so it is mixed in at a small rate (`self_spec_frac`)."""
    batch, length = ids.shape
    if length < block + 2:
        return ar_loss(model, ids, loss_mask, shard)
    s = int(torch.randint(1, length - block, (1,), generator=generator, device=ids.device))
    t = t_min + (t_max - t_min) * torch.rand(batch, 1, generator=generator, device=ids.device)
    eligible = loss_mask[:, s + 1 : s + block + 1]
    masked = (torch.rand(batch, block, generator=generator, device=ids.device) < t) & eligible
    window = ids[:, s : s + block].clone()
    window[:, 1:] = window[:, 1:].masked_fill(masked[:, :-1], model.config.mask_token_id)
    n = int(eligible.sum())
    if shard is not None:
        ids, window, masked, t = (shard.take(x) for x in (ids, window, masked, t))
    logits = model(torch.cat([ids[:, :s], window], dim=1), block_size=block, draft_len=block,
                   clean_block_size=1).logits[:, s:]
    tgt = ids[:, s + 1 : s + block + 1]
    ce = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten(), reduction="none").view_as(tgt)
    return (ce * masked / t).sum() / max(n, 1), n
