"""int4 of the public families (`clover quantize --model DIR --out DIR`, convert/quantize.py
quantize_family): the folder it writes loads through the family loader with the int4 modules in
place, its stored codes are `quantize_rtn`'s of the fp32 weights exactly, its logits with the
reference kernel equal those of the fp32 model whose weights were replaced by their dequantised
int4 (1e-5), the CPU kernel's (bf16 activations) are close to those, and the int4 model's logits
are close to the fp32 model's; `clover generate` decodes the int4 folder. Tiny random folders in the
published layout (tests/test_families.py writes them)."""

from __future__ import annotations

import json

import pytest
import torch
from test_families import VOCAB, write_family
from test_families_engine import _clover

from clover.cli import main
from clover.models.families import load_family
from clover.quant import Int4Experts, Int4Linear, dequantize, quantize_rtn, set_int4_kernel
from clover.quant.modules import quantized_targets

G = 32


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def dequantised(model):
    """`model` (fp32) with every weight the int4 format covers replaced by its dequantised int4."""
    with torch.no_grad():
        for _, module in quantized_targets(model):
            for p in [module.weight] if isinstance(module, torch.nn.Linear) else [module.gate_up_proj, module.down_proj]:
                p.copy_(dequantize(**quantize_rtn(p, G)))
    return model


@pytest.mark.parametrize("model_type", ["sdar", "sdar_moe", "llada2_moe", "Fast_dLLM_Qwen"])
def test_int4_family_folder_loads_and_matches(tmp_path, model_type, capsys):
    src, dst = tmp_path / "src", tmp_path / "int4"
    write_family(src, model_type)
    assert main(["quantize", "--model", str(src), "--out", str(dst), "--group-size", str(G)]) == 0
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "clover_int4" and cfg["architectures"]
    fp32 = load_family(src, dtype=torch.float32).model
    q = load_family(dst, dtype=torch.float32).model
    layer = q.model.layers[-1]
    attn = layer.self_attn.q_proj if hasattr(layer, "self_attn") else layer.attention.query_key_value
    assert isinstance(attn, Int4Linear)
    assert isinstance(getattr(layer.mlp, "experts", None) or layer.mlp.down_proj, (Int4Experts, Int4Linear))
    ref_attn = dict(fp32.named_modules())[dict((m, n) for n, m in q.named_modules())[attn]]
    assert torch.equal(attn.stored()[0], quantize_rtn(ref_attn.weight.detach(), G)["qweight"])
    ids = torch.randint(4, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[1, :3] = True  # left padding, odd lengths
    with torch.no_grad():
        exact = fp32(ids, block_size=4, pad=pad)
        fast = q(ids, block_size=4, pad=pad)
        set_int4_kernel(q, "reference")
        ref = q(ids, block_size=4, pad=pad)
        want = dequantised(fp32)(ids, block_size=4, pad=pad)
    real = ~pad
    torch.testing.assert_close(ref[real], want[real], rtol=1e-5, atol=1e-5)
    assert rel(fast[real], ref[real]) < 0.1  # the kernel's bf16 activations
    assert rel(fast[real], exact[real]) < 0.5  # 4-bit weights of a tiny random model: within their rounding


def test_cli_generate_on_an_int4_family_folder(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "int4"
    write_family(src, "sdar_moe")
    run = _clover("quantize", str(src), str(dst), "--group-size", str(G), "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["quantized_params"] > 0
    run = _clover("generate", "--model", str(dst), "--prompt", "Hello", "--max-new-tokens", "7", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["finish_reason"] in ("length", "stop")
    run = _clover("quantize", str(src), str(tmp_path / "g"), "--method", "gptq")
    assert run.returncode == 2 and "--method rtn" in run.stderr and len(run.stderr.strip().splitlines()) == 1


# ---- streamed quantisation: the same bytes as quantising the whole model in memory, bounded memory ----
def reshard(folder, parts: int = 3, dtype=torch.bfloat16) -> int:
    """The folder's model.safetensors split into `parts` shards with an index (names shuffled across
    them, so one layer's experts sit in several files), cast to `dtype` as the published folders are;
    returns the bytes stored."""
    from safetensors.torch import load_file, save_file

    state = {k: v.to(dtype) for k, v in load_file(str(folder / "model.safetensors")).items()}
    names = list(state)
    order = torch.randperm(len(names), generator=torch.Generator().manual_seed(3)).tolist()
    weight_map = {}
    for p in range(parts):
        file = f"model-{p + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {names[i]: state[names[i]] for i in order[p::parts]}
        save_file(chunk, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(t.numel() * t.element_size() for t in state.values())


def quantize_in_memory(src, dst, group_size: int, max_shard_bytes: int) -> None:
    """The reference: the whole folder read (read_weights), mapped (map_published), then every
    tensor quantised or kept in the mapped order - what `quantize_family` did before it streamed."""
    from clover.convert.quantize import _Output, _family, _finish_folder, _plan, _quantization_config
    from clover.models.modeling_family import map_published, read_weights
    from clover.utils.checkpoint_io import ShardWriter

    raw = json.loads((src / "config.json").read_text())
    fam = _family(raw)
    config = fam.config_class().from_dict(raw)
    targets, not_quantized = _plan(config, group_size, False, fam.model_class())
    state = map_published(read_weights(src), config)
    dst.mkdir()
    quantized = {f"{n}.weight": n for n, kind in targets.items() if kind == "linear"}
    quantized |= {f"{n}.{p}": f"{n}.{p}" for n, kind in targets.items() if kind == "experts"
                  for p in ("gate_up_proj", "down_proj")}
    out = _Output(ShardWriter(dst, max_shard_bytes), cast=False)
    for name, t in state.items():
        if name in quantized:
            out.put_quantized(quantized[name], quantize_rtn(t, group_size), t)
        else:
            out.keep(name, t)
    out.writer.close()
    _finish_folder(dst, src, {**raw, "quantization_config": _quantization_config(group_size, "rtn", not_quantized)})


def folder_bytes(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("model_type", ["sdar_moe", "llada2_moe", "sdar"])
def test_streamed_family_quantisation_is_byte_identical(tmp_path, model_type):
    from clover.convert.quantize import quantize_checkpoint

    src = tmp_path / "src"
    write_family(src, model_type)
    reshard(src)
    for shard in (1 << 12, 1 << 40):  # several output shards; one
        got, want = tmp_path / f"got{shard}", tmp_path / f"want{shard}"
        quantize_checkpoint(src, got, group_size=G, max_shard_bytes=shard, notice=lambda m: None)
        quantize_in_memory(src, want, G, shard)
        assert folder_bytes(got) == folder_bytes(want)
        assert (len([p for p in got.iterdir() if p.suffix == ".safetensors"]) > 1) == (shard < 1 << 20)


def test_streamed_family_quantisation_memory_does_not_grow_with_the_model(tmp_path, monkeypatch):
    """Tensors read from the source folder and still alive at once: their peak bytes are the same for
    a model of 2 and of 6 layers (one layer's expert stack), every tensor is read, none twice."""
    import weakref

    from clover.convert.quantize import quantize_checkpoint
    from clover.utils.checkpoint_io import SafetensorsSource

    live, seen = {"now": 0, "peak": 0}, []
    read = SafetensorsSource.get

    def tracked(self, key):
        t = read(self, key)
        nbytes = t.numel() * t.element_size()
        live["now"] += nbytes
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(t, lambda n=nbytes: live.__setitem__("now", live["now"] - n))
        seen.append(key)
        return t

    monkeypatch.setattr(SafetensorsSource, "get", tracked)
    peaks = []
    for layers in (2, 6):
        src = tmp_path / f"src{layers}"
        write_family(src, "sdar_moe", num_hidden_layers=layers)
        total = reshard(src)
        live["peak"], seen[:] = 0, []
        quantize_checkpoint(src, tmp_path / f"q{layers}", group_size=G, max_shard_bytes=1, notice=lambda m: None)
        stored = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
        assert sorted(seen) == sorted(stored)  # every tensor read once
        peaks.append(live["peak"])
        assert live["peak"] < total / 3
    assert peaks[0] == peaks[1] > 0
