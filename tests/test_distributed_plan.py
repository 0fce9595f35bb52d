"""`clover info --plan train|serve`: the per-GPU arithmetic against the parameter counts the code
computes exactly, and the serve plan against the shards the parallel loader really builds."""

import json

import pytest
import torch

from clover.distributed.parallel import load_parallel
from clover.models import preset_config
from clover.models.modeling_clover import CloverForBlockDiffusion
from clover.sizes import GIB, model_stats, serve_memory_plan, train_memory_plan

from helpers import save_tiny_model


def _counts(config):
    with torch.device("meta"):
        model = CloverForBlockDiffusion(config)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    shared = sum(p.numel() for n, p in model.named_parameters() if ".mlp.shared_expert." in n)
    return routed, shared


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-35b-a3b"])
def test_train_plan_arithmetic(preset):
    config = preset_config(preset)
    total = model_stats(config)["total_params"]
    one = train_memory_plan(config, gpus=1, seq_len=512)
    assert one["params_per_rank"] == total
    assert one["weight_bytes"] == one["grad_bytes"] == 4 * total and one["optimizer_bytes"] == 8 * total
    eight = train_memory_plan(config, gpus=8, seq_len=512)
    # dim-0 shards of ceil(rows / 8): at least an eighth of the model, at most one row more per tensor
    with torch.device("meta"):
        slack = sum(p.numel() // p.shape[0] for p in CloverForBlockDiffusion(config).parameters())
    assert total / 8 <= eight["params_per_rank"] <= total / 8 + slack
    parts = ("weight_bytes", "grad_bytes", "optimizer_bytes", "gathered_bytes", "activation_bytes", "logits_bytes",
             "runtime_overhead_bytes")
    assert eight["total_bytes"] == pytest.approx(sum(eight[k] for k in parts), abs=1)
    no_rc = train_memory_plan(config, gpus=8, seq_len=512, recompute=False)
    assert no_rc["activation_bytes"] > eight["activation_bytes"]
    assert train_memory_plan(config, gpus=8, seq_len=1024)["activation_bytes"] == pytest.approx(
        2 * eight["activation_bytes"], rel=1e-6)


def test_serve_plan_arithmetic_35b():
    config = preset_config("clover-35b-a3b")
    s = model_stats(config)
    one = serve_memory_plan(config, gpus=1, context=4096, batch=3)
    assert one["weight_bytes"] == s["bf16_weight_bytes"]
    assert one["kv_cache_bytes"] == s["kv_bytes_per_token"] * 4096 * 3 and one["gdn_state_bytes"] == 3 * s["gdn_state_bytes"]
    routed, shared = _counts(config)
    ep8 = serve_memory_plan(config, gpus=8, context=4096, batch=3)  # --ep 8 by default
    assert ep8["ep"] == 8 and ep8["params_per_rank"] == s["total_params"] - routed - shared + (routed + shared) // 8
    assert ep8["kv_cache_bytes"] == one["kv_cache_bytes"]  # attention replicated under EP
    tp2 = serve_memory_plan(config, gpus=2, tp=2, context=4096, batch=3)
    assert tp2["kv_cache_bytes"] * 2 == one["kv_cache_bytes"] and tp2["gdn_state_bytes"] * 2 == one["gdn_state_bytes"]
    with pytest.raises(ValueError, match="num_key_value_heads"):
        serve_memory_plan(config, gpus=8, tp=8)


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_serve_plan_counts_the_loaded_shards(tmp_path, tp, ep):
    folder = save_tiny_model(tmp_path)
    model = load_parallel(folder, tp, ep, 1, "cpu", torch.float32)
    config = model.config
    plan = serve_memory_plan(config, gpus=2, tp=tp, ep=ep, context=100, batch=2)
    assert plan["params_per_rank"] == sum(p.numel() for p in model.parameters())
    cache = model.new_cache(2, capacity=100)
    kv = sum(t.numel() * t.element_size() for store in (cache.key, cache.value) for t in store.values())
    assert plan["kv_cache_bytes"] == kv // 2  # the plan counts bf16, the test cache is fp32


def test_cli_plan(capsys):
    from clover.cli import main

    assert main(["info", "--preset", "clover-35b-a3b", "--plan", "train", "--gpus", "8", "--gpu-mem", "80", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plan"] == "train" and plan["budget_bytes"] == 80 * GIB and plan["fits"] == (plan["total_bytes"] <= 80 * GIB)
    assert main(["info", "--preset", "clover-35b-a3b", "--plan", "serve", "--gpus", "8", "--gpu-mem", "80"]) == 0
    out = capsys.readouterr().out
    assert "expert parallel 8" in out and "fits? yes" in out
    assert main(["info", "--plan", "serve", "--gpus", "8", "--tp", "8"]) == 2
    assert "num_key_value_heads" in capsys.readouterr().err
    assert main(["info", "--plan", "train", "--gpus", "0"]) == 2
    assert main(["info", "--plan", "train", "--quant", "int4"]) == 2
