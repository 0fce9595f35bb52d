"""Expert parallelism for training (`ep = N` in the config, under torchrun with N processes).

Rank r owns experts [r E/N, (r+1) E/N) of every MoE layer: its slice of the fused expert weights
becomes a DTensor sharded along the expert dimension on the mesh (so torch.distributed.checkpoint
saves each rank's experts as shards of the global tensor, and a checkpoint resumes with or without
EP), and FSDP2 leaves those parameters alone (`ignored_params`) while it shards everything else.
In the forward each rank routes its own tokens; the (token, expert) pairs are sorted by the rank
owning the expert and exchanged with an all-to-all (differentiable: its backward is the reverse
all-to-all), the owner runs its experts on what it received (`grouped_experts`), and a second
all-to-all returns the outputs, which are weighted by the routing probabilities where the tokens
live. The experts' gradients are complete on their owner (every rank's tokens reached them); the
trainer scales every rank's loss by the world size for FSDP's gradient average, so `scale_grads`
divides the expert gradients by it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from ..ops.moe import grouped_experts


class ExpertParallelExperts(nn.Module):
    def __init__(self, experts, d):
        from torch.distributed.tensor import DTensor, Shard

        super().__init__()
        total = experts.gate_up_proj.shape[0]
        n = total // d.world
        self.first, self.n, self.d = d.rank * n, n, d

        def local(p):
            return nn.Parameter(DTensor.from_local(p.detach()[self.first:self.first + n].clone(), d.mesh, [Shard(0)],
                                                   run_check=False))

        self.gate_up_proj, self.down_proj = local(experts.gate_up_proj), local(experts.down_proj)

    def forward(self, x, top_idx, top_w):
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
        world, k = self.d.world, top_idx.shape[1]
        flat = top_idx.reshape(-1)
        dest = torch.div(flat, self.n, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)  # pairs grouped by the rank owning their expert
        token = order // k
        send = torch.bincount(dest, minlength=world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        local_expert = (flat[order] - dest[order] * self.n).contiguous()
        recv_expert = local_expert.new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv_expert, local_expert, recv_sizes, send_sizes)
        xs = x[token].contiguous()
        rx = all_to_all_single(xs.new_empty(sum(recv_sizes), x.shape[1]), xs, recv_sizes, send_sizes)
        if rx.shape[0]:
            ones = rx.new_ones(rx.shape[0], 1)
            ry = grouped_experts(rx, recv_expert[:, None], ones, gate_up, down)
        else:  # nothing to run here, but the backward's all-to-all must still meet the others'
            ry = rx * 0
        y = all_to_all_single(ry.new_empty(xs.shape), ry.contiguous(), send_sizes, recv_sizes)
        weights = top_w.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, y * weights)


def apply_expert_parallel(model, d) -> list[nn.Parameter]:
    """Replace every MoE's experts by this rank's expert-parallel shard; returns their parameters
    (for FSDP's `ignored_params` and `scale_grads`)."""
    from ..models.modeling_clover import CloverSparseMoe

    num = model.config.num_experts
    if num % d.world:
        raise ValueError(f"ep = {d.world} must divide num_experts = {num}")
    params = []
    for module in model.modules():
        if isinstance(module, CloverSparseMoe):
            module.experts = ExpertParallelExperts(module.experts, d)
            params += [module.experts.gate_up_proj, module.experts.down_proj]
    return params


def scale_grads(params, world: int) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.div_(world)
