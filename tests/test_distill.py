"""Self-distillation (objective "distill"): the teacher cache and the objective's terms."""

import json
import math
import multiprocessing
import os
import signal

import pytest
import torch

from clover.training import TrainConfig, Trainer
from clover.training import distill as D
from clover.training.config import RunStopped
from clover.training.objectives import (ar_loss, ar_terms, block_diffusion_loss, diffusion_loss_from_logits,
                                        distill_loss, kl_from_logits)

from helpers import save_tiny_model, tiny_tokenizer

PROMPTS = ["Copy: abc", "Sort: 3 1 2", "Reverse: xyz", "Add: 12+7", "Copy: hello", "Sort: 9 4", "Lookup: k"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("distill")
    teacher = save_tiny_model(d / "teacher", seed=3, peak=8.0)
    tok = tiny_tokenizer()
    tok.mask_token = "<|mask|>"  # the trainer checks the model's mask id against the tokenizer's
    tok.save_pretrained(teacher)
    recs = [{"prompt": p} for p in PROMPTS] + [{"messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 3}]
    (d / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return d, teacher


def _build(setup, cache, **kw):
    from clover.api import eos_ids, load

    d, teacher = setup
    model, tok = load(teacher, "cpu")
    prompts = D.read_prompts([d / "prompts.jsonl"], tok)
    return D.build_teacher_cache(model, tok, prompts, cache, 6, 3, D.teacher_fingerprint(teacher),
                                 eos_ids(model, tok), progress=False, **kw)


def _parts(cache):
    return {p.name: p.read_bytes() for p in sorted(cache.glob("part_*.jsonl"))}


def test_teacher_cache_is_the_engines_greedy_output_and_deterministic(setup, tmp_path):
    from clover.api import eos_ids, load
    from clover.engine import DecodeConfig, Engine

    recs = _build(setup, tmp_path / "a")
    assert len(recs) == len(PROMPTS) + 1 and len(_parts(tmp_path / "a")) == 3
    again = _build(setup, tmp_path / "b")
    assert again == recs and _parts(tmp_path / "a") == _parts(tmp_path / "b")  # byte for byte
    model, tok = load(setup[1], "cpu")
    first = recs[:3]  # part 0: the same batch through the engine's ar mode
    cfg = DecodeConfig(mode="ar", max_new_tokens=6, eos_token_ids=eos_ids(model, tok))
    seqs = Engine(model, cfg).generate([r["prompt_ids"] for r in first])
    assert [s.token_ids for s in seqs] == [r["output_ids"] for r in first]
    assert len(recs[-1]["output_ids"]) <= 3  # the record's own budget
    assert all(1 <= len(r["output_ids"]) <= 6 for r in recs)


def _killed_at_part_one(setup, cache):
    def die(k):
        if k == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    _build(setup, cache, after_part=die)


@pytest.mark.parametrize("fault", ["exception", "sigkill"])
def test_teacher_cache_resumes_after_a_kill(setup, tmp_path, fault):
    ref = tmp_path / "ref"
    _build(setup, ref)
    cache = tmp_path / "cache"
    if fault == "exception":
        def boom(k):
            if k == 1:
                raise KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            _build(setup, cache, after_part=boom)
    else:
        proc = multiprocessing.get_context("fork").Process(target=_killed_at_part_one, args=(setup, cache))
        proc.start()
        proc.join(120)
        assert proc.exitcode == -signal.SIGKILL
    assert sorted(_parts(cache)) == ["part_000000.jsonl", "part_000001.jsonl"]
    (cache / ".part_000002.jsonl.tmp-1").write_text('{"torn')  # a torn temp file from the kill
    with pytest.raises(ValueError, match="lacks 1 of 3 parts"):
        D.read_teacher_cache(cache)
    done = []
    recs = _build(setup, cache, after_part=done.append)
    assert done == [2]  # only the missing part was generated
    assert _parts(cache) == _parts(ref) and recs == D.read_teacher_cache(ref)


def test_teacher_cache_refuses_other_prompts(setup, tmp_path):
    _build(setup, tmp_path / "c")
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    meta["prompts"] = "0" * 64
    (tmp_path / "c" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="another prompts"):
        _build(setup, tmp_path / "c")


def test_teacher_stream_trains_on_the_answer_only():
    ids, mask = D.teacher_stream([{"prompt_ids": [5, 6, 7], "output_ids": [8, 1]}, {"prompt_ids": [9], "output_ids": [4]}])
    assert ids.tolist() == [5, 6, 7, 8, 1, 9, 4]
    assert mask.tolist() == [False, False, False, True, True, False, True]


# ---- the objective's terms on a hand-checkable example ------------------------------------------------
def _entropy(p):
    return -sum(x * math.log(x) for x in p if x > 0)


def test_certainty_term_by_hand():
    """Two masked targets over a 3-token vocabulary: column 0 predicts its target (probabilities
    .7/.2/.1, target 0), column 1 does not (target 2, argmax 1). The term is the entropy of column 0
    alone; with column 0 wrong too it is exactly zero."""
    p0, p1 = [0.7, 0.2, 0.1], [0.1, 0.6, 0.3]
    logits = torch.tensor([[p0, p1, [1 / 3] * 3]]).log()
    ids = torch.tensor([[1, 0, 2]])  # targets: column 0 -> 0, column 1 -> 2
    masked = torch.tensor([[True, True, False]])
    weight = masked / 0.5
    elbo = (-math.log(0.7) - math.log(0.3)) / 0.5 / 2
    stats = {}
    got = diffusion_loss_from_logits(logits, ids, masked, weight, 2, conf_weight=2.0, stats=stats)
    assert float(got) == pytest.approx(elbo + 2.0 * _entropy(p0), rel=1e-5)
    assert stats["right_share"] == 0.5 and stats["conf_entropy"] == pytest.approx(_entropy(p0), rel=1e-5)
    wrong = torch.tensor([[1, 2, 2]])  # column 0's target now 2: no right prediction
    stats = {}
    got = diffusion_loss_from_logits(logits, wrong, masked, weight, 2, conf_weight=2.0, stats=stats)
    assert stats["conf_entropy"] == 0 and stats["right_share"] == 0
    assert float(got) == pytest.approx((-math.log(0.1) - math.log(0.3)) / 0.5 / 2, rel=1e-5)


def test_distill_loss_is_the_block_loss_plus_the_weighted_ar_loss():
    from clover.models import CloverForBlockDiffusion, preset_config

    torch.manual_seed(0)
    model = CloverForBlockDiffusion(preset_config("clover-tiny")).eval()
    ids = torch.randint(0, 100, (2, 20))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :6] = False
    with torch.no_grad():
        bd, n = block_diffusion_loss(model, ids, mask, 4, generator=torch.Generator().manual_seed(1), conf_weight=0.5)
        ar, _ = ar_loss(model, ids, mask)
        stats = {}
        got, n2 = distill_loss(model, ids, mask, 4, 0.25, stats, generator=torch.Generator().manual_seed(1),
                               conf_weight=0.5)
        at1, _ = distill_loss(model, ids, mask, 1, 0.25)
    assert n == n2 == 2 * 14
    torch.testing.assert_close(got, bd + 0.25 * ar)
    assert stats["bd_loss"] == pytest.approx(float(bd)) and stats["ar_loss"] == pytest.approx(float(ar))
    torch.testing.assert_close(at1, ar)  # block 1 is the AR loss once, not twice
    assert float(ar) > 0.5  # an untrained model: the terms are not trivially zero


def test_kl_term_by_hand():
    """Teacher .5/.3/.2 against student .7/.2/.1 at one column of a 3-token vocabulary: the term is
    sum p_t log(p_t / p_s); zero where the student equals the teacher, masked columns left out; its
    gradient on the student's logits is p_s - p_t, so a descent step raises the tokens the teacher
    likes more than the student does."""
    p_t, p_s = [0.5, 0.3, 0.2], [0.7, 0.2, 0.1]
    t_logits = torch.tensor([[p_t, [0.9, 0.05, 0.05]]]).log()
    s_logits = torch.tensor([[p_s, [0.1, 0.1, 0.8]]]).log().requires_grad_(True)
    mask = torch.tensor([[True, False]])  # the second column is no target: any mismatch there is free
    by_hand = sum(a * math.log(a / b) for a, b in zip(p_t, p_s))
    kl = kl_from_logits(s_logits, t_logits, mask, 1)
    assert float(kl.detach()) == pytest.approx(by_hand, rel=1e-5) and by_hand > 0.05
    assert float(kl_from_logits(t_logits, t_logits, mask, 1)) == pytest.approx(0.0, abs=1e-7)
    kl.backward()
    grad = s_logits.grad[0, 0]
    torch.testing.assert_close(grad, torch.tensor(p_s) - torch.tensor(p_t))
    assert s_logits.grad[0, 1].abs().max() == 0
    stepped = (s_logits.detach() - 0.5 * s_logits.grad).softmax(-1)[0, 0]
    assert stepped[0] < p_s[0] and stepped[2] > p_s[2]  # toward the teacher
    assert float(kl_from_logits(stepped.log()[None, None], t_logits[:, :1], mask[:, :1], 1)) < by_hand


def test_distill_loss_adds_the_weighted_kl_to_a_teacher():
    from clover.models import CloverForBlockDiffusion, preset_config

    torch.manual_seed(0)
    model = CloverForBlockDiffusion(preset_config("clover-tiny")).eval()
    other = CloverForBlockDiffusion(preset_config("clover-tiny")).eval()
    ids = torch.randint(0, 100, (2, 20))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :6] = False
    gen = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    with torch.no_grad():
        plain, _ = distill_loss(model, ids, mask, 4, 0.25, generator=gen())
        stats = {}
        same, _ = distill_loss(model, ids, mask, 4, 0.25, stats, teacher=model, kl_weight=3.0, generator=gen())
        assert stats["ar_kl"] == pytest.approx(0.0, abs=1e-6)  # the student is its own teacher
        torch.testing.assert_close(same, plain)
        ce, kl, n = ar_terms(model, ids, mask, teacher=other)
        got, _ = distill_loss(model, ids, mask, 4, 0.25, teacher=other, kl_weight=3.0, generator=gen())
        at1, n1 = distill_loss(model, ids, mask, 1, 0.25, teacher=other, kl_weight=3.0)
    assert n == n1 == 2 * 14 and float(kl) > 0.01
    torch.testing.assert_close(got, plain + 3.0 * kl)
    torch.testing.assert_close(at1, ce + 3.0 * kl)  # block 1: the AR loss once, plus the KL
    torch.testing.assert_close(ce, ar_loss(model, ids, mask)[0])


# ---- the loop -------------------------------------------------------------------------------------------
def _cfg(setup, out, **kw):
    d, teacher = setup
    base = dict(objective="distill", init=teacher, tokenizer=teacher, train_files=[str(d / "prompts.jsonl")],
                out_dir=str(out), seq_len=24, batch_size=4, max_steps=4, warmup_steps=1, lr=3e-3, log_every=1,
                eval_every=0, ckpt_every=2, progress=False, teacher_max_new_tokens=6, teacher_batch=3,
                block_schedule=[[1.0, [4, 8]]], conf_weight=0.5, ar_weight=0.5)
    base.update(kw)
    return TrainConfig(**base)


def test_distill_trains_on_the_teacher_answers_and_resumes(setup, tmp_path):
    tr = Trainer(_cfg(setup, tmp_path / "run"))
    recs = D.read_teacher_cache(tmp_path / "run" / "teacher")
    ids, mask = D.teacher_stream(recs)
    n = tr.rows.numel()
    assert torch.equal(tr.rows.flatten(), ids[:n]) and torch.equal(tr.rmask.flatten(), mask[:n])
    tr.fit()
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["ar_loss"] > 0 and r["bd_loss"] > 0 for r in logged if "loss" in r)
    again = Trainer(_cfg(setup, tmp_path / "run", max_steps=6), resume=True)  # cache complete: no teacher run
    assert again.step == 4 and torch.equal(again.rows, tr.rows)
    with pytest.raises(ValueError, match="needs a teacher"):
        _cfg(setup, tmp_path / "x", init="").validate()


def test_replay_rows_join_the_teacher_rows(setup, tmp_path):
    d, _ = setup
    (d / "replay.jsonl").write_text("\n".join(json.dumps({"text": f"plain data number {i} " * 3}) for i in range(60)))
    plain = Trainer(_cfg(setup, tmp_path / "a"))
    mixed = Trainer(_cfg(setup, tmp_path / "b", replay_files=[str(d / "replay.jsonl")], replay_frac=0.25))
    n = plain.rows.shape[0]
    assert torch.equal(mixed.rows[:n], plain.rows) and mixed.rows.shape[0] == n + round(n / 3)
    assert mixed.rmask[n:].all()  # replayed text: every token a target
    with pytest.raises(ValueError, match="replay_frac"):
        _cfg(setup, tmp_path / "c", replay_frac=1.0).validate()


def test_distill_fits_the_teacher(setup, tmp_path):
    """A few dozen steps move the student toward the teacher's answers (held-out = the same rows)."""
    tr = Trainer(_cfg(setup, tmp_path / "fit", max_steps=30, lr=1e-2, ckpt_every=0, log_every=5))
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    rows, mask = tr.rows[:4], tr.rmask[:4]
    with torch.no_grad():
        before = float(block_diffusion_loss(tr.model, rows, mask, 4, generator=gen())[0])
    tr.fit()
    with torch.no_grad():
        after = float(block_diffusion_loss(tr.model.eval(), rows, mask, 4, generator=gen())[0])
    assert after < 0.7 * before


def test_kl_weight_loads_a_frozen_teacher_and_logs_the_term(setup, tmp_path):
    tr = Trainer(_cfg(setup, tmp_path / "kl", ar_kl_weight=1.0, lr=1e-2, ckpt_every=0))
    assert tr.teacher_model is not None and not any(p.requires_grad for p in tr.teacher_model.parameters())
    before = [p.clone() for p in tr.teacher_model.parameters()]
    tr.fit()
    logged = [json.loads(x) for x in (tmp_path / "kl" / "metrics.jsonl").read_text().splitlines()]
    kls = [r["ar_kl"] for r in logged if "ar_kl" in r]
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[-1] > 1e-4  # the student starts as the teacher
    assert all(torch.equal(a, b) for a, b in zip(before, tr.teacher_model.parameters()))
    assert Trainer(_cfg(setup, tmp_path / "nokl")).teacher_model is None
    with pytest.raises(ValueError, match="ar_kl_weight"):
        _cfg(setup, tmp_path / "c", ar_kl_weight=-1.0).validate()


def test_stop_after_checkpoints_and_resumes_as_if_not_stopped(setup, tmp_path):
    whole = Trainer(_cfg(setup, tmp_path / "whole", teacher_cache=str(tmp_path / "cache")))
    whole.fit()
    run = tmp_path / "cut"
    stopped = Trainer(_cfg(setup, run, teacher_cache=str(tmp_path / "cache"), stop_after=1e-6)).fit()
    assert stopped["stopped"] and stopped["step"] == 1 and stopped["checkpoint"].endswith("step_000001")
    assert not (run / "final").exists() and not (run / "summary.json").exists()
    again = Trainer(_cfg(setup, run, teacher_cache=str(tmp_path / "cache")), resume=True)
    assert again.step == 1
    assert "stopped" not in again.fit() and (run / "final").is_dir()
    for a, b in zip(whole.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)


def test_stop_after_during_the_teacher_cache_keeps_its_parts(setup, tmp_path):
    cache = tmp_path / "cache"

    def boom(k):
        if k == 0:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        _build(setup, cache, after_part=boom)
    with pytest.raises(RunStopped, match="2 of 3 parts to go"):
        _build(setup, cache, deadline=0.0)
    assert sorted(_parts(cache)) == ["part_000000.jsonl"]
    with pytest.raises(RunStopped):
        Trainer(_cfg(setup, tmp_path / "run", teacher_cache=str(cache), stop_after=1e-6))
    assert _build(setup, cache) == _build(setup, tmp_path / "ref")


def test_clover_train_stopped_in_the_teacher_phase_exits_cleanly(setup, tmp_path, capsys):
    from clover.cli import main

    d, teacher = setup
    code = main(["train", "--objective", "distill", "--init", str(teacher), "--tokenizer", str(teacher),
                 "--train-files", str(d / "prompts.jsonl"), "--out-dir", str(tmp_path / "run"), "--max-steps", "2",
                 "--teacher-batch", "3", "--teacher-max-new-tokens", "6", "--no-progress", "--stop-after", "1e-9"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["stopped"] and "3 of 3 parts to go" in out["reason"]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_interpolate_is_elementwise_between_base_and_tuned():
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(3, 5, generator=g), "h": torch.randn(7, generator=g).to(torch.bfloat16),
            "i": torch.arange(4)}
    tuned = {"w": torch.randn(3, 5, generator=g), "h": torch.randn(7, generator=g).to(torch.bfloat16),
             "i": torch.arange(4) + 1}
    assert torch.equal(D.interpolate(base, tuned, 0.0)["w"], base["w"])
    assert torch.equal(D.interpolate(base, tuned, 1.0)["w"], tuned["w"])
    half = D.interpolate(base, tuned, 0.25)
    for r in range(3):
        for c in range(5):
            b, t = base["w"][r, c].item(), tuned["w"][r, c].item()
            assert half["w"][r, c].item() == pytest.approx(b + 0.25 * (t - b), rel=1e-6, abs=1e-7)
    assert half["h"].dtype == torch.bfloat16
    assert torch.equal(half["h"], (base["h"].float() * 0.75 + tuned["h"].float() * 0.25).to(torch.bfloat16))
    assert torch.equal(half["i"], tuned["i"])  # integer tensors are not averaged
    with pytest.raises(ValueError, match="shape"):
        D.interpolate(base, {**tuned, "w": torch.zeros(5, 3)}, 0.5)
    with pytest.raises(ValueError, match="different tensors"):
        D.interpolate(base, {"w": tuned["w"]}, 0.5)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        D.interpolate(base, tuned, 1.5)
