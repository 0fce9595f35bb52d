"""Scale-out on PyTorch's own engine (torch.distributed, launched by `torchrun`): docs/distributed.md.

* `runtime`: the process group and device mesh from torchrun's environment (gloo on CPU, NCCL on
  CUDA), rank-0-only output, small collectives on Python numbers.
* `fsdp`: FSDP2 (`fully_shard` per decoder layer, then the root) with a bf16 mixed-precision policy
  on GPU; the data-parallel `Shard` of each step's global batch.
* `checkpoint`: sharded, atomic `torch.distributed.checkpoint` checkpoints (resumable on any number
  of processes, one included) and the export of the full model to one HF safetensors folder.
* `parallel`: tensor / expert parallel inference (`--tp N`, `--ep N`) by explicit sharding of the
  model's fused projections, and the rank-0-driven replicated engine.
* `flags`: the argparse flags shared by the commands (no torch import).

Nothing here is imported by a single-process run, whose results stay bit-identical.
"""
