"""Training across processes (torchrun, gloo, 2 CPU processes): FSDP2 equals one process on the same
global batch, and its sharded checkpoints resume on a different number of processes."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from clover.models import CloverForBlockDiffusion, preset_config
from clover.training import Trainer, TrainConfig
from clover.training.objectives import Shard, ar_loss, block_diffusion_loss, self_spec_loss

from distributed_utils import make_corpus, torchrun, train_toml as _toml

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("dcorpus"))


def _losses(out):
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], k): r[k] for r in recs for k in ("loss", "eval_ar_loss", "eval_bd8_loss", "conf_entropy")
            if k in r}


def _weights(folder):
    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The config and one process's 20-step run: the reference of the multi-process runs."""
    tmp = tmp_path_factory.mktemp("ref")
    cfg = _toml(corpus, tmp / "c.toml")
    Trainer(TrainConfig(**_cfg_dict(cfg, tmp / "one"))).fit()
    return cfg, tmp / "one"


def _same_run(ref_out, out, after_step=0):
    a, b = _losses(ref_out), _losses(out)
    a = {k: v for k, v in a.items() if k[0] > after_step}
    assert a.keys() == b.keys() and len(a) >= 10
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5), k
    wa, wb = _weights(ref_out / "final"), _weights(out / "final")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=5e-5, msg=k)  # seen: <= 1.2e-5 after 20 Adam steps


def _resume_alone(ck, out, cfg):
    """Resume checkpoint `ck` (written under torchrun) in one plain process, into `out`."""
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(ck, out / "checkpoints" / ck.name)
    (out / "checkpoints" / "latest").write_text(ck.name)
    tr = Trainer(TrainConfig(**_cfg_dict(cfg, out)), resume=True)
    assert tr.step == 10
    tr.fit()


def test_fsdp_on_two_ranks_equals_one_process_and_resumes_on_one(reference, tmp_path):
    """20 steps (odd batch 5 split 3 + 2, gradient accumulation, clipping, complementary masking,
    self-spec samples, the confidence term): the same losses (1e-5 relative) and final weights as one
    process on the same global batch; the 2-rank step-10 checkpoint resumed by ONE process continues
    identically."""
    cfg, one = reference
    two = tmp_path / "two"
    r = torchrun(2, ["train", "--config", str(cfg), "--out-dir", str(two)])
    summary = json.loads(r.stdout)  # rank 0 alone prints
    assert summary["world_size"] == 2 and summary["step"] == 20
    ck = two / "checkpoints" / "step_000010"
    assert (ck / "dcp" / ".metadata").is_file() and len(list((ck / "dcp").glob("*.distcp"))) == 2
    assert not list((two / "checkpoints").glob(".*tmp"))
    _same_run(one, two)
    _resume_alone(ck, tmp_path / "three", cfg)
    _same_run(one, tmp_path / "three", after_step=10)


def test_expert_parallel_on_two_ranks_equals_no_ep(reference, tmp_path):
    """--ep 2: each rank owns half the experts (tokens exchanged by all-to-all), FSDP2 shards the
    rest; the same losses and weights as one process; its checkpoint resumes in one process, and
    the one-process checkpoint resumes under EP."""
    cfg, one = reference
    ep = tmp_path / "ep"
    summary = json.loads(torchrun(2, ["train", "--config", str(cfg), "--out-dir", str(ep), "--ep", "2"]).stdout)
    assert summary["experts_per_rank"] == preset_config("clover-tiny").num_experts // 2
    _same_run(one, ep)
    _resume_alone(ep / "checkpoints" / "step_000010", tmp_path / "alone", cfg)
    _same_run(one, tmp_path / "alone", after_step=10)
    # and the other way: the one-process run's step-10 checkpoint resumed on 2 ranks with EP
    back = tmp_path / "back"
    (back / "checkpoints").mkdir(parents=True)
    shutil.copytree(one / "checkpoints" / "step_000010", back / "checkpoints" / "step_000010")
    (back / "checkpoints" / "latest").write_text("step_000010")
    torchrun(2, ["train", "--config", str(cfg), "--out-dir", str(back), "--ep", "2", "--resume"])
    _same_run(one, back, after_step=10)


def test_ep_needs_its_processes(corpus, tmp_path):
    with pytest.raises(ValueError, match="needs torchrun with 2 processes"):
        Trainer(TrainConfig(**{**_cfg_dict(_toml(corpus, tmp_path / "c.toml"), tmp_path / "o"), "ep": 2}))


def _cfg_dict(toml_path, out):
    import tomllib

    d = tomllib.loads(toml_path.read_text())
    d["out_dir"] = str(out)
    return d


@pytest.mark.parametrize("kind", ["ar", "bd", "bd_comp", "spec"])
def test_shard_losses_add_up_to_the_batch_loss(kind):
    """In one process: the shards' losses (and gradients) sum to the whole batch's, the random draws
    being the same (each shard draws them for the whole batch)."""
    model = CloverForBlockDiffusion(preset_config("clover-tiny"))
    ids = torch.randint(0, 120, (5, 19))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :4] = False

    def run(shard):
        model.zero_grad()
        gen = torch.Generator().manual_seed(3)
        if kind == "ar":
            loss, n = ar_loss(model, ids, mask, shard)
        elif kind == "spec":
            loss, n = self_spec_loss(model, ids, mask, 4, 0.1, 1.0, gen, shard)
        else:
            loss, n = block_diffusion_loss(model, ids, mask, 4, 0.1, 1.0, gen, kind == "bd_comp", 0.3, shard=shard)
        loss.backward()
        return float(loss.detach()), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    full, n_full, g_full = run(None)
    parts = [run(Shard(lo, hi, 2, None)) for lo, hi in ((0, 3), (3, 5))]
    assert all(n == n_full for _, n, _ in parts)
    assert sum(p[0] for p in parts) == pytest.approx(full, rel=1e-5)
    for k, g in g_full.items():
        torch.testing.assert_close(sum(p[2][k] for p in parts if k in p[2]), g, rtol=1e-4, atol=1e-6, msg=k)


def test_recompute_gives_the_same_steps(corpus, tmp_path):
    """Activation recomputation (what the memory plan assumes) changes memory, not the numbers."""
    import tomllib

    d = tomllib.loads(_toml(corpus, tmp_path / "c.toml", max_steps=3, ckpt_every=0, eval_every=0).read_text())
    plain = Trainer(TrainConfig(**{**d, "out_dir": str(tmp_path / "a")}))
    again = Trainer(TrainConfig(**{**d, "out_dir": str(tmp_path / "b"), "recompute": True}))
    saved = {"a": 0, "b": 0}

    def counting(key):
        def pack(t):
            saved[key] += t.numel()
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    for _ in range(3):
        with counting("a"):
            a = plain.train_step()
        with counting("b"):
            b = again.train_step()
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert 0 < saved["b"] < saved["a"] / 3  # the layers' internals are not kept for the backward
    for (n, p), (_, q) in zip(plain.model.named_parameters(), again.model.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)
