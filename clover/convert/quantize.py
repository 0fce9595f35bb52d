"""`clover quantize`: a bf16/fp32 Clover checkpoint -> an int4 one, streamed layer by layer.

Every linear layer and every routed expert becomes group-wise int4 (format: `int4.py`); the router
(`mlp.gate`), the shared-expert gate, norms, convs, the embeddings and (unless `quantize_head`) the
head stay high precision, cast to bf16. Peak memory is about one decoder layer (plus, for GPTQ, the
calibration activations [samples, 2 * seq_len, hidden] in fp32 and one layer's Hessians).

GPTQ runs the classic sequential recipe: calibration tokens are embedded, then for each layer the
inputs of every quantised matrix are collected (per expert: the tokens routed to it), the layer is
quantised, and its output WITH the quantised weights feeds the next layer. Calibration runs in the
block-diffusion training layout ([x_t ; x_0], random mask ratio per window), so the Hessians see
both the noisy draft windows and the clean context that decoding feeds the model.

All validation happens before anything is written; the output is built in a temporary folder next
to DST and renamed into place only when complete.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ..quant.gptq import Hessian, gptq_quantize
from ..quant.int4 import GROUP_SIZES, check_group_size, dequantize, quantize_rtn
from ..quant.modules import ACTIVATIONS, DEFAULT_NOT_QUANTIZED, QUANT_METHOD, quantized_targets
from ..utils.checkpoint_io import SafetensorsSource, ShardWriter
from ..utils.files import staged_folder

METHODS = ("rtn", "gptq")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
REPO = Path(__file__).resolve().parent.parent.parent


class QuantizationError(ValueError):
    """A request that cannot be carried out (reported by the CLI as one line, nothing written)."""


def _notice(msg: str) -> None:
    print(msg, file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# Reading and writing checkpoints
# ------------------------------------------------------------------------------------------------
def _high_precision(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.is_floating_point() else t


# ------------------------------------------------------------------------------------------------
# Calibration data
# ------------------------------------------------------------------------------------------------
def default_calibration_file(src: Path) -> Path | None:
    """The default model's held-out slice, wherever it was shipped."""
    candidates = (src / "heldout.jsonl", REPO / "clover/assets/default/heldout.jsonl",
                  REPO / "clover/assets/default/data/heldout.jsonl", REPO / "runs/default/data/heldout.jsonl")
    for p in candidates:
        if p.is_file():
            return p
    return None


def default_calibration_records(n: int = 2000) -> list[dict] | None:
    """Without a shipped file: regenerate the default model's held-out split (clover/data/build.py,
    seed 0 -> held-out seed 1), skipping its first examples (the task-accuracy set)."""
    try:
        from ..data import tasks
    except ImportError:
        return None
    skip = 40 * len(tasks.TASKS)
    return [{"text": tasks.plain_text(ex)} for ex in tasks.generate_split(1, skip + n)[skip:]]


def _records(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        out = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise QuantizationError(f"{path}:{n}: not JSON ({e.msg})") from None
                if not isinstance(rec, dict) or not {"text", "messages", "input_ids"} & set(rec):
                    raise QuantizationError(f"{path}:{n}: a record needs 'text', 'messages' or 'input_ids'")
                out.append(rec)
        return out
    return [{"text": t} for t in path.read_text(encoding="utf-8").split("\n\n") if t.strip()]


def calibration_tokens(path, src: Path, config, samples: int, seq_len: int) -> torch.Tensor:
    """[n <= samples, seq_len] token ids: the documents of `path` (a file, or a list of records),
    tokenised with SRC's tokenizer, joined with end-of-text and cut into rows (the last partial row
    is dropped unless it is the only one)."""
    records = path if isinstance(path, list) else _records(path)
    path = "the default calibration data" if isinstance(path, list) else path
    tok = None
    if any("input_ids" not in r for r in records):
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(src)
        except Exception as e:  # noqa: BLE001 - any loading failure means the same thing here
            raise QuantizationError(f"{path} holds text but {src} has no usable tokenizer ({type(e).__name__})") from None
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    stream: list[int] = []
    need = samples * seq_len
    for rec in records:
        if "input_ids" in rec:
            ids = list(rec["input_ids"])
        elif "messages" in rec:
            if getattr(tok, "chat_template", None):
                text = tok.apply_chat_template(rec["messages"], tokenize=False)
            else:
                text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in rec["messages"])
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(rec["text"], add_special_tokens=False)
        stream += ids + ([eos] if eos is not None else [])
        if len(stream) >= need:
            break
    if len(stream) < 2:
        raise QuantizationError(f"{path}: no calibration tokens")
    if max(stream) >= config.vocab_size or min(stream) < 0:
        raise QuantizationError(f"{path}: token id {max(stream)} outside the model's vocabulary ({config.vocab_size})")
    rows = max(1, min(samples, len(stream) // seq_len))
    length = min(seq_len, len(stream))
    return torch.tensor(stream[: rows * length]).view(rows, length)


def noisy_copy(ids: torch.Tensor, mask_id: int, block: int, seed: int = 0) -> torch.Tensor:
    """The training corruption: each window draws t ~ U(0.1, 0.9) and masks each of its columns with
    probability t, except its first column (the previous window's last target, always clean)."""
    gen = torch.Generator().manual_seed(seed)
    rows, length = ids.shape
    windows = (torch.arange(length) + (-length) % block) // block
    first = torch.cat([torch.ones(1, dtype=torch.bool), windows[1:] != windows[:-1]])
    t = 0.1 + 0.8 * torch.rand(rows, int(windows[-1]) + 1, generator=gen)
    mask = (torch.rand(rows, length, generator=gen) < t[:, windows]) & ~first
    return torch.where(mask, torch.full_like(ids, mask_id), ids)


# ------------------------------------------------------------------------------------------------
# The conversion
# ------------------------------------------------------------------------------------------------
def _plan(config, group_size: int, quantize_head: bool, model_class=None):
    """Names of the quantised modules (checked against the group size) and the exclusion list;
    `model_class` builds the model from `config` (default: Clover's)."""
    from ..models import CloverForBlockDiffusion

    not_quantized = [m for m in DEFAULT_NOT_QUANTIZED if not (quantize_head and m == "lm_head")]
    with torch.device("meta"):
        model = (model_class or CloverForBlockDiffusion)(config)
    targets = {}
    for name, module in quantized_targets(model, not_quantized):
        if isinstance(module, torch.nn.Linear):
            check_group_size(module.weight.shape, group_size, name)
            targets[name] = "linear"
        else:
            check_group_size(module.gate_up_proj.shape, group_size, name + ".gate_up_proj")
            check_group_size(module.down_proj.shape, group_size, name + ".down_proj")
            targets[name] = "experts"
    return targets, not_quantized


class _Output:
    """The tensors written to the int4 folder, counted: kept ones (bf16, or as they are with
    `cast=False`) and quantised ones (their stored parts)."""

    def __init__(self, writer, cast: bool = True):
        self.writer, self.cast = writer, cast
        self.stats = {"quantized_params": 0, "kept_params": 0, "quantized_bytes": 0, "kept_bytes": 0,
                      "src_bytes_quantized": 0}

    def keep(self, name, t):
        self.stats["kept_params"] += t.numel()
        t = _high_precision(t) if self.cast else t
        self.stats["kept_bytes"] += t.numel() * t.element_size()
        self.writer.add(name, t)

    def put_quantized(self, name, stored, w):
        self.stats["quantized_params"] += w.numel()
        self.stats["src_bytes_quantized"] += w.numel() * w.element_size()
        for k, t in stored.items():
            self.stats["quantized_bytes"] += t.numel() * t.element_size()
            self.writer.add(f"{name}.{k}", t)


def quantize_checkpoint(
    src, dst, *, group_size: int = 128, method: str = "rtn", calib=None, calib_samples: int = 64,
    calib_seq_len: int = 256, quantize_head: bool = False, force: bool = False,
    max_shard_bytes: int = 2 * 10**9, activations: str = "float32", notice=_notice,
) -> dict:
    """Quantise checkpoint SRC into DST; returns a summary dict. Raises QuantizationError (or
    FileNotFoundError for a missing calibration file) before writing anything on bad input."""
    from ..models import CloverConfig

    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise QuantizationError(f"{src}: no config.json (not a checkpoint folder)")
    raw = json.loads((src / "config.json").read_text())
    if raw.get("quantization_config"):
        qm = raw["quantization_config"].get("quant_method", "?") if isinstance(raw["quantization_config"], dict) else "?"
        raise QuantizationError(f"{src} is already quantised ({qm}); quantise its bf16 source instead")
    if method not in METHODS:
        raise QuantizationError(f"unknown method {method!r} (known: {', '.join(METHODS)})")
    if group_size not in GROUP_SIZES:
        raise QuantizationError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    if activations not in ACTIVATIONS:
        raise QuantizationError(f"--activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    if calib_samples < 1 or calib_seq_len < 2:
        raise QuantizationError("--calib-samples must be >= 1 and the calibration length >= 2")
    if dst.exists() and not force:
        raise QuantizationError(f"{dst} already exists (use --force to replace it)")
    if dst.resolve() == src.resolve():
        raise QuantizationError("DST must differ from SRC")
    if _family(raw) is not None:
        if method != "rtn" or calib is not None:
            raise QuantizationError("a public family is quantised with --method rtn (gptq calibrates in Clover's "
                                    "training layout)")
        return quantize_family(src, dst, raw, group_size, quantize_head, max_shard_bytes, activations, notice)
    config = CloverConfig.from_pretrained(src)
    if quantize_head and config.tie_word_embeddings:
        raise QuantizationError("--quantize-head needs an untied lm_head (this model ties it to the embeddings)")
    try:
        targets, not_quantized = _plan(config, group_size, quantize_head)
    except ValueError as e:
        raise QuantizationError(str(e)) from None
    calib_ids, calib_path = None, None
    if calib is not None and method != "gptq":
        raise QuantizationError("--calib is only used by --method gptq")
    if method == "gptq":
        if calib is not None:
            calib_path = Path(calib)
            if not calib_path.is_file():
                raise FileNotFoundError(f"calibration file {calib_path} does not exist")
        else:
            calib_path = default_calibration_file(src)
        records = calib_path if calib_path is not None else default_calibration_records()
        if records is None:
            raise QuantizationError("gptq needs calibration text: pass --calib FILE (.jsonl with text/messages/"
                                    "input_ids, or .txt); the default model's held-out data was not found")
        if config.mask_token_id is None:
            raise QuantizationError("gptq calibration needs config.mask_token_id")
        calib_ids = calibration_tokens(records, src, config, calib_samples, calib_seq_len)
    source = SafetensorsSource(src, QuantizationError)

    with staged_folder(dst, "quantizing") as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        stats = _quantize_into(source, writer, config, targets, group_size, method, calib_ids, notice)
        shards = writer.close()
        qc = _quantization_config(group_size, method, not_quantized, activations)
        if calib_ids is not None:
            name = calib_path.name if calib_path is not None else "clover.data held-out split (seed 1)"
            qc["calibration"] = {"file": name, "samples": int(calib_ids.shape[0]),
                                 "seq_len": int(calib_ids.shape[1]), "layout": "block-diffusion training [x_t ; x_0]"}
        out_cfg = {**raw, "quantization_config": qc, "dtype": "bfloat16"}
        out_cfg.pop("torch_dtype", None)
        _finish_folder(tmp, src, out_cfg)
    return {"dst": str(dst), "method": method, "group_size": group_size, "shards": shards, **stats}


def _quantization_config(group_size: int, method: str, not_quantized, activations: str = "float32") -> dict:
    """config.json's `quantization_config`; `activations` "int8" runs the products on the int4 x int8 kernel
    (activations rounded per block of 32, as llama.cpp's q4_0 does), "float32" on the exact one."""
    return {
        "quant_method": QUANT_METHOD, "bits": 4, "group_size": group_size, "method": method,
        "activations": activations, "modules_not_quantized": list(not_quantized),
        "format": "qweight uint8 [..., N, K/2] (low nibble = even column), scales bf16 and qzeros uint8 "
                  "[..., N, K/group_size]; W = (q - qzeros) * scales",
    }


def _finish_folder(tmp: Path, src: Path, config: dict) -> None:
    """config.json, and every other file of SRC but its weights (tokenizer, chat template, ...)."""
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in src.iterdir():
        if path.is_file() and path.name != "config.json" and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, tmp / path.name)


# ------------------------------------------------------------------------------------------------
# The public families (clover/models/modeling_{sdar,llada2,fast_dllm}.py)
# ------------------------------------------------------------------------------------------------
def _family(raw: dict):
    """The public family a config.json names, None for Clover's own."""
    from ..models.families import UnknownFamily, family_of

    if raw.get("model_type") == "clover":
        return None
    try:
        return family_of(raw)
    except UnknownFamily:
        return None


def _check_shapes(state: dict, model_class, config, src: Path) -> None:
    """The folder's tensors (Clover's names) are the model's, shaped as its config says."""
    with torch.device("meta"):
        want = {k: tuple(t.shape) for k, t in model_class(config).state_dict().items()}
    got = {k: tuple(t.shape) for k, t in state.items()}
    for name in sorted(set(want) | set(got)):
        if want.get(name) != got.get(name):
            raise QuantizationError(f"{src}: tensor {name} is {got.get(name)} in the files but {want.get(name)} "
                                    "for its config.json")


def quantize_family(src: Path, dst: Path, raw: dict, group_size: int, quantize_head: bool, max_shard_bytes: int,
                    activations: str = "float32", notice=_notice) -> dict:
    """A public family's folder -> int4 (RTN): the same modules as Clover's (every linear layer but
    the routers and, unless `quantize_head`, the head; every routed-experts stack), written under
    Clover's names (per-expert tensors stacked: `mlp.experts.gate_up_proj.qweight`); the other
    tensors are kept as the source stores them (the published folders are bf16). Streamed: one
    tensor (one layer's expert stack) read from the folder's files at a time, besides the output
    shard being filled (at most `max_shard_bytes`)."""
    from ..models.modeling_family import published_plan

    fam = _family(raw)
    try:
        config = fam.config_class().from_dict(raw)
        if quantize_head and config.tie_word_embeddings:
            raise QuantizationError("--quantize-head needs an untied lm_head (this model ties it to the embeddings)")
        targets, not_quantized = _plan(config, group_size, quantize_head, fam.model_class())
    except ValueError as e:
        raise QuantizationError(str(e)) from None
    source = SafetensorsSource(src, QuantizationError)
    plan = published_plan(source.stored_order(), config)
    on_meta = lambda key: torch.empty(source.shape(key), device="meta")  # noqa: E731 - shapes only
    _check_shapes({name: build(on_meta) for name, build in plan.items()}, fam.model_class(), config, src)
    quantized = {}  # tensor name -> the name its stored parts take
    for n, kind in targets.items():
        for name in [f"{n}.weight"] if kind == "linear" else [f"{n}.gate_up_proj", f"{n}.down_proj"]:
            quantized[name] = n if kind == "linear" else name
    with staged_folder(dst, "quantizing") as tmp:
        out = _Output(ShardWriter(tmp, max_shard_bytes), cast=False)
        for name, build in plan.items():
            t = build(source.get)
            if name in quantized:
                out.put_quantized(quantized[name], quantize_rtn(t, group_size), t)
            else:
                out.keep(name, t)
            del t
        shards = out.writer.close()
        notice(f"{len(targets)} modules quantised (rtn)")
        _finish_folder(tmp, src, {**raw, "quantization_config": _quantization_config(group_size, "rtn", not_quantized,
                                                                                         activations)})
    return {"dst": str(dst), "method": "rtn", "group_size": group_size, "shards": shards, **out.stats}


def _layer_keys(weight_map, prefix: str) -> list[str]:
    return [k for k in weight_map if k.startswith(prefix)]


def _quantize_into(source, writer, config, targets, g, method, calib_ids, notice) -> dict:
    from ..models.modeling_clover import CloverDecoderLayer, CloverRMSNorm, training_layout

    out = _Output(writer)
    stats, keep, put_quantized = out.stats, out.keep, out.put_quantized

    wm = source.weight_map
    gptq = method == "gptq"
    hidden = None
    if gptq:
        embed = source.get("model.embed_tokens.weight").float()
        noisy = noisy_copy(calib_ids, config.mask_token_id, config.block_size)
        hidden = torch.cat([F.embedding(noisy, embed), F.embedding(calib_ids, embed)], dim=1)
        del embed
    batch = 8

    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        keys = _layer_keys(wm, prefix)
        local = {k[len(prefix):]: source.get(k) for k in keys}
        layer_targets = {n[len(prefix):]: kind for n, kind in targets.items() if n.startswith(prefix)}
        if gptq:
            layer = CloverDecoderLayer(config, i)
            missing = set(layer.state_dict()) - set(local)
            if missing:
                raise QuantizationError(f"missing tensors {sorted(prefix + m for m in missing)[:3]}")
            layer.load_state_dict({k: v.float() for k, v in local.items()})
            hess = _collect_hessians(layer, layer_targets, hidden, config, batch, training_layout)
        done = set()
        for name, kind in layer_targets.items():
            if kind == "linear":
                w = local[name + ".weight"]
                stored = gptq_quantize(w, hess[name], g) if gptq else quantize_rtn(w, g)
                put_quantized(prefix + name, stored, w)
                done.add(name + ".weight")
                if gptq:
                    layer.get_submodule(name).weight.data.copy_(dequantize(**stored))
            else:
                for part in ("gate_up_proj", "down_proj"):
                    w = local[f"{name}.{part}"]
                    if gptq:
                        stored = gptq_quantize(w, hess[f"{name}.{part}"], g)
                        getattr(layer.get_submodule(name), part).data.copy_(dequantize(**stored))
                    else:
                        stored = quantize_rtn(w, g)
                    put_quantized(f"{prefix}{name}.{part}", stored, w)
                    done.add(f"{name}.{part}")
        for k, t in local.items():
            if k not in done:
                keep(prefix + k, t)
        if gptq:  # the next layer sees this layer's output with quantised weights
            with torch.no_grad():
                hidden = _run_layer(layer, hidden, config, batch, training_layout)
            del layer, hess
        del local
        notice(f"layer {i + 1}/{config.num_hidden_layers} quantised ({method})")

    for k in wm:
        if k.startswith("model.layers."):
            continue
        t = source.get(k)
        if k == "lm_head.weight" and "lm_head" in targets:
            if gptq:
                norm = CloverRMSNorm(config.hidden_size, config.rms_norm_eps)
                norm.weight.data.copy_(source.get("model.norm.weight").float())
                h = Hessian(t.shape[1])
                with torch.no_grad():
                    for b in range(0, hidden.shape[0], batch):
                        h.add(norm(hidden[b : b + batch]))
                stored = gptq_quantize(t, h, g)
            else:
                stored = quantize_rtn(t, g)
            put_quantized("lm_head", stored, t)
        else:
            keep(k, t)
    return stats


def _layout_for(rows, config, length, training_layout):
    return training_layout(config, rows, length // 2, config.block_size, "cpu")


def _run_layer(layer, hidden, config, batch, training_layout):
    out = []
    for b in range(0, hidden.shape[0], batch):
        x = hidden[b : b + batch]
        out.append(layer(x, _layout_for(x.shape[0], config, x.shape[1], training_layout), None))
    return torch.cat(out)


def _collect_hessians(layer, layer_targets, hidden, config, batch, training_layout) -> dict:
    """One pass of the calibration activations through the (unquantised) layer, accumulating the
    Hessian of every quantised matrix's inputs; experts get one Hessian per expert, from the
    tokens routed to it (down_proj: the SwiGLU activations those tokens produce)."""
    hess, handles = {}, []
    for name, kind in layer_targets.items():
        module = layer.get_submodule(name)
        if kind == "linear":
            hess[name] = Hessian(module.in_features)
            handles.append(module.register_forward_pre_hook(
                lambda m, args, h=hess[name]: h.add(args[0])))
        else:
            e, two_i, hdim = module.gate_up_proj.shape
            hess[name + ".gate_up_proj"] = [Hessian(hdim) for _ in range(e)]
            hess[name + ".down_proj"] = [Hessian(two_i // 2) for _ in range(e)]

            def experts_hook(m, args, hg=hess[name + ".gate_up_proj"], hd=hess[name + ".down_proj"]):
                x, top_idx = args[0], args[1]
                inter = m.down_proj.shape[-1]
                for ex in top_idx.unique().tolist():
                    xe = x[(top_idx == ex).any(-1)]
                    hg[ex].add(xe)
                    gate, up = F.linear(xe, m.gate_up_proj[ex]).split(inter, dim=-1)
                    hd[ex].add(F.silu(gate) * up)

            handles.append(module.register_forward_pre_hook(experts_hook))
    try:
        with torch.no_grad():
            _run_layer(layer, hidden, config, batch, training_layout)
    finally:
        for h in handles:
            h.remove()
    return hess
