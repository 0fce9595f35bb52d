"""Block diffusion in the patched llama.cpp (patches/clover-block-diffusion.patch) behind the engine:
draft-window and commit logits against the PyTorch model (f32, rows of different lengths), and
greedy outputs of every mode equal to the PyTorch engine. Skipped without the patched build."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from clover.backends.gguf_export import export_gguf  # noqa: E402
from clover.backends.llamacpp import SAMPLE_PROMPTS, find_build  # noqa: E402

pytestmark = pytest.mark.skipif(find_build(variant="clover") is None, reason="no patched llama.cpp build (make llamacpp)")

from test_gguf_export import DEFAULT, save_odd_model  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """name -> (torch model, tokenizer, llama.cpp runner), the runner in parity settings (f32 K/V)."""
    from clover.api import load
    from clover.backends.llamacpp.model import LlamaCppModel

    root = tmp_path_factory.mktemp("diffusion")
    out = {}
    for name, folder in (("default", DEFAULT), ("odd", save_odd_model(root / "odd", seed=2))):
        path = root / f"{name}.gguf"
        export_gguf(folder, path, "f32")
        model, tok = load(folder, "cpu")
        out[name] = (model, tok, LlamaCppModel(path, model.config, max_rows=4, parity=True))
    yield out
    for _, _, runner in out.values():
        runner.close()


def both(model, runner, caches, ids, **kw):
    with torch.inference_mode():
        ref = model(ids, cache=caches[0], **kw).logits
        got = runner(ids, cache=caches[1], **kw).logits
    return float((got - ref).abs().max())


@pytest.mark.parametrize("name", ["default", "odd"])
@pytest.mark.parametrize("B", [4, 8])
def test_commit_and_draft_logits_equal_torch(pair, name, B):
    model, tok, runner = pair[name]
    mask = model.config.mask_token_id
    prompts = [tok(SAMPLE_PROMPTS[1]).input_ids, tok(SAMPLE_PROMPTS[5]).input_ids]  # different lengths
    width = max(map(len, prompts)) - 1
    ids = torch.zeros(2, width, dtype=torch.long)
    pad = torch.ones(2, width, dtype=torch.bool)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) + 1 :] = torch.tensor(p[:-1])
        pad[r, width - len(p) + 1 :] = False
    caches = (model.new_cache(2), runner.new_cache(2))
    worst = []
    # prefill: the clean prompt committed in windows of B anchored at its end (rows left-padded)
    # in one decode (several windows of one sequence in one ubatch: the patch's window masks); the
    # logits of every column both rows hold a real token in
    assert width > 2 * B and len(runner.commit_chunks(width, B, 2, pad.tolist())) == 1
    worst.append(both(model, runner, caches, ids, clean_block_size=B, pad_mask=pad,
                      logits_to_keep=min(map(len, prompts)) - 1))
    window = torch.full((2, B), mask)
    window[:, 0] = torch.tensor([p[-1] for p in prompts])
    worst.append(both(model, runner, caches, window, block_size=B, draft_len=B, logits_to_keep=B))
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # commit the (filled) block and draft the next one in one call
        filled = torch.cat([window[:, :1], torch.randint(10, 4000, (2, B - 1), generator=g)], dim=1)
        window = torch.full((2, B), mask)
        window[:, 0] = filled[:, -1]
        ids2 = torch.cat([filled, window], dim=1)
        worst.append(both(model, runner, caches, ids2, block_size=B, draft_len=B, clean_block_size=B, logits_to_keep=B))
    # a draft with some masks filled, only the still-masked columns' logits
    partial = window.clone()
    partial[:, 1:3] = torch.randint(10, 4000, (2, 2), generator=g)
    index = torch.arange(3, B)
    worst.append(both(model, runner, caches, partial, block_size=B, draft_len=B, logits_to_keep=B, logits_index=index))
    print(f"{name} B={B}: max |llama.cpp - torch| per call {['%.1e' % w for w in worst]}")
    assert max(worst) <= 1e-3


@pytest.mark.parametrize("mode", ["ar", "low_confidence", "self_spec"])
@pytest.mark.parametrize("name", ["default", "odd"])
def test_greedy_generation_equals_torch_engine(pair, name, mode):
    from clover.api import generate

    model, tok, runner = pair[name]
    prompts = SAMPLE_PROMPTS[:20]
    kw = dict(max_new_tokens=24, mode=mode, block_size=8)
    ref = [generate(model, tok, prompts[i : i + 4], **kw) for i in range(0, 20, 4)]
    got = [generate(runner, tok, prompts[i : i + 4], **kw) for i in range(0, 20, 4)]
    ref = [g.token_ids for batch in ref for g in batch]
    got = [g.token_ids for batch in got for g in batch]
    same = sum(a == b for a, b in zip(ref, got))
    assert same == 20, f"{mode}: {same}/20 prompts identical"
    assert np.mean([len(t) for t in got]) > 1


def test_cli_generate_backend_llamacpp_equals_torch():
    import json
    import os
    import subprocess
    import sys

    base = [sys.executable, "-m", "clover", "generate", "--prompt", SAMPLE_PROMPTS[1], "--prompt", SAMPLE_PROMPTS[5],
            "--max-new-tokens", "24", "--block-size", "8", "--json", "--device", "cpu"]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    outs = []
    for extra in ([], ["--backend", "llamacpp"]):
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append([g["text"] for g in json.loads(r.stdout)])
    assert outs[0] == outs[1]
    r = subprocess.run(base + ["--gguf", "x.gguf"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2 and "--gguf needs --backend llamacpp" in r.stderr
