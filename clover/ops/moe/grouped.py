"""Fast expert dispatch: no loop over tokens, no per-pair copies of expert weights.

One token (a decode step): its k experts are k matmul pairs on views of the weight tensors.
Several tokens (block steps, prefill, training): the (token, expert) pairs are sorted by expert and
torch's grouped GEMM runs every expert on its own contiguous rows (no padding). Training goes
through `_GroupedMM`, whose backward is grouped GEMM for the input gradient and one matmul per
expert for the weight gradient (torch's CPU grouped GEMM has no backward). Where torch lacks grouped
GEMM or rejects the layout (it wants 16-byte aligned rows), the rows are laid into a zero-padded
[E, max_group, H] buffer and all experts run as two batched matmuls. Results are scattered back
with the routing weights, without one small matmul pair per expert.
"""

import torch
import torch.nn.functional as F

from ..utils import cast


def grouped_experts(x, top_idx, top_w, gate_up, down):
    top_w = cast(top_w, x.dtype)
    inter = down.shape[-1]
    if x.shape[0] == 1:
        out = 0
        for slot, e in enumerate(top_idx[0].tolist()):
            gate, up = F.linear(x, gate_up[e]).split(inter, dim=-1)
            out = out + F.linear(F.silu(gate) * up, down[e]) * top_w[:, slot : slot + 1]
        return out
    num_experts = gate_up.shape[0]
    order, expert_of, token_of, counts = sort_by_expert(top_idx, num_experts)
    weights = top_w.reshape(-1)[order, None]
    y = _grouped_mm_experts(x[token_of], counts, gate_up, down)
    if y is not None:
        return torch.zeros_like(x).index_add_(0, token_of, y * weights)
    slot_of = torch.arange(order.numel(), device=x.device) - (counts.cumsum(0) - counts)[expert_of]
    buf = x.new_zeros(num_experts, int(counts.max()), x.shape[-1])
    buf[expert_of, slot_of] = x[token_of]
    gate, up = torch.bmm(buf, gate_up.transpose(1, 2)).split(inter, dim=-1)
    y = torch.bmm(F.silu(gate) * up, down.transpose(1, 2))[expert_of, slot_of]
    return torch.zeros_like(x).index_add_(0, token_of, y * weights)


def _grouped_mm_experts(xs, counts, gate_up, down):
    """Grouped GEMM over the expert-sorted rows (no padding, unlike the bmm path); None where torch
    lacks it or rejects the layout, so the caller falls back to the padded path."""
    if getattr(torch, "_grouped_mm", None) is None:
        return None
    offs = counts.cumsum(0).to(torch.int32)
    grad = torch.is_grad_enabled() and (xs.requires_grad or gate_up.requires_grad or down.requires_grad)
    mm = (lambda a, w: _GroupedMM.apply(a, w, offs)) if grad else (lambda a, w: torch._grouped_mm(a, w, offs=offs))
    try:
        gate, up = mm(xs, gate_up.transpose(1, 2)).split(down.shape[-1], dim=-1)
        return mm(F.silu(gate) * up, down.transpose(1, 2))
    except (RuntimeError, NotImplementedError):
        return None


class _GroupedMM(torch.autograd.Function):
    """rows[offs[e-1]:offs[e]] @ w[e] for every expert e, with a backward that runs on CPU."""

    @staticmethod
    def forward(ctx, xs, w, offs):
        ctx.save_for_backward(xs, w, offs)
        return torch._grouped_mm(xs, w, offs=offs)

    @staticmethod
    def backward(ctx, gy):
        xs, w, offs = ctx.saved_tensors
        gy = gy.contiguous()
        gx = torch._grouped_mm(gy, w.transpose(1, 2), offs=offs) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = torch.zeros_like(w)
            start = 0
            for e, end in enumerate(offs.tolist()):
                if end > start:
                    torch.mm(xs[start:end].t(), gy[start:end], out=gw[e])
                start = end
        return gx, gw, None


def sort_by_expert(top_idx, num_experts):
    """(token, slot) pairs sorted by expert: `order` (flat pair index, stable), the expert and the
    token of each sorted pair, and the number of pairs per expert."""
    flat = top_idx.reshape(-1)
    order = flat.argsort(stable=True)
    return order, flat[order], order // top_idx.shape[1], torch.bincount(flat, minlength=num_experts)


def gathered_experts(x, top_idx, top_w, gate_up, down):
    """The same dispatch for a few tokens as plain tensor ops (no host sync, no data-dependent
    shapes, so torch.compile traces it into the step's graph): the k chosen experts' weights of
    every token are gathered and run as two batched matrix-vector products. Reads T*k expert
    matrices: the choice where T * top_k is below the number of experts (a decode step)."""
    t, k = top_idx.shape
    flat = top_idx.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [T*k, H, 1]
    gate, up = torch.bmm(gate_up[flat], xs).squeeze(-1).split(down.shape[-1], dim=-1)
    y = torch.bmm(down[flat], (F.silu(gate) * up)[:, :, None]).squeeze(-1)  # [T*k, H]
    return (y.view(t, k, -1) * cast(top_w, x.dtype)[:, :, None]).sum(1)


def segmented_experts(x, top_idx, top_w, num_experts, expert_fn):
    """The same dispatch for experts that are not plain weight tensors (e.g. int4): `expert_fn(e, xs)`
    maps the rows routed to expert e to its output. One call per used expert, on the contiguous
    segment of the sorted pairs (a single token calls its k experts directly)."""
    top_w = top_w.to(x.dtype)
    if x.shape[0] == 1:
        out = 0
        for slot, e in enumerate(top_idx[0].tolist()):
            out = out + expert_fn(e, x) * top_w[:, slot : slot + 1]
        return out
    order, expert_of, token_of, counts = sort_by_expert(top_idx, num_experts)
    xs = x[token_of]
    ys = []
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            ys.append(expert_fn(e, xs[start : start + n]))
            start += n
    y = torch.cat(ys)
    return torch.zeros_like(x).index_add_(0, token_of, y * top_w.reshape(-1)[order, None])


@torch.library.custom_op("clover::grouped_experts", mutates_args=())
def grouped_experts_op(x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor,
                       down: torch.Tensor) -> torch.Tensor:
    """`grouped_experts` as one opaque op for torch.compile: its routing is data-dependent (counts,
    a per-token expert loop), which would break the graph; inside a compiled graph the op runs the
    same eager kernel, so its outputs are those of `grouped_experts` exactly. Inference only."""
    return grouped_experts(x, top_idx, top_w, gate_up, down)


@grouped_experts_op.register_fake
def _grouped_experts_fake(x, top_idx, top_w, gate_up, down):
    return torch.empty_like(x)
