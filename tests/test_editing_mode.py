"""LLaDA2.1's editing decode as an engine mode (engine/editing.py): the engine's tokens and forwards
equal the published algorithm's naive loop (reference_generate.llada2_generate with
editing_threshold / max_post_steps: every forward a full recompute of the prefix), alone and in a
batch of prompts of different lengths, on a random-weight LLaDA2 folder in its published layout
(fp32, a sharpened head so several tokens fill per forward and edits happen)."""

from __future__ import annotations

import pytest
import torch
from test_families import confident, write_family
from test_families_engine import budget, prompts  # the same prompts (odd lengths) and budgets

from clover.engine import DecodeConfig, Engine
from clover.models.family_seam import FamilySeam
from clover.models.reference_generate import llada2_generate

B, THRESHOLD = 4, 0.3


@pytest.fixture(scope="module")
def seam(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llada2")
    write_family(folder, "llada2_moe")
    return FamilySeam(confident(folder, "llada2_moe", peak=3.0))


def reference(seam, prompt, edit_threshold, max_post_steps):
    out, forwards = llada2_generate(seam.family_model, torch.tensor([prompt]), seam.config.mask_token_id, budget(len(prompt)),
                                    block_length=B, steps=B, threshold=THRESHOLD, editing_threshold=edit_threshold,
                                    max_post_steps=max_post_steps)
    return out[0, len(prompt):].tolist(), forwards


def engine_run(seam, batch, **settings):
    cfg = DecodeConfig(block_size=B, threshold=THRESHOLD, max_new_tokens=64, mode="editing", **settings)
    engine = Engine(seam, cfg)
    seqs = engine.add(batch, [budget(len(p)) for p in batch])
    while engine.running:
        engine.step()
    return [s.token_ids for s in seqs], [s.forward_passes for s in seqs]


@pytest.mark.parametrize("edit_threshold, max_post_steps", [(0.0, 16), (0.5, 16), (0.0, 0), (0.2, 2)])
def test_engine_equals_the_published_editing_loop(seam, edit_threshold, max_post_steps):
    ps = prompts()
    want = [reference(seam, p, edit_threshold, max_post_steps) for p in ps]
    settings = dict(edit_threshold=edit_threshold, max_post_steps=max_post_steps)
    alone = [engine_run(seam, [p], **settings) for p in ps]
    tokens, forwards = engine_run(seam, ps, **settings)
    assert [(t[0], f[0]) for t, f in alone] == want
    assert list(zip(tokens, forwards)) == want
    assert all(len(t) == budget(len(p)) and seam.config.mask_token_id not in t for (t, _), p in zip(want, ps))


def test_edits_happen_and_change_the_output(seam):
    """The test can fail: with every change allowed the output differs from plain low_confidence
    for some prompt, and a threshold no probability passes is low_confidence plus one post forward
    per block that finds nothing to edit."""
    ps = prompts()
    plain = Engine(seam, DecodeConfig(block_size=B, threshold=THRESHOLD, max_new_tokens=64))
    plain_seqs = plain.add(ps, [budget(len(p)) for p in ps])
    while plain.running:
        plain.step()
    base = [s.token_ids for s in plain_seqs]
    edited, _ = engine_run(seam, ps, edit_threshold=0.0, max_post_steps=16)
    assert edited != base
    never, forwards = engine_run(seam, ps, edit_threshold=1.0, max_post_steps=4)
    assert never == base
    assert forwards == [s.forward_passes + 3 for s in plain_seqs]  # three blocks each


def test_eos_cuts_the_block_and_ends_the_row(seam):
    """A block is handed out cut after its first EOS (as decoded after the edits), and the row ends."""
    ps = prompts()
    tokens, _ = engine_run(seam, ps[:1], edit_threshold=0.0, max_post_steps=16)
    eos = tokens[0][5]
    cfg = DecodeConfig(block_size=B, threshold=THRESHOLD, max_new_tokens=64, mode="editing", edit_threshold=0.0,
                       eos_token_ids=(eos,))
    seq = Engine(seam, cfg).generate(ps[:1])[0]
    cut = tokens[0].index(eos)
    assert seq.token_ids == tokens[0][: cut + 1] and seq.finish_reason == "stop"


def test_editing_refused_where_it_means_nothing(tmp_path):
    write_family(tmp_path, "Fast_dLLM_Qwen")
    seam = FamilySeam(confident(tmp_path, "Fast_dLLM_Qwen"))
    with pytest.raises(ValueError, match="mode editing needs") as e:
        Engine(seam, DecodeConfig(mode="editing", block_size=8))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("setting, value", [("edit_threshold", 1.5), ("max_post_steps", -1), ("threshold", 2.0)])
def test_bad_settings_name_themselves(setting, value):
    with pytest.raises(ValueError, match=setting):
        DecodeConfig(mode="editing", **{setting: value})


def test_reachable_from_the_api_and_the_cli(tmp_path, capsys):
    import json

    import clover
    from clover.cli import main

    write_family(tmp_path, "llada2_moe")
    model, tok = clover.load(tmp_path, device="cpu")
    out = clover.generate(model, tok, "Hello there", max_new_tokens=6, mode="editing", threshold=0.5,
                          edit_threshold=0.0, max_post_steps=2)
    assert len(out.token_ids) == 6
    args = ["generate", "--model", str(tmp_path), "--prompt", "Hello there", "--max-new-tokens", "6", "--json",
            "--mode", "editing", "--threshold", "0.5", "--edit-threshold", "0", "--max-post-steps", "2"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["text"] == out.text
    assert main(args[:-1] + ["-3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "max_post_steps" in err and "\n" not in err


@pytest.mark.timeout(1800)
def test_compiled_runner_gives_the_eager_tokens(seam):
    """The editing step (`edit_step`, fused by the runner) and the family's steps as compiled graphs:
    the same tokens and forwards as the eager runner, for a batch of prompts of different lengths."""
    ps = prompts()[:3]
    settings = dict(edit_threshold=0.0, max_post_steps=4)
    want = engine_run(seam, ps, **settings)
    assert engine_run(seam, ps, runner="compiled", **settings) == want


def test_reachable_from_the_server(tmp_path):
    """A request's extra body fields choose the mode and its settings: the reply is the engine's."""
    import openai
    from server_utils import RunningServer, client

    import clover
    from clover.api import eos_ids
    from clover.server import Settings, create_app

    write_family(tmp_path, "llada2_moe")
    model, tok = clover.load(tmp_path, device="cpu")
    editing = {"mode": "editing", "threshold": 0.5, "edit_threshold": 0.0, "max_post_steps": 2}
    want = clover.generate(model, tok, "Hello there", max_new_tokens=6, block_size=4, **editing)
    settings = Settings(model_id="fam", block_size=4, max_batch=4, max_queue=8)
    with RunningServer(create_app(model, tok, settings, eos_ids(model, tok))) as s:
        c = client(s)
        got = c.completions.create(model="fam", prompt="Hello there", max_tokens=6, extra_body=editing)
        assert got.choices[0].text == want.text
        with pytest.raises(openai.BadRequestError, match="edit_threshold"):
            c.completions.create(model="fam", prompt="Hello there", max_tokens=6,
                                 extra_body={**editing, "edit_threshold": 1.5})
