"""Exported GGUFs in stock llama.cpp (the `make llamacpp` build): logits parity with the PyTorch model
in f32, greedy AR output equal to `clover generate --mode ar`, tokenizer equality, quantised files.
Skipped when the build is absent (`make llamacpp` builds it and runs these)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from clover.backends.gguf_export import export_gguf  # noqa: E402
from clover.backends.llamacpp import SAMPLE_PROMPTS, LlamaCppContext, find_build, greedy_ar, teacher_forced_agreement  # noqa: E402

BUILD = find_build()
pytestmark = pytest.mark.skipif(BUILD is None, reason="no llama.cpp build (make llamacpp)")

from test_gguf_export import DEFAULT, save_odd_model  # noqa: E402

EOS = (0, 3)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamacpp")
    odd = save_odd_model(root / "odd", seed=1)
    out = {}
    for name, folder in (("default", DEFAULT), ("odd", odd)):
        path = root / f"{name}-f32.gguf"
        export_gguf(folder, path, "f32")
        out[name] = (folder, path)
    return out


@pytest.fixture(scope="module")
def torch_models(files):
    from clover.api import load

    return {name: load(folder, "cpu") for name, (folder, _) in files.items()}


def parity_model(path, rows):
    # f32 K/V and no flash attention: llama.cpp's CPU flash attention rounds through f16 (~1e-3 in logits)
    return LlamaCppContext(path, rows=rows, kv_type="f32", flash_attn=False)


@pytest.mark.parametrize("name", ["default", "odd"])
def test_logits_parity_prefill_and_cached_ar_steps_batch_of_rows(files, torch_models, name):
    model, tok = torch_models[name]
    prompts = [tok(p).input_ids for p in SAMPLE_PROMPTS[:3]]  # three lengths, one llama.cpp batch
    worst = 0.0
    with parity_model(files[name][1], rows=len(prompts)) as cpp, torch.inference_mode():
        got = cpp.decode(prompts)
        caches = [model.new_cache(1) for _ in prompts]
        refs = [model(torch.tensor([p]), cache=c).logits[0].numpy() for p, c in zip(prompts, caches)]
        for g, r in zip(got, refs):
            worst = max(worst, float(np.abs(g - r).max()))
        nxt = [[int(r[-1].argmax())] for r in refs]
        for _ in range(4):  # AR steps against the cached prefix: one token per row, one decode for all rows
            got = cpp.decode(nxt)
            refs = [model(torch.tensor([n]), cache=c).logits[0].numpy() for n, c in zip(nxt, caches)]
            for g, r in zip(got, refs):
                worst = max(worst, float(np.abs(g - r).max()))
            nxt = [[int(r[-1].argmax())] for r in refs]
    print(f"{name}: max |llama.cpp - torch| = {worst:.2e}")
    assert worst <= 1e-3


def test_all_logits_block_after_cached_prefix(files, torch_models):
    """A 16-token all-logits decode after a cached prefix (the shape a block step has) at block size 1."""
    model, tok = torch_models["odd"]
    ids = tok(SAMPLE_PROMPTS[4] + SAMPLE_PROMPTS[5]).input_ids
    head, tail = ids[:-16], ids[-16:]
    with parity_model(files["odd"][1], rows=1) as cpp, torch.inference_mode():
        cpp.decode([head])
        got = cpp.decode([tail])[0]
        cache = model.new_cache(1)
        model(torch.tensor([head]), cache=cache)
        ref = model(torch.tensor([tail]), cache=cache).logits[0].numpy()
    assert got.shape == (16, model.config.vocab_size)
    assert np.abs(got - ref).max() <= 1e-3


def test_decode_column_selection(files):
    """`decode`'s logits argument: "last" on an empty entry gives no row, a column list gives exactly
    those columns of the all-logits decode (llama.cpp computes only them)."""
    ids = list(range(40, 51))
    with parity_model(files["odd"][1], rows=2) as cpp:
        full = cpp.decode([ids])[0]
        cpp.reset()
        got, empty = cpp.decode([ids, []], logits=[[0, 4, 10], 0])
        cpp.reset()
        last, none = cpp.decode([ids, []], logits="last")
    assert got.shape == (3, full.shape[1]) and empty.shape == (0, full.shape[1]) and none.shape[0] == 0
    assert np.abs(got - full[[0, 4, 10]]).max() <= 1e-5 and np.abs(last[0] - full[-1]).max() <= 1e-5


def test_tokenizer_equals_transformers(files, torch_models):
    _, tok = torch_models["default"]
    texts = SAMPLE_PROMPTS + ["Sort: 41 7 93 28 65 12 80\n", "a  b\n\n  c\t3.14159 <|im_start|>user\nhi<|im_end|>\n",
                              "<think>x</think> <tool_call>{\"a\": 1}</tool_call>", "  trailing   "]
    with LlamaCppContext(files["default"][1]) as cpp:
        for text in texts:
            assert cpp.tokenize(text) == tok(text).input_ids, text


@pytest.mark.parametrize("name", ["default", "odd"])
def test_greedy_ar_equals_clover_on_20_prompts(files, torch_models, name):
    from clover.api import generate

    model, tok = torch_models[name]
    ours = generate(model, tok, SAMPLE_PROMPTS, max_new_tokens=16, mode="ar")
    with LlamaCppContext(files[name][1]) as cpp:  # llama.cpp's defaults (f16 K/V, flash attention on)
        for prompt, gen in zip(SAMPLE_PROMPTS, ours):
            assert greedy_ar(cpp, tok(prompt).input_ids, 16, EOS) == gen.token_ids, prompt


def test_stock_llama_simple_prints_clover_generate_ar_text(files):
    """The stock binary, tokenizing and detokenizing itself, against the `clover generate` CLI."""
    prompts = SAMPLE_PROMPTS[:3]
    cmd = [sys.executable, "-m", "clover", "generate", "--mode", "ar", "--max-new-tokens", "20", "--json", "--device", "cpu"]
    for p in prompts:
        cmd += ["--prompt", p]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "TQDM_DISABLE": "1"})
    assert r.returncode == 0, r.stderr
    ours = [g["text"] for g in json.loads(r.stdout)]
    for prompt, text in zip(prompts, ours):
        s = subprocess.run([str(BUILD / "stock" / "bin" / "llama-simple"), "-m", str(files["default"][1]), "-n", "20",
                            prompt], capture_output=True, text=True, timeout=120)
        assert s.returncode == 0, s.stderr[-2000:]
        assert s.stdout.rstrip("\n").startswith(prompt + text.rstrip("\n")), (s.stdout, text)


@pytest.mark.parametrize("outtype, floor", [("q8_0", 0.95), ("q4_0", 0.6)])
def test_quantised_token_agreement_with_bf16(files, tmp_path, outtype, floor):
    folder = files["default"][0]
    bf16, quant = tmp_path / "bf16.gguf", tmp_path / f"{outtype}.gguf"
    export_gguf(folder, bf16, "bf16")
    export_gguf(folder, quant, outtype)
    agree = teacher_forced_agreement(bf16, quant, SAMPLE_PROMPTS, 16)
    print(f"{outtype}: greedy token agreement with bf16 = {agree:.3f}")
    assert agree >= floor


def test_q4_k_through_llama_cpp_quantizer_runs(files, tmp_path):
    out = tmp_path / "q4_k.gguf"
    summary = export_gguf(files["default"][0], out, "q4_k")
    assert "Q4_K" in summary["tensor_types"]
    with LlamaCppContext(out) as cpp:
        assert len(greedy_ar(cpp, cpp.tokenize(SAMPLE_PROMPTS[0]), 4)) == 4
