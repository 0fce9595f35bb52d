"""Training: the block-diffusion objective, the loop, checkpoints and resume."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from clover.data import tasks
from clover.data.tokenizer import train_tokenizer
from clover.models import CloverForBlockDiffusion, preset_config
from clover.models.modeling_clover import window_ids
from clover.training import Trainer, TrainConfig, lr_factor
from clover.utils import checkpoint_dirs as checkpoints
from clover.training.objectives import (
    ar_loss,
    block_diffusion_loss,
    block_diffusion_loss_naive,
    diffusion_loss_from_logits,
    sample_noise,
    self_spec_loss,
)
from clover.training.trainer import block_sizes_at


def tiny_model():
    model = CloverForBlockDiffusion(preset_config("clover-tiny")).eval()
    with torch.no_grad():  # non-trivial diffusion extras, so every path matters
        for name, p in model.named_parameters():
            if "norm" in name or "right_conv" in name or "block_calibration" in name:
                p.normal_(0, 0.3)
    return model


# ---- the objective ---------------------------------------------------------------------------------
@pytest.mark.parametrize("block,length,suffix_frac", [(4, 21, 0.0), (8, 16, 0.0), (3, 10, 0.0), (8, 21, 0.5)])
def test_vectorised_loss_equals_window_by_window(block, length, suffix_frac):
    model = tiny_model()
    ids = torch.randint(0, 120, (2, length))
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[0, :5] = False  # a prompt: its targets are never masked nor scored
    xt, masked, w = sample_noise(ids, lm, block, 0.2, 0.9, model.config.mask_token_id, torch.Generator().manual_seed(1),
                                 suffix_frac=suffix_frac)
    n = int(lm[:, 1:].sum())
    with torch.no_grad():
        logits = model(ids, noisy_input_ids=xt, block_size=block).logits
        vec = diffusion_loss_from_logits(logits, ids, masked, w, n)
        naive, naive_logits = block_diffusion_loss_naive(model, ids, xt, masked, w, block, n)
    torch.testing.assert_close(logits, naive_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vec, naive, atol=1e-5, rtol=1e-5)
    assert masked.any() and not masked[0, :4].any()


def test_confidence_term_is_the_entropy_of_right_predictions():
    """Vectorised confidence term = a position-by-position loop: the mean entropy over masked targets
    whose argmax is the target, added with its weight; weight 0 leaves the ELBO untouched."""
    gen = torch.Generator().manual_seed(5)
    batch, length, vocab = 3, 13, 7
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    logits = torch.randn(batch, length, vocab, generator=gen) * 3
    logits[:, :-1].scatter_add_(-1, ids[:, 1:, None], torch.full((batch, length - 1, 1), 2.0))  # many right
    masked = torch.rand(batch, length, generator=gen) < 0.6
    masked[:, -1] = False
    weight = masked / 0.6
    n = batch * (length - 1)
    elbo = diffusion_loss_from_logits(logits, ids, masked, weight, n)
    stats = {}
    total = diffusion_loss_from_logits(logits, ids, masked, weight, n, conf_weight=0.3, stats=stats)
    ents, n_masked = [], 0
    for b in range(batch):
        for c in range(length - 1):
            if masked[b, c]:
                n_masked += 1
                p = torch.softmax(logits[b, c].double(), -1)
                if int(p.argmax()) == int(ids[b, c + 1]):
                    ents.append(float(-(p * p.log()).sum()))
    assert 0 < len(ents) < n_masked  # both right and wrong predictions occur
    torch.testing.assert_close(total, elbo + 0.3 * sum(ents) / len(ents), atol=1e-5, rtol=1e-5)
    assert stats["conf_entropy"] == pytest.approx(sum(ents) / len(ents), abs=1e-5)
    assert stats["right_share"] == pytest.approx(len(ents) / n_masked)
    assert torch.equal(diffusion_loss_from_logits(logits, ids, masked, weight, n, conf_weight=0.0), elbo)


def test_confidence_term_sharpens_right_predictions():
    """A few steps on the confidence term alone lower the entropy of the right predictions."""
    torch.manual_seed(0)
    logits = torch.randn(2, 9, 11, requires_grad=True)
    ids = logits.detach()[:, :-1].argmax(-1)
    ids = torch.cat([ids[:, :1], ids], dim=1)[:, :9]  # target of column c = argmax at c: all right
    masked = torch.ones(2, 9, dtype=torch.bool)
    masked[:, -1] = False
    zero = torch.zeros(2, 9)
    opt = torch.optim.SGD([logits], lr=20.0)
    before = {}
    diffusion_loss_from_logits(logits, ids, masked, zero, 1, conf_weight=1.0, stats=before)
    for _ in range(5):
        opt.zero_grad()
        diffusion_loss_from_logits(logits, ids, masked, zero, 1, conf_weight=1.0).backward()
        opt.step()
    after = {}
    diffusion_loss_from_logits(logits, ids, masked, zero, 1, conf_weight=1.0, stats=after)
    assert before["right_share"] == after["right_share"] == 1.0
    assert after["conf_entropy"] < 0.7 * before["conf_entropy"]


def test_suffix_noise_masks_the_end_of_each_window():
    length, block = 23, 8  # windows anchored at the end: the first holds 7 columns
    ids = torch.randint(2, 100, (500, length))
    lm = torch.ones_like(ids, dtype=torch.bool)
    _, masked, w = sample_noise(ids, lm, block, 0.1, 1.0, 1, torch.Generator().manual_seed(3), suffix_frac=1.0)
    wid = window_ids(length, block)
    for k in range(int(wid[-1]) + 1):
        cols = (wid == k).nonzero().flatten()
        m = masked[:, cols]
        if k == int(wid[-1]):
            m = m[:, :-1]  # the row's last column has no target
        # masked columns form a suffix: once a column is masked, every later one is too
        assert (m.cummax(dim=1).values == m).all()
        assert m.any() and (~m).any()
    frac = masked[:, :-1].float().mean().item()
    assert abs(frac - 0.55) < 0.05  # E[t] for t ~ U[0.1, 1]
    assert (w[masked] >= 1).all() and (w[~masked] == 0).all()
    _, mixed, _ = sample_noise(ids, lm, block, 0.1, 1.0, 1, torch.Generator().manual_seed(3), suffix_frac=0.5)
    runs = mixed[:, 15:22]  # a full window: some rows random (holes before a masked column), some suffixes
    holes = (runs.cummax(dim=1).values != runs).any(dim=1).float().mean().item()
    assert 0.15 < holes < 0.5


def test_noise_follows_the_window_rules():
    ids = torch.randint(2, 100, (64, 19))
    lm = torch.ones_like(ids, dtype=torch.bool)
    block = 4
    xt, masked, w = sample_noise(ids, lm, block, 0.1, 1.0, 1, torch.Generator().manual_seed(0), complementary=True)
    wid = window_ids(19, block)
    first = torch.ones(19, dtype=torch.bool)
    first[1:] = wid[1:] != wid[:-1]
    assert (xt[:, first] != 1).all()  # the first column of every window is clean
    assert not masked[:, -1].any()  # the last column has no target
    for c in range(1, 19):  # column c is masked iff its token is a masked target of c's own window
        expect = masked[:, c - 1] & ~first[c]
        assert torch.equal(xt[:, c] == 1, expect)
    half = ids.shape[0]
    assert torch.equal(masked[:half] ^ masked[half:], torch.ones_like(masked[:half]).index_fill_(1, torch.tensor([18]), False))
    assert (w[masked] >= 1).all() and (w[~masked] == 0).all()


def test_block_size_one_is_the_ar_loss():
    model = tiny_model()
    ids = torch.randint(0, 120, (2, 12))
    lm = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        a, _ = block_diffusion_loss(model, ids, lm, 1)
        b = model(ids, labels=ids).loss
    torch.testing.assert_close(a, b)


def test_diffusion_extras_get_gradients():
    """right_conv and block_calibration (zero init) get gradients at once; bidir_log_scale only
    scales a branch whose calibration starts at 0, so it gets them from the second step on."""
    model = CloverForBlockDiffusion(preset_config("clover-tiny")).train()  # extras at their init
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 120, (2, 16))
    ones = torch.ones_like(ids, dtype=torch.bool)
    for step in range(2):
        opt.zero_grad()
        loss, _ = block_diffusion_loss(model, ids, ones, 8, generator=torch.Generator().manual_seed(step))
        loss.backward()
        for name, p in model.named_parameters():
            if any(x in name for x in ("right_conv", "block_calibration")) or (step and "bidir_log_scale" in name):
                assert p.grad is not None and p.grad.abs().sum() > 0, (step, name)
        opt.step()


def test_self_spec_samples_use_a_causal_prefix():
    model = tiny_model()
    ids = torch.randint(2, 120, (2, 20))
    ones = torch.ones_like(ids, dtype=torch.bool)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        loss, n = self_spec_loss(model, ids, ones, 4, 1.0, 1.0, g)  # t = 1: the whole window is masked
        s = int(torch.randint(1, 20 - 4, (1,), generator=torch.Generator().manual_seed(3)))
        window = torch.cat([ids[:, s : s + 1], torch.full((2, 3), model.config.mask_token_id)], dim=1)
        # reference: commit the prefix token by token with a cache, then draft the window
        cache = model.new_cache(2)
        for i in range(s):
            model(ids[:, i : i + 1], cache=cache)
        logits = model(window, cache=cache, block_size=4, draft_len=4).logits
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, s + 1 : s + 5].flatten())
    assert n == 8
    torch.testing.assert_close(loss, ce, atol=1e-5, rtol=1e-5)


def test_schedules():
    cfg = TrainConfig(warmup_steps=10, schedule="cosine", min_lr_ratio=0.1, train_files=["x"], tokenizer="x")
    assert lr_factor(0, cfg, 100) == pytest.approx(0.1) and lr_factor(9, cfg, 100) == pytest.approx(1.0)
    assert lr_factor(100, cfg, 100) == pytest.approx(0.1)
    cfg.schedule = "wsd"
    assert lr_factor(50, cfg, 100) == 1.0 and lr_factor(100, cfg, 100) == pytest.approx(0.1)
    sched = [[0.1, [1]], [0.5, [4]], [1.0, [4, 8]]]
    assert block_sizes_at(0, 100, sched) == [1] and block_sizes_at(20, 100, sched) == [4]
    assert block_sizes_at(99, 100, sched) == [4, 8]


# ---- the loop --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    recs = []
    for i in range(300):
        ex = tasks.make_example(["copy", "add"][i % 2], rng)
        recs.append({"messages": tasks.chat_messages(ex, think=i % 4 == 1)} if i % 3 == 0 else {"text": tasks.plain_text(ex)})
    (d / "train.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    (d / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in recs[:20]))
    train_tokenizer((r.get("text") or r["messages"][1]["content"] for r in recs), 300, d / "tok")
    return d


def tiny_cfg(corpus, out, **kw):
    base = dict(objective="block_diffusion", tokenizer=str(corpus / "tok"), preset="clover-tiny",
                model_overrides={"vocab_size": 300}, train_files=[str(corpus / "train.jsonl")],
                eval_files=[str(corpus / "eval.jsonl")], out_dir=str(out), seq_len=32, batch_size=4,
                max_steps=6, warmup_steps=2, lr=3e-3, log_every=2, eval_every=0, eval_batches=1,
                ckpt_every=3, progress=False, eval_block_size=8, complementary=True,
                block_schedule=[[0.3, [1]], [1.0, [4, 8]]], self_spec_frac=0.3)
    base.update(kw)
    return TrainConfig(**base)


def test_time_budget_plan_grows_back_after_contention():
    from types import SimpleNamespace

    class Bar:
        total = 0

        def refresh(self):
            pass

    cfg = SimpleNamespace(log_every=10, time_budget=1000.0, warmup_steps=5)
    # contention shrank the plan to 100 steps; at step 80 (80% of it) only 300 s of 1000 are spent
    # and steps are fast again (1 s): the plan grows to fill the 700 s left
    run = SimpleNamespace(cfg=cfg, step=80, max_steps=100, elapsed=300.0)
    Trainer._replan(run, 1.0, Bar())
    assert run.max_steps == 80 + 700
    # after 75% of the budget the plan is frozen (the schedule's decay is under way)
    run = SimpleNamespace(cfg=cfg, step=80, max_steps=100, elapsed=760.0)
    Trainer._replan(run, 1.0, Bar())
    assert run.max_steps == 100


def test_loss_falls_on_a_tiny_run(corpus, tmp_path):
    tr = Trainer(tiny_cfg(corpus, tmp_path, objective="ar", max_steps=40, lr=1e-2, ckpt_every=0))
    first = tr.evaluate()["eval_ar_loss"]
    summary = tr.fit()
    assert summary["eval_ar_loss"] < first - 1.0
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("tokens_per_s" in r for r in recs)
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert (tmp_path / "final" / "model.safetensors").exists() and (tmp_path / "final" / "tokenizer.json").exists()


@pytest.mark.parametrize("mix", [{"suffix_frac": 1.0}, {"conf_weight": 0.5}])
def test_held_out_loss_ignores_the_training_mix(corpus, tmp_path, mix):
    plain = Trainer(tiny_cfg(corpus, tmp_path / "a", eval_block_size=8)).evaluate()
    mixed = Trainer(tiny_cfg(corpus, tmp_path / "b", eval_block_size=8, **mix))
    assert mixed.evaluate() == plain
    ids, mask = mixed.eval_rows[:4], mixed.eval_mask[:4]
    stats, held_stats = {}, {}
    trained = mixed._loss(ids, mask, 8, torch.Generator().manual_seed(0), stats=stats)[0]
    elbo = mixed._loss(ids, mask, 8, torch.Generator().manual_seed(0), held_out=True, stats=held_stats)[0]
    assert held_stats == {}
    if "suffix_frac" in mix:
        assert trained != elbo  # the training loss does use the suffix masks
    else:  # an untrained model is rarely right, so the term itself may be ~0: check it ran
        assert "conf_entropy" in stats


def test_chat_eos_pad_pads_training_rows_not_held_out_rows(corpus, tmp_path):
    plain = Trainer(tiny_cfg(corpus, tmp_path / "a"))
    padded = Trainer(tiny_cfg(corpus, tmp_path / "b", chat_eos_pad=5))
    assert torch.equal(padded.eval_rows, plain.eval_rows)
    eos = plain.tok.eos_token_id
    n_chat = sum("messages" in json.loads(x) for x in (corpus / "train.jsonl").read_text().splitlines())
    added = int((padded.rows == eos).sum() - (plain.rows == eos).sum())
    assert abs(added - 5 * n_chat) <= 2 * 32  # pack drops a tail shorter than a row
    with pytest.raises(ValueError, match="chat_eos_pad"):
        tiny_cfg(corpus, tmp_path / "c", chat_eos_pad=-1).validate()


def test_confidence_term_is_logged(corpus, tmp_path):
    tr = Trainer(tiny_cfg(corpus, tmp_path, conf_weight=0.5, self_spec_frac=0.0, max_steps=4, ckpt_every=0))
    tr.fit()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in recs if "conf_entropy" in r]
    assert logged and all(r["conf_entropy"] > 0 and 0 <= r["right_share"] <= 1 for r in logged)


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_resume_is_bit_for_bit(corpus, tmp_path):
    straight = Trainer(tiny_cfg(corpus, tmp_path / "a"))
    straight.fit()
    # the same run, stopped after the step-3 checkpoint and resumed in a new Trainer
    first = Trainer(tiny_cfg(corpus, tmp_path / "b"))
    for _ in range(3):
        first.train_step()
    first.save_checkpoint()
    del first
    resumed = Trainer(tiny_cfg(corpus, tmp_path / "b"), resume=True)
    assert resumed.step == 3
    resumed.fit()
    wa, wb = _weights(tmp_path / "a" / "final"), _weights(tmp_path / "b" / "final")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    # the checkpoint's state loads with weights_only
    st = torch.load(tmp_path / "b" / "checkpoints" / "step_000006" / "trainer_state.pt", weights_only=True)
    assert st["step"] == 6


def test_checkpoint_is_a_whole_model_folder(corpus, tmp_path):
    import clover
    from clover.cli import UserError

    tr = Trainer(tiny_cfg(corpus, tmp_path, max_steps=2))
    tr.train_step()
    ck = tr.save_checkpoint()
    model, tok = clover.load(ck, device="cpu")
    assert clover.generate(model, tok, "to be", max_new_tokens=3).token_ids
    for f in ck.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(UserError, match="no tokenizer files"):
        clover.load(ck, device="cpu")


def test_interrupted_checkpoint_keeps_the_last_good_one(corpus, tmp_path, monkeypatch):
    tr = Trainer(tiny_cfg(corpus, tmp_path, max_steps=6))
    for _ in range(3):
        tr.train_step()
    good = tr.save_checkpoint()
    before = _weights(good)
    tr.train_step()

    def crash(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        tr.save_checkpoint()
    monkeypatch.undo()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert not (tmp_path / "checkpoints" / "step_000004").exists()
    after = _weights(good)
    assert all(torch.equal(before[k], after[k]) for k in before)
    resumed = Trainer(tiny_cfg(corpus, tmp_path, max_steps=6), resume=True)
    assert resumed.step == 3


def test_cli_train_and_user_errors(corpus, tmp_path, capsys):
    from clover.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'objective = "ar"\ntokenizer = "{corpus / "tok"}"\npreset = "clover-tiny"\n'
                   f'model_overrides = {{ vocab_size = 300 }}\ntrain_files = ["{corpus / "train.jsonl"}"]\n'
                   f"seq_len = 16\nbatch_size = 2\nwarmup_steps = 1\nthreads = 1\n")
    args = ["train", "--config", str(cfg), "--out-dir", str(tmp_path / "o"), "--max-steps", "2", "--no-progress"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    assert main(args + ["--objective", "gan"]) == 2
    assert "objective" in capsys.readouterr().err
    assert main(args + ["--resume", "--out-dir", str(tmp_path / "empty")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert main(args + ["--block-schedule", "[[1.0, [0]]]"]) == 2
    assert "block_schedule" in capsys.readouterr().err


def test_shipped_default_model_is_consistent():
    from pathlib import Path

    import clover

    folder = Path(clover.__file__).parent / "assets" / "default"
    if not (folder / "config.json").exists():
        pytest.skip("no default model built yet (make model)")
    weights = folder / "model.safetensors"
    assert weights.stat().st_size <= 50 * 1024 * 1024
    tensors = load_file(str(weights))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    cfg = json.loads((folder / "config.json").read_text())
    from clover.data.tokenizer import load_tokenizer

    tok = load_tokenizer(folder)
    assert cfg["mask_token_id"] == tok.mask_token_id and cfg["vocab_size"] >= len(tok)
    assert "enable_thinking" in tok.chat_template
    recipe = json.loads((folder / "recipe.json").read_text())
    assert recipe["command"] == "make model" and "ar_stage" in recipe


# ---- checkpoints under faults: a kill or an error at every point of the save sequence -------------------
class Killed(BaseException):
    """A fault injected into the save sequence (BaseException: like Ctrl-C, cleanup handlers run)."""


class SaveProbe:
    """Hooks every file-system change the save sequence makes (open for writing, mkdir, rename,
    replace, unlink, rmdir: rmtree's steps included). Before each one it copies the checkpoint
    folder: the state a kill -9 at that instant leaves. Files that changed since the previous point
    (by inode, so a renamed folder's files are not "changed") may be half-written there, so each
    point also gets a torn copy with those files cut to half. With `fail_at`, the hook raises
    Killed at that point instead."""

    OS_CALLS = ("replace", "rename", "unlink", "remove", "rmdir", "mkdir")

    def __init__(self, ckdir, snaps, fail_at=None):
        self.ckdir, self.snaps, self.fail_at = ckdir, snaps, fail_at
        self.points, self.busy, self.seen = 0, False, self._files()

    def _files(self):
        import os

        out = {}
        for p in self.ckdir.rglob("*") if self.ckdir.exists() else []:
            if p.is_file():
                st = os.stat(p)
                out[st.st_ino] = (st.st_size, st.st_mtime_ns, p)
        return out

    def point(self, what):
        import shutil

        if self.busy:
            return
        self.busy = True
        try:
            k = self.points
            self.points += 1
            if self.fail_at is not None:
                if k == self.fail_at:
                    raise Killed(what)
                return
            now = self._files()
            changed = [p for ino, (size, mtime, p) in now.items() if self.seen.get(ino, (None, None))[:2] != (size, mtime)]
            self.seen = now
            snap = self.snaps / f"{k:03d}" / "checkpoints"
            shutil.copytree(self.ckdir, snap) if self.ckdir.exists() else snap.mkdir(parents=True)
            if changed:
                torn = self.snaps / f"{k:03d}t" / "checkpoints"
                shutil.copytree(self.ckdir, torn)
                for p in changed:
                    q = torn / p.relative_to(self.ckdir)
                    q.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
        finally:
            self.busy = False

    def install(self, monkeypatch):
        import builtins
        import io
        import os

        def hook(name, real):
            def call(*a, **k):
                self.point(name)
                return real(*a, **k)
            return call

        for name in self.OS_CALLS:
            monkeypatch.setattr(os, name, hook(name, getattr(os, name)))
        real_open = builtins.open

        def opener(file, mode="r", *a, **k):
            if any(c in mode for c in "wxa+"):
                self.point(f"open {file}")
            return real_open(file, mode, *a, **k)

        monkeypatch.setattr(builtins, "open", opener)
        monkeypatch.setattr(io, "open", opener)


def _checkpoint_content(ck):
    state = torch.load(ck / "trainer_state.pt", weights_only=True)
    return state["step"], load_file(str(ck / "model.safetensors"))


def _trained_to(corpus, out, steps, **kw):
    """A trainer with checkpoints at every step up to `steps` (keep 2); {step: weights} of each."""
    tr = Trainer(tiny_cfg(corpus, out, max_steps=8, **kw))
    weights = {}
    for _ in range(steps):
        tr.train_step()
        weights[tr.step] = _weights(tr.save_checkpoint())
    return tr, weights


@pytest.mark.parametrize("again", [False, True], ids=["new-step", "same-step"])
def test_a_kill_at_any_point_of_a_save_resumes_from_the_newest_complete_checkpoint(corpus, tmp_path, monkeypatch, again):
    """kill -9 frozen at every file-system step of a save (each write also torn in half): resume takes
    the newest complete checkpoint: the one being saved once its folder is renamed into place (before
    `latest` names it), else the one before; never a half-written or half-deleted one. `same-step`:
    the save replaces a folder of the same step (the end of a run whose last step saved already)."""
    tr, weights = _trained_to(corpus, tmp_path / "run", 2)  # step_000001, step_000002
    if not again:
        tr.train_step()
    weights[tr.step] = {k: v.clone() for k, v in tr.model.state_dict().items() if k in weights[2]}
    ckdir = tmp_path / "run" / "checkpoints"
    probe = SaveProbe(ckdir, tmp_path / "snaps")
    with monkeypatch.context() as m:
        probe.install(m)
        tr.save_checkpoint()
    probe.point("done")
    assert probe.points > 15  # every write, rename and deletion of the sequence was a kill point
    newest = tr.step
    in_place = False
    for snap in sorted((tmp_path / "snaps").iterdir()):
        ck = checkpoints.find_checkpoint(snap / "checkpoints")
        assert ck is not None, snap.name
        step, w = _checkpoint_content(ck)
        in_place = in_place or not snap.name.endswith("t") and (snap / "checkpoints" / f"step_{newest:06d}").is_dir()
        assert step == (newest if in_place else 2), snap.name  # nothing lost once renamed in; never older than 2
        assert w.keys() == weights[step].keys() and all(torch.equal(w[k], weights[step][k]) for k in w), snap.name
    assert in_place
    # the case seen: killed after the rename, before `latest` was written; --resume continues from it
    stale = [s for s in sorted((tmp_path / "snaps").iterdir()) if (s / "checkpoints" / f"step_{newest:06d}").is_dir()
             and (s / "checkpoints" / "latest").read_text().strip() != f"step_{newest:06d}"]
    if not again:
        assert stale
        resumed = Trainer(tiny_cfg(corpus, stale[0], max_steps=8), resume=True)
        assert resumed.step == newest


def test_an_error_at_any_point_of_a_save_loses_nothing_and_the_next_save_works(corpus, tmp_path, monkeypatch):
    """An exception (disk full, Ctrl-C) at each point of the save sequence in turn: resume still finds
    the newest complete checkpoint, and the same save, run again, completes and is found."""
    import shutil

    tr, weights = _trained_to(corpus, tmp_path / "run", 2)
    tr.train_step()
    ckdir = tmp_path / "run" / "checkpoints"
    base = tmp_path / "base"
    shutil.copytree(ckdir, base)
    counting = SaveProbe(ckdir, tmp_path / "count", fail_at=-1)
    with monkeypatch.context() as m:
        counting.install(m)
        tr.save_checkpoint()
    for k in range(counting.points):
        shutil.rmtree(ckdir)
        shutil.copytree(base, ckdir)
        probe = SaveProbe(ckdir, None, fail_at=k)
        with monkeypatch.context() as m:
            probe.install(m)
            with pytest.raises(Killed):
                tr.save_checkpoint()
        step, _ = _checkpoint_content(checkpoints.find_checkpoint(ckdir))
        assert step in (2, 3), k
        tr.save_checkpoint()
        assert checkpoints.find_checkpoint(ckdir).name == "step_000003", k
        assert sorted(p.name for p in ckdir.iterdir()) == ["latest", "step_000002", "step_000003"], k


def test_resume_flags_win_or_fail_in_one_line(corpus, tmp_path):
    tr, _ = _trained_to(corpus, tmp_path, 4)
    # --max-steps given on resume wins over the checkpoint's plan (8)
    resumed = Trainer(tiny_cfg(corpus, tmp_path, max_steps=5), resume=True)
    assert resumed.step == 4 and resumed.fit()["step"] == 5
    # so does the learning rate (the optimiser state restored the old one)
    again = Trainer(tiny_cfg(corpus, tmp_path, max_steps=7, lr=1e-4), resume=True)
    assert [g["lr"] for g in again.opt.param_groups] == [pytest.approx(1e-4 * lr_factor(5, again.cfg, 7))] * 2
    with pytest.raises(ValueError, match="max_steps 3 is before checkpoint step_000005's step 5"):
        Trainer(tiny_cfg(corpus, tmp_path, max_steps=3), resume=True)
    with pytest.raises(ValueError, match="seed cannot change on resume"):
        Trainer(tiny_cfg(corpus, tmp_path, seed=1), resume=True)
    # a fresh run does not mix its checkpoints with an earlier run's
    with pytest.raises(ValueError, match="holds checkpoints of an earlier run"):
        Trainer(tiny_cfg(corpus, tmp_path))
