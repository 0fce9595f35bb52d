"""self_spec's rounds (engine/spec.py): one forward a round that verifies B-1 guesses and the token
after them and drafts the next guesses; byte-identical to greedy `ar` on the tiny and the shipped model,
with batches, rows joining and leaving, odd prompt lengths and an EOS inside a block."""

import pytest
import torch

from clover.engine import DecodeConfig, Engine
from clover.engine import spec
from clover.engine.batch import left_padded
from clover.models import CloverForBlockDiffusion, preset_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1234)
    m = CloverForBlockDiffusion(preset_config("clover-tiny")).eval()
    m.lm_head.weight.data *= 40
    return m


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 120, (n,), generator=g).tolist() for n in (1, 2, 7, 13, 5, 30)]


def run(model, prompts, budgets=None, **kw):
    kw.setdefault("prefill_chunk", 8)
    kw.setdefault("max_new_tokens", 21)
    engine = Engine(model, DecodeConfig(**kw))
    seqs = engine.add(prompts, budgets)
    while engine.running:
        engine.step()
    return seqs


def test_spec_segment_equals_reference():
    """The round's clean segment against a row-by-row build: prompt chunk, last token and `count`
    guesses per row, left-padded as one."""
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        rows, B = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        verify = torch.randint(10, 99, (rows, B), generator=g)
        count = torch.randint(0, B, (rows,), generator=g)
        lengths = torch.randint(0, 6, (rows,), generator=g).tolist()
        chunks = [torch.randint(10, 99, (n,), generator=g).tolist() for n in lengths]
        pending = left_padded(chunks, verify.device) if trial % 3 and any(chunks) else None
        if pending is None:
            chunks = [[] for _ in range(rows)]
        (ids, pad), committed = spec.spec_segment(pending, verify, count)
        pad = pad if pad is not None else torch.zeros_like(ids, dtype=torch.bool)
        want = [c + verify[r, : int(count[r]) + 1].tolist() for r, c in enumerate(chunks)]
        width = ids.shape[1]
        assert width == max(map(len, want))
        for r, w in enumerate(want):
            assert pad[r].tolist() == [True] * (width - len(w)) + [False] * len(w)
            assert ids[r, width - len(w):].tolist() == w
        assert committed.tolist() == [len(c) for c in chunks]


@pytest.mark.parametrize("block", [1, 3, 4, 8])
def test_self_spec_equals_ar_batched_rows_leaving(model, prompts, block):
    """Rows of odd prompt lengths with their own budgets (they leave at different rounds)."""
    budgets = [21, 5, 13, 1, 9, 17]
    ar = run(model, prompts, budgets, mode="ar", block_size=block)
    got = run(model, prompts, budgets, mode="self_spec", block_size=block)
    assert [s.token_ids for s in got] == [s.token_ids for s in ar]
    assert [len(s.token_ids) for s in got] == budgets


def test_self_spec_eos_mid_block(model, prompts):
    full = run(model, prompts, mode="ar", block_size=1)
    eos = full[2].token_ids[5]  # inside the first block of 8 after the first round's token
    ar = run(model, prompts, mode="ar", eos_token_ids=(eos,))
    got = run(model, prompts, mode="self_spec", block_size=8, eos_token_ids=(eos,))
    assert [(s.token_ids, s.finish_reason) for s in got] == [(s.token_ids, s.finish_reason) for s in ar]
    assert got[2].token_ids[-1] == eos and got[2].finish_reason == "stop"


def test_rows_joining_equal_ar_and_alone(model, prompts):
    engine = Engine(model, DecodeConfig(mode="self_spec", block_size=4, max_new_tokens=15, prefill_chunk=8))
    first = engine.add(prompts[:3], [15, 4, 11])
    engine.step()
    engine.step()
    late = engine.add(prompts[3:], [15, 2, 9])  # one joins while others verify guesses
    engine.step()
    later = engine.add(prompts[:1], [7])
    while engine.running:
        engine.step()
    budgets = [15, 4, 11, 15, 2, 9, 7]
    for seq, p, n in zip(first + late + later, prompts + prompts[:1], budgets):
        ar = run(model, [p], [n], mode="ar")[0]
        alone = run(model, [p], [n], mode="self_spec", block_size=4)[0]
        assert seq.token_ids == ar.token_ids
        assert (seq.trajectory, seq.forward_passes) == (alone.trajectory, alone.forward_passes)


def test_perfect_guesses_take_a_block_a_forward(model, prompts, monkeypatch):
    """With every guess right (the ar answer put in), the first round takes one token and each
    later one B: the round structure's own ceiling."""
    B = 4
    answers = {tuple(s.prompt_ids): s.token_ids for s in run(model, prompts, mode="ar", max_new_tokens=23)}
    consume = spec.SelfSpecMode.consume

    def oracle(self, batch, logits):
        events = consume(self, batch, logits)
        self.state.guess = torch.tensor([(answers[tuple(s.prompt_ids)] + [0] * 2 * B)[len(s.token_ids):][:B]
                                         for s in batch.seqs], dtype=torch.long)
        return events

    monkeypatch.setattr(spec.SelfSpecMode, "consume", oracle)
    got = run(model, prompts, mode="self_spec", block_size=B, max_new_tokens=23)
    assert [s.token_ids for s in got] == list(answers.values())
    assert [s.forward_passes for s in got] == [1 + -(-22 // B)] * len(prompts)


def test_default_model_self_spec_equals_ar_on_task_prompts():
    from clover.api import load
    from clover.eval import pareto
    from clover.eval.generation import generate_until
    from clover.settings import eos_ids

    model, tok = load()
    eos = eos_ids(model, tok)
    exs = pareto.examples(2)
    ctx, budgets = [e["prompt"] + "\n" for e in exs], [e["budget"] for e in exs]
    _, ar = generate_until(model, tok, ctx, budgets, ["\n"], "ar", 1, 0.0, eos_token_ids=eos)
    for block in (4, 8):
        _, got = generate_until(model, tok, ctx, budgets, ["\n"], "self_spec", block, 0.0, eos_token_ids=eos)
        for a, s in zip(ar, got):
            n = len(a.token_ids)  # ar stops at the newline; a round may take tokens past it
            assert s.token_ids[:n] == a.token_ids
        assert sum(len(s.token_ids) for s in got) > 1.5 * sum(s.forward_passes for s in got)
