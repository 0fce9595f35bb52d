"""The public families decode through Clover's engine (engine/layout.py, models/family_seam.py):
its LowConfidence greedy decode gives the tokens of the family's published loop
(clover/models/reference_generate.py) at the same block size and threshold, alone and in a batch of
prompts of different (odd) lengths; `ar` / `self_spec` are refused in one line where the family has
no shift. Tiny random folders in the published layout (tests/test_families.py writes them)."""

from __future__ import annotations

import pytest
import torch
from test_families import VOCAB, confident, write_family

from clover.engine import DecodeConfig, Engine
from clover.models.family_seam import FamilySeam
from clover.models.reference_generate import fast_dllm_generate, llada2_generate, sdar_generate

B, THRESHOLD = 4, 0.6
LENGTHS = (5, 7, 8, 3)  # odd, a whole block, shorter than a block


def prompts(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def budget(n: int) -> int:
    """Tokens up to the end of the third block after the prompt's (the published loops fill whole blocks)."""
    return (n // B + 3) * B - n


def reference(model_type, model, mask, prompt):
    x = torch.tensor([prompt])
    if model_type == "llada2_moe":
        out, _ = llada2_generate(model, x, mask, budget(len(prompt)), block_length=B, steps=B, threshold=THRESHOLD)
    else:
        out, _ = sdar_generate(model, x, mask, budget(len(prompt)), block_length=B, threshold=THRESHOLD)
    return out[0, len(prompt):len(prompt) + budget(len(prompt))].tolist()


def engine_tokens(seam, batch, budgets=None, block=B):
    cfg = DecodeConfig(block_size=block, threshold=THRESHOLD, max_new_tokens=64)
    engine = Engine(seam, cfg)
    seqs = engine.add(batch, budgets or [budget(len(p)) for p in batch])
    while engine.running:
        engine.step()
    return [s.token_ids for s in seqs], [s.forward_passes for s in seqs]


@pytest.mark.parametrize("model_type", ["sdar", "sdar_moe", "llada2_moe"])
def test_engine_equals_the_published_loop(tmp_path, model_type):
    write_family(tmp_path, model_type)
    loaded = confident(tmp_path, model_type)
    seam = FamilySeam(loaded)
    ps = prompts()
    want = [reference(model_type, loaded.model, loaded.mask_token_id, p) for p in ps]
    alone = [engine_tokens(seam, [p])[0][0] for p in ps]
    together, forwards = engine_tokens(seam, ps)
    assert alone == want and together == want
    assert all(len(t) == budget(len(p)) for t, p in zip(want, ps))
    assert min(len(t) / f for t, f in zip(together, forwards)) > 1  # the threshold fills several per forward


def fast_dllm_reference(loaded, ps):
    """The published Fast-dLLM v2 loop's tokens of each prompt (blocks of 8 in sub-blocks of 4)."""
    want = []
    for p in ps:
        out, _ = fast_dllm_generate(loaded.model, torch.tensor([p]), loaded.mask_token_id, max_new_tokens=16,
                                    block_size=8, small_block_size=4, threshold=THRESHOLD)
        want.append(out[0, len(p):].tolist())
    return want


def test_fast_dllm_engine_equals_the_published_loop(tmp_path):
    """Shift with absolute blocks of 8 in sub-blocks of 4: each block's first token from the clean
    pass of the block before (the prompt's, for a prompt of whole blocks), as the published loop."""
    write_family(tmp_path, "Fast_dLLM_Qwen")
    loaded = confident(tmp_path, "Fast_dLLM_Qwen")
    seam = FamilySeam(loaded)
    seam.sub_block = 4
    ps = [p + p[:3] for p in prompts()]  # lengths 8, 10, 11, 6
    want = fast_dllm_reference(loaded, ps)
    budgets = [len(w) for w in want]
    alone = [engine_tokens(seam, [p], [n], block=8)[0][0] for p, n in zip(ps, budgets)]
    together, forwards = engine_tokens(seam, ps, budgets, block=8)
    assert alone == want and together == want
    assert min(len(t) / f for t, f in zip(together, forwards)) > 1


def test_fast_dllm_split_steps_run_the_window_as_a_sub_block_step(tmp_path):
    """A step where some rows commit their finished block and wait for its clean pass's token while
    the others draft, split (RowBatch.split_commit: the committing rows' clean pass first), runs
    every row's window as a sub-block step (its head on the sub-block's columns) and gives the
    tokens of each prompt alone and of the published loop."""
    write_family(tmp_path, "Fast_dLLM_Qwen")
    loaded = confident(tmp_path, "Fast_dLLM_Qwen")
    seam = FamilySeam(loaded)
    seam.sub_block = 4
    ps = [p + p[:3] for p in prompts()] + prompts(7)[:3]  # 7 rows of odd lengths
    want = fast_dllm_reference(loaded, ps)
    budgets = [len(w) for w in want]
    engine = Engine(seam, DecodeConfig(block_size=8, threshold=THRESHOLD, max_new_tokens=64))
    engine.batch.split_min_saved = 1  # split whenever a row commits nothing
    calls, forward = [], engine.runner.forward

    def recorded(ids, cache, **kw):
        logits = forward(ids, cache, **kw)
        calls.append((ids.shape[0] > 1 and kw.get("sub_block_head", False), logits.shape[1]))
        return logits

    engine.runner.forward = recorded
    seqs = engine.add(ps, budgets)
    while engine.running:
        engine.step()
    assert [s.token_ids for s in seqs] == want
    assert (True, 4) in calls  # a batch's sub-block step
    assert not any(width == 8 for _, width in calls)  # never every column's logits of a window alone


@pytest.mark.parametrize("model_type, mode, why", [("sdar", "ar", "no shift"), ("sdar", "self_spec", "no shift"),
                                                   ("Fast_dLLM_Qwen", "self_spec", "absolute positions")])
def test_ar_and_self_spec_are_refused_where_meaningless(tmp_path, model_type, mode, why):
    write_family(tmp_path, model_type)
    seam = FamilySeam(confident(tmp_path, model_type))
    with pytest.raises(ValueError, match=why) as e:
        Engine(seam, DecodeConfig(mode=mode, block_size=B))
    assert "\n" not in str(e.value)


def test_fast_dllm_ar_is_its_causal_model(tmp_path):
    """With the shift a block of one token is the AR model: `ar` equals greedy decoding with the
    whole sequence recomputed causally each step."""
    write_family(tmp_path, "Fast_dLLM_Qwen")
    loaded = confident(tmp_path, "Fast_dLLM_Qwen")
    prompt = prompts()[0]
    got = Engine(FamilySeam(loaded), DecodeConfig(mode="ar", max_new_tokens=6)).generate([prompt])[0].token_ids
    x = torch.tensor([prompt])
    for _ in range(6):
        logits = loaded.model(x, block_size=1)[:, -1].index_fill(-1, torch.tensor([loaded.mask_token_id]), float("-inf"))
        x = torch.cat([x, logits.argmax(-1, keepdim=True)], dim=1)
    assert got == x[0, len(prompt):].tolist()


def test_load_gives_the_engine_model_with_published_defaults(tmp_path):
    import clover
    from clover.api import decode_config

    write_family(tmp_path, "sdar")
    model, tok = clover.load(tmp_path, device="cpu")
    assert isinstance(model, FamilySeam) and (model.shift, model.block_align) == (False, "absolute")
    cfg = decode_config(model, tok)
    assert (cfg.block_size, cfg.threshold) == (4, 0.85)  # SDAR's published block and threshold
    assert decode_config(model, tok, threshold=0.5).threshold == 0.5
    out = clover.generate(model, tok, "Hello there", max_new_tokens=6)
    assert len(out.token_ids) == 6 and out.finish_reason in ("length", "stop")


def _clover(*args):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "clover", *args], capture_output=True, text=True, env=env,
                          cwd=root, timeout=600)


def test_cli_generate_on_a_family_folder(tmp_path):
    import json

    write_family(tmp_path, "llada2_moe")
    run = _clover("generate", "--model", str(tmp_path), "--prompt", "Hello", "--max-new-tokens", "7", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["finish_reason"] in ("length", "stop") and out["forward_passes"] >= 1
    run = _clover("generate", "--model", str(tmp_path), "--prompt", "Hello", "--mode", "self_spec")
    assert run.returncode == 2 and "no shift" in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("model_type", ["sdar", "Fast_dLLM_Qwen"])
def test_clover_serve_on_a_family_folder(tmp_path, model_type, monkeypatch, capsys):
    """`clover serve --model DIR` (in-process; uvicorn's run hands over its app): chat and stream with
    the official client through the family's own chat template; /v1/decide answers (its bad bodies
    are 400s; structured output: tests/test_families_structured.py)."""
    import openai
    import uvicorn
    from server_utils import RunningServer, client

    from clover.cli import main
    from clover.models.families import load_tokenizer

    write_family(tmp_path, model_type)
    apps = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: (apps.append(self.config.app),
                                                                             [s.close() for s in sockets or []]))
    assert main(["serve", "--model", str(tmp_path), "--port", "0", "--threads", "1", "--served-model-name", "fam"]) == 0
    monkeypatch.undo()
    messages = [{"role": "user", "content": "Hello there"}]
    tok = load_tokenizer(tmp_path)
    n_prompt = len(tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False).input_ids)
    with RunningServer(apps[0]) as s:
        c = client(s)
        got = c.chat.completions.create(model="fam", messages=messages, max_tokens=6)
        assert got.usage.prompt_tokens == n_prompt and got.usage.completion_tokens <= 6
        assert got.choices[0].finish_reason in ("length", "stop")
        chunks = list(c.chat.completions.create(model="fam", messages=messages, max_tokens=6, stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == got.choices[0].message.content  # greedy: the same reply
        out = c.post("/decide", body={"material": "x", "questions": [{"question": "a?", "options": ["y", "n"]}]},
                     cast_to=dict)  # in the family's blocks (tests/test_families_decide.py)
        assert out["answers"][0]["answer"] in ("y", "n")
        with pytest.raises(openai.BadRequestError, match="at most 8"):
            c.post("/decide", body={"material": "x", "questions": [{"question": "a?", "type": "boolean"}] * 9},
                   cast_to=dict)


@pytest.mark.parametrize("model_type", ["llada2_moe", "Fast_dLLM_Qwen"])
def test_rows_joining_a_running_batch_decode_as_alone(tmp_path, model_type):
    """Continuous batching: a row that joins while others are mid-block (pending commits, rows
    waiting for their first column) gets the tokens it gets alone."""
    write_family(tmp_path, model_type)
    seam = FamilySeam(confident(tmp_path, model_type))
    block = 8 if model_type == "Fast_dLLM_Qwen" else B
    ps, budgets = prompts(5), [13, 9, 17, 11]
    alone = [engine_tokens(seam, [p], [n], block=block)[0][0] for p, n in zip(ps, budgets)]
    engine = Engine(seam, DecodeConfig(block_size=block, threshold=THRESHOLD, max_new_tokens=64))
    seqs = engine.add(ps[:2], budgets[:2])
    for p, n in zip(ps[2:], budgets[2:]):
        for _ in range(3):
            engine.step()
        seqs += engine.add([p], [n])
    while engine.running:
        engine.step()
    assert [s.token_ids for s in seqs] == alone
