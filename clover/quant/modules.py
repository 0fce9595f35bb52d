"""INT4 twins of the model's linear layers and routed experts, and the swap that installs them.

`Int4Weight` holds a stack of matrices [*lead, N, K] in the stored format (see `int4.py`); its
`matmul(x, index)` runs x @ W[index]^T through the device's kernel, built lazily on first use. On
CPU the kernel layout replaces the stored copy in memory (so weights are held once, at ~4.25
bits per value); `state_dict()` rebuilds the stored format exactly, so saving still works.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.linear.int4_q8 import ACTIVATIONS
from ..ops.moe import segmented_experts
from .int4 import CLOVER_KINDS, PackedInt4, check_group_size, kernel_kind, packed_matmul, reference_matmul

QUANT_METHOD = "clover_int4"
# Linear layers kept in high precision by default (matched on the last name component):
# the router and the shared-expert gate are tiny and routing-sensitive; the head is optional.
DEFAULT_NOT_QUANTIZED = ("gate", "shared_expert_gate", "lm_head")
STORED = ("qweight", "scales", "qzeros")
KERNELS = ("auto", "aten", "int8", "reference")  # Int4Weight.set_kernel


class Int4Weight(nn.Module):
    """A stack of int4 matrices [*lead, N, K] in the stored format, with lazily built kernels."""

    def __init__(self, lead: tuple, out_features: int, in_features: int, group_size: int, device=None):
        super().__init__()
        check_group_size((out_features, in_features), group_size)
        self.lead, self.group_size = tuple(lead), group_size
        self.out_features, self.in_features = out_features, in_features
        shape, groups = (*self.lead, out_features), in_features // group_size
        self.register_buffer("qweight", torch.zeros(*shape, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(*shape, groups, dtype=torch.bfloat16, device=device))
        self.register_buffer("qzeros", torch.full((*shape, groups), 8, dtype=torch.uint8, device=device))
        self.kernel = "auto"  # or "aten" (torch's CPU kernel), "int8" (clover's int8-activation kernel), "reference"
        self._packed: list[PackedInt4] | None = None
        self._stack: tuple[torch.Tensor, torch.Tensor] | None = None  # clover's layout of a stack, all matrices
        self._released = False
        self._register_state_dict_hook(Int4Weight._stored_state)

    def extra_repr(self) -> str:
        lead = f"lead={self.lead}, " if self.lead else ""
        return f"{lead}in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"

    # -- kernels -----------------------------------------------------------------------------
    def _matrix(self, index: int):
        if not self.lead:
            return self.qweight, self.scales, self.qzeros
        return self.qweight.flatten(0, -3)[index], self.scales.flatten(0, -3)[index], self.qzeros.flatten(0, -3)[index]

    def _build(self) -> list[PackedInt4] | None:
        kind = kernel_kind(self.qweight.device, prefer_aten=self.kernel == "aten", int8=True if self.kernel == "int8" else None)
        if kind == "reference":
            return None
        count = math.prod(self.lead)
        try:
            with torch.no_grad():
                packed = [PackedInt4.build(*self._matrix(i), kind) for i in range(count)]
        except (RuntimeError, NotImplementedError) as e:  # a device op that refuses these shapes
            warnings.warn(f"int4 {kind} kernel unavailable for {tuple(self.qweight.shape)}: {e}; using the reference")
            self.kernel = "reference"
            return None
        if kind in CLOVER_KINDS and self.lead:  # one tensor per part for the experts op; each matrix a view of it
            self._stack = torch.stack([p.weight for p in packed]), torch.stack([p.sz for p in packed])
            for i, p in enumerate(packed):
                p.weight, p.sz = self._stack[0][i], self._stack[1][i]
        if kind in ("cpu", *CLOVER_KINDS):  # the kernel layout now holds everything: drop the stored copy
            empty = lambda t: torch.empty(0, dtype=t.dtype, device=t.device)  # noqa: E731
            self.qweight, self.scales, self.qzeros = empty(self.qweight), empty(self.scales), empty(self.qzeros)
            self._released = True
        return packed

    def prepare_for_graphs(self) -> None:
        """Before a compiled runner traces the model: the kernel layout built now and held as buffers
        (`packed_weight_i`, `packed_sz_i`; not saved), so a graph reads them as its inputs and a
        Replay binds them by name."""
        if self.kernel == "reference":
            return
        if self._packed is None:
            self._packed = self._build()
        if self._stack is not None:  # the stack's parts, indexed per matrix in the graph
            self.register_buffer("packed_weight_all", self._stack[0], persistent=False)
            self.register_buffer("packed_sz_all", self._stack[1], persistent=False)
            return
        for i, p in enumerate(self._packed or ()):
            self.register_buffer(f"packed_weight_{i}", p.weight, persistent=False)
            self.register_buffer(f"packed_sz_{i}", p.sz, persistent=False)

    def graph_layout(self) -> tuple[list, list] | None:
        """(weights, scales-and-zeros) of the kernel layout per matrix while a graph is traced on it
        (`prepare_for_graphs`), else None."""
        if not (torch.compiler.is_compiling() and self.kernel != "reference"):
            return None
        count = math.prod(self.lead)
        if "packed_weight_all" in self._buffers:
            return ([self._buffers["packed_weight_all"][i] for i in range(count)],
                    [self._buffers["packed_sz_all"][i] for i in range(count)])
        if "packed_weight_0" not in self._buffers:
            return None
        return ([self._buffers[f"packed_weight_{i}"] for i in range(count)],
                [self._buffers[f"packed_sz_{i}"] for i in range(count)])

    def clover_stack(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(panels, sz) of every matrix at once in one of clover's CPU layouts (`ops/linear/int4_linear.py`,
        `int4_q8.py`: `_packed[0].kind` says which): the graph's buffers while one is traced, else the
        built layout; None for other kernels."""
        if self.kernel == "reference":
            return None
        if torch.compiler.is_compiling():
            if "packed_weight_all" in self._buffers:
                return self._buffers["packed_weight_all"], self._buffers["packed_sz_all"]
            return None
        if self._packed is None:
            self._packed = self._build()
        return self._stack

    def matmul(self, x: torch.Tensor, index: int = 0) -> torch.Tensor:
        """x [..., K] @ W[index]^T (index into the flattened lead dims) in x's dtype."""
        graph = self.graph_layout()
        if graph is not None:
            return packed_matmul(x, graph[0][index], graph[1][index], self.group_size, self.out_features,
                                 self._packed[index].kind)
        if self.kernel != "reference":
            if self._packed is None:
                self._packed = self._build()
            if self._packed is not None:
                return self._packed[index].matmul(x)
        self._restore()
        return reference_matmul(x, *self._matrix(index))

    def set_kernel(self, kernel: str) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown int4 kernel {kernel!r} ({', '.join(KERNELS)})")
        if kernel != self.kernel:
            self._restore()  # the next matmul builds the new kernel's layout
        self.kernel = kernel

    # -- the stored format stays the module's public state ---------------------------------------
    def stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._released:
            return self.qweight, self.scales, self.qzeros
        parts = [p.stored() for p in self._packed]
        shape = (*self.lead, self.out_features)
        return tuple(torch.stack([p[j] for p in parts]).reshape(*shape, -1) if self.lead else parts[0][j]
                     for j in range(3))

    def _restore(self) -> None:
        """Put the stored format back into the buffers and forget the kernel layout."""
        if self._released:
            self.qweight, self.scales, self.qzeros = self.stored()
            self._released = False
        self._packed = self._stack = None
        for name in [n for n in self._buffers if n.startswith("packed_")]:
            del self._buffers[name]

    @staticmethod
    def _stored_state(module, state_dict, prefix, local_metadata):
        if module._released:
            for name, tensor in zip(STORED, module.stored()):
                state_dict[prefix + name] = tensor
        return state_dict

    def _apply(self, fn, recurse=True):
        self._restore()
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._restore()
        return super()._load_from_state_dict(*args, **kwargs)

    def memory_bytes(self) -> int:
        """Bytes held now (kernel layout if built, else the stored format)."""
        if self._packed is not None:
            return sum(p.weight.numel() * p.weight.element_size() + p.sz.numel() * p.sz.element_size()
                       for p in self._packed)
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.qzeros))

    @torch.no_grad()
    def load_stored(self, stored: dict) -> "Int4Weight":
        """Fill the buffers from a {'qweight', 'scales', 'qzeros'} dict (e.g. `quantize_rtn`'s)."""
        self._restore()
        for name in STORED:
            getattr(self, name).copy_(stored[name])
        return self

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int) -> "Int4Weight":
        """Round-to-nearest int4 of a float stack [*lead, N, K]."""
        from .int4 import quantize_rtn

        *lead, n, k = weight.shape
        return cls(tuple(lead), n, k, group_size, device=weight.device).load_stored(quantize_rtn(weight, group_size))


class Int4Linear(Int4Weight):
    """Drop-in for nn.Linear with int4 weights (activations in bf16 on the kernels)."""

    def __init__(self, in_features, out_features, group_size, bias=False, device=None, dtype=torch.bfloat16):
        super().__init__((), out_features, in_features, group_size, device=device)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int, bias: torch.Tensor | None = None) -> "Int4Linear":
        from .int4 import quantize_rtn

        n, k = weight.shape
        module = cls(k, n, group_size, bias=bias is not None, device=weight.device)
        if bias is not None:
            module.bias.data.copy_(bias)
        return module.load_stored(quantize_rtn(weight, group_size))

    def forward(self, x):
        y = self.matmul(x)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


class Int4Experts(nn.Module):
    """Int4 twin of CloverExperts: same forward, same sort/grouping (ops.moe.segmented_experts)."""

    def __init__(self, num_experts, hidden, inter, group_size, device=None):
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.gate_up_proj = Int4Weight((num_experts,), 2 * inter, hidden, group_size, device=device)
        self.down_proj = Int4Weight((num_experts,), hidden, inter, group_size, device=device)

    def _expert(self, e, xs):
        gate, up = self.gate_up_proj.matmul(xs, e).split(self.inter, dim=-1)
        return self.down_proj.matmul(F.silu(gate) * up, e)

    def forward(self, x, top_idx, top_w):
        stacks = self.gate_up_proj.clover_stack(), self.down_proj.clover_stack()
        if stacks[0] is not None and stacks[1] is not None:  # clover's CPU kernels: one C++ op, eager or traced
            from ..ops.linear import int4_linear, int4_q8

            q8 = self.gate_up_proj._packed[0].kind == "clover_q8"
            op = int4_q8.int4_q8_experts if q8 else int4_linear.int4_experts
            return op(x, top_idx, top_w, *stacks[0], *stacks[1], self.gate_up_proj.group_size, self.inter)
        gate_up, down = self.gate_up_proj.graph_layout(), self.down_proj.graph_layout()
        kind = self.gate_up_proj._packed[0].kind if gate_up is not None and down is not None else None
        if kind in ("cpu", "clover"):
            return int4_experts_op(x, top_idx, top_w, *gate_up, *down, self.gate_up_proj.group_size, self.inter, kind)
        return segmented_experts(x, top_idx, top_w, self.num_experts, self._expert)


@torch.library.custom_op("clover::int4_experts", mutates_args=())
def int4_experts_op(x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, gate_up: list[torch.Tensor],
                    gate_up_sz: list[torch.Tensor], down: list[torch.Tensor], down_sz: list[torch.Tensor],
                    group_size: int, inter: int, kind: str) -> torch.Tensor:
    """`Int4Experts` on the CPU kernel layout as one opaque op for torch.compile (its routing is
    data-dependent): the same sort, grouping and kernel calls as the eager module, so the same
    outputs. Inference only."""

    def expert(e, xs):
        gate, up = packed_matmul(xs, gate_up[e], gate_up_sz[e], group_size, 2 * inter, kind).split(inter, dim=-1)
        return packed_matmul(F.silu(gate) * up, down[e], down_sz[e], group_size, x.shape[-1], kind)

    return segmented_experts(x, top_idx, top_w, len(gate_up), expert)


@int4_experts_op.register_fake
def _int4_experts_fake(x, top_idx, top_w, gate_up, gate_up_sz, down, down_sz, group_size, inter, kind):
    return torch.empty_like(x)


# ------------------------------------------------------------------------------------------------
# Installing the twins
# ------------------------------------------------------------------------------------------------
def is_excluded(name: str, not_quantized) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(name == m or last == m or name.endswith("." + m) for m in not_quantized)


def quantized_targets(model: nn.Module, not_quantized=DEFAULT_NOT_QUANTIZED):
    """(qualified name, module) of every layer the int4 format covers: nn.Linear layers not
    excluded, and every routed-experts module."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not is_excluded(name, not_quantized):
            out.append((name, module))
        elif is_fused_experts(module):
            out.append((name, module))
    return out


def is_fused_experts(module: nn.Module) -> bool:
    """A routed-experts module in the fused layout (models' CloverExperts): 3-D `gate_up_proj`
    [E, 2I, H] and `down_proj` [E, H, I] parameters. Told by its shape, so that this file (which the
    model file imports to install the int4 twins) never imports the model file."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3
            and gate_up.shape[0] == down.shape[0] and gate_up.shape[1] == 2 * down.shape[2]
            and gate_up.shape[2] == down.shape[1])


def check_quantization_config(qc: dict) -> dict:
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"unsupported quantization_config {qc!r} (expected quant_method {QUANT_METHOD!r})")
    if qc.get("bits", 4) != 4:
        raise ValueError(f"{QUANT_METHOD}: only 4 bits are supported, got {qc.get('bits')}")
    if qc.get("activations", "float32") not in ACTIVATIONS:
        raise ValueError(f"{QUANT_METHOD}: activations must be one of {', '.join(ACTIVATIONS)}, got {qc.get('activations')!r}")
    return qc


def apply_quantization(model: nn.Module, quantization_config: dict) -> nn.Module:
    """Replace the covered layers of `model` by int4 twins with empty (to be loaded) buffers; where the
    config asks for int8 activations (`clover quantize --activations int8`), on the int4 x int8 kernel."""
    qc = check_quantization_config(quantization_config)
    kernel = "int8" if qc.get("activations") == "int8" else "auto"
    g = int(qc["group_size"])
    not_quantized = qc.get("modules_not_quantized", DEFAULT_NOT_QUANTIZED)
    for name, module in quantized_targets(model, not_quantized):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(module, nn.Linear):
            new = Int4Linear(module.in_features, module.out_features, g, bias=module.bias is not None,
                             device=module.weight.device)
        else:
            e, two_i, h = module.gate_up_proj.shape
            new = Int4Experts(e, h, two_i // 2, g, device=module.gate_up_proj.device)
        set_int4_kernel(new, kernel)
        setattr(parent, attr, new)
    return model


def pack_int4_weights(model: nn.Module) -> None:
    """Every int4 layer's kernel layout built now, which its first matmul would otherwise do (in a
    server: inside the first request)."""
    for m in model.modules():
        if isinstance(m, Int4Weight) and m.kernel != "reference" and m._packed is None:
            m._packed = m._build()


def quantize_rtn_in_place(model: nn.Module, group_size: int, not_quantized=DEFAULT_NOT_QUANTIZED) -> nn.Module:
    """Every layer the int4 format covers replaced by its round-to-nearest int4 twin, in memory (what
    `clover quantize --method rtn` writes, without a folder)."""
    from .int4 import quantize_rtn

    for name, module in quantized_targets(model, not_quantized):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(module, nn.Linear):
            new = Int4Linear.from_float(module.weight.detach(), group_size, module.bias)
        else:
            e, two_i, h = module.gate_up_proj.shape
            new = Int4Experts(e, h, two_i // 2, group_size, device=module.gate_up_proj.device)
            new.gate_up_proj.load_stored(quantize_rtn(module.gate_up_proj.detach(), group_size))
            new.down_proj.load_stored(quantize_rtn(module.down_proj.detach(), group_size))
        setattr(parent, attr, new)
    return model


def set_int4_kernel(model: nn.Module, kernel: str) -> None:
    """'auto' (the device's best kernel), 'aten' (torch's kernels), 'int8' (clover's int4 x int8-activation
    kernel where built, else as 'auto') or 'reference' (dequantise then matmul) for every int4 layer."""
    for m in model.modules():
        if isinstance(m, Int4Weight):
            m.set_kernel(kernel)
