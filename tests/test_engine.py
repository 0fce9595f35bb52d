"""The engine on a tiny random Clover model: batching, caching, self-speculation, accounting."""

import pytest
import torch

from clover.engine import DecodeConfig, Engine, SamplingParams
from clover.models import CloverForBlockDiffusion, preset_config

B = 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1234)
    m = CloverForBlockDiffusion(preset_config("clover-tiny")).eval()
    m.lm_head.weight.data *= 40  # peaked distributions, so that thresholds like 0.5 fill several per step
    return m


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    lengths = [1, 2, 9, 17, 5]
    return [torch.randint(0, 120, (n,), generator=g).tolist() for n in lengths]


def run(model, prompts, **kw):
    kw.setdefault("block_size", B)
    kw.setdefault("prefill_chunk", 8)  # several prefill chunks for the longer prompts
    return Engine(model, DecodeConfig(**kw)).generate(prompts)


@pytest.mark.parametrize("mode,extra", [("low_confidence", {"threshold": 0.5}), ("ar", {}), ("self_spec", {}),
                                        ("margin", {"steps": 3})])
def test_batch_equals_single(model, prompts, mode, extra):
    batch = run(model, prompts, mode=mode, max_new_tokens=12, **extra)
    for p, got in zip(prompts, batch):
        alone = run(model, [p], mode=mode, max_new_tokens=12, **extra)[0]
        assert (got.token_ids, got.trajectory, got.finish_reason) == (alone.token_ids, alone.trajectory, alone.finish_reason)
        assert len(got.token_ids) == 12


def reference_low_confidence(model, prompt, n, threshold):
    """Uncached: every step recomputes the whole sequence [prefix ; window] from scratch."""
    mask = model.config.mask_token_id
    seq, out, traj = list(prompt), [], []
    while len(out) < n:
        k = min(B, n - len(out))
        window, filled, step = [seq[-1]] + [mask] * (B - 1), {}, 0
        while len(filled) < k:
            ids = torch.tensor([seq[:-1] + window])
            logits = model(ids, block_size=B, draft_len=B, clean_block_size=B).logits[0, -B:].clone()
            logits[:, mask] = float("-inf")
            conf, tok = torch.softmax(logits, -1).max(-1)
            open_ = [j for j in range(k) if j not in filled]
            pick = [j for j in open_ if conf[j] > threshold] or [max(open_, key=lambda j: (conf[j], -j))]
            for j in pick:
                filled[j] = (int(tok[j]), step)
                if j + 1 < B:
                    window[j + 1] = int(tok[j])
            step += 1
        out += [filled[j][0] for j in range(k)]
        traj += [(len(traj) // B, filled[j][1]) for j in range(k)]
        seq += [filled[j][0] for j in range(k)]
    return out, traj


@pytest.mark.parametrize("mode,extra", [("low_confidence", {"threshold": 0.5}), ("topk", {"steps": 3})])
def test_greedy_pick_equals_the_distribution_path(model, prompts, mode, extra, monkeypatch):
    """Greedy steps of probability-scored policies take each column's token and probability straight
    from the logits (ops/greedy_pick); through the full distribution (`sample_and_score`, as entropy /
    margin run) the same rows decode to the same tokens in the same steps."""
    from clover.engine.policies import Policy

    fast = run(model, prompts, mode=mode, max_new_tokens=12, sampling=SamplingParams(suppress=(5,)), **extra)
    monkeypatch.setattr(Policy, "by_probability", property(lambda self: False))
    slow = run(model, prompts, mode=mode, max_new_tokens=12, sampling=SamplingParams(suppress=(5,)), **extra)
    assert [(s.token_ids, s.trajectory, s.forward_passes) for s in fast] == \
        [(s.token_ids, s.trajectory, s.forward_passes) for s in slow]
    assert all(5 not in s.token_ids for s in fast)


def test_head_runs_only_on_masked_columns(model, prompts):
    """Draft steps compute logits only for the columns still masked in some row (the equality with
    full recomputation is the test below); the first step of a block needs all B."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[1]))
    try:
        got = run(model, [prompts[3]], threshold=0.95, max_new_tokens=16)[0]
    finally:
        hook.remove()
    drafts = seen[1:]  # seen[0]: the prefill's last column
    steps = [s for _, s in got.trajectory]
    assert len(drafts) == got.forward_passes and drafts.count(B) == 2  # one full head per block
    assert sum(drafts) == sum(B - sum(1 for s in steps[b * B:(b + 1) * B] if s < k)
                              for b in range(2) for k in range(max(steps[b * B:(b + 1) * B]) + 1))


@pytest.mark.parametrize("threshold", [0.95, 0.5])
def test_cached_decoding_equals_uncached_recomputation(model, prompts, threshold):
    prompt = prompts[3]
    got = run(model, [prompt], threshold=threshold, max_new_tokens=13)[0]
    want_tokens, want_traj = reference_low_confidence(model, prompt, 13, threshold)
    assert got.token_ids == want_tokens
    assert [s for _, s in got.trajectory] == [s for _, s in want_traj]
    steps_per_block = {}
    for block, step in want_traj:
        steps_per_block[block] = max(steps_per_block.get(block, 0), step + 1)
    assert got.forward_passes == sum(steps_per_block.values())


def test_ar_equals_uncached_greedy(model, prompts):
    prompt, mask = prompts[2], model.config.mask_token_id
    seq = list(prompt)
    for _ in range(10):
        logits = model(torch.tensor([seq])).logits[0, -1].clone()
        logits[mask] = float("-inf")
        seq.append(int(logits.argmax()))
    assert run(model, [prompt], mode="ar", max_new_tokens=10)[0].token_ids == seq[len(prompt):]


def test_self_spec_is_lossless(model, prompts):
    g = torch.Generator().manual_seed(3)
    many = prompts + [torch.randint(0, 120, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (7,), generator=g)]
    ar = run(model, many, mode="ar", max_new_tokens=24)
    spec = run(model, many, mode="self_spec", max_new_tokens=24)
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]


def test_self_spec_saves_forwards_when_drafts_agree(prompts):
    """A model whose predictions depend mostly on position (shared embedding + a little per token):
    its parallel drafts often match its own AR output, so verification accepts long prefixes."""
    torch.manual_seed(1234)
    m = CloverForBlockDiffusion(preset_config("clover-tiny")).eval()
    w = m.model.embed_tokens.weight.data
    w.copy_(w[:1] + 0.3 * w)
    ar = run(m, prompts, mode="ar", max_new_tokens=32)
    spec = run(m, prompts, mode="self_spec", max_new_tokens=32)
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]
    assert sum(s.forward_passes for s in spec) < 0.75 * sum(a.forward_passes for a in ar)


class CountingModel(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0
        self.config = inner.config

    def forward(self, *args, **kw):
        self.calls += 1
        return self.inner(*args, **kw)

    @property
    def device(self):
        return self.inner.device

    def new_cache(self, *args, **kw):
        return self.inner.new_cache(*args, **kw)


@pytest.mark.parametrize("mode", ["low_confidence", "ar", "self_spec"])
def test_forward_passes_are_counted_honestly(model, prompts, mode):
    counting = CountingModel(model)
    seq = run(counting, [prompts[3]], mode=mode, max_new_tokens=11)[0]
    prefill_only = 1  # 16 clean prompt tokens in chunks of 8: the second chunk is fused with decoding
    assert seq.forward_passes == counting.calls - prefill_only
    if mode == "ar":
        assert seq.forward_passes == 11


def test_eos_stops_and_is_kept_last(model, prompts):
    full = run(model, [prompts[2]], mode="ar", max_new_tokens=16)[0].token_ids
    eos = full[6]
    for mode in ("ar", "self_spec"):
        seq = run(model, [prompts[2]], mode=mode, max_new_tokens=16, eos_token_ids=(eos,))[0]
        assert seq.token_ids == full[: full.index(eos) + 1] and seq.finish_reason == "stop"


def test_prompt_over_context_fails_before_any_work(model):
    counting = CountingModel(model)
    ctx = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="context of 1024"):
        run(counting, [[1, 2], [3] * (ctx - 10)], max_new_tokens=20)
    assert counting.calls == 0


def test_seeded_sampling_is_reproducible(model, prompts):
    kw = dict(max_new_tokens=10, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=5))
    a, b = run(model, prompts[:2], **kw), run(model, prompts[:2], **kw)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    with pytest.raises(ValueError, match="greedy"):
        run(model, prompts[:1], mode="self_spec", **kw)


@pytest.mark.parametrize("mode", ["low_confidence", "ar", "self_spec"])
def test_requests_added_between_steps_equal_alone(model, prompts, mode):
    """Continuous batching: a request joining a running batch decodes as it would alone."""
    engine = Engine(model, DecodeConfig(mode=mode, block_size=B, threshold=0.5, max_new_tokens=12, prefill_chunk=8))
    first = engine.add(prompts[:2])
    engine.step()
    assert engine.running
    late = engine.add(prompts[2:4])
    while engine.running:
        engine.step()
    for seq, p in zip(first + late, prompts[:4]):
        alone = run(model, [p], mode=mode, threshold=0.5, max_new_tokens=12)[0]
        assert (seq.token_ids, seq.trajectory) == (alone.token_ids, alone.trajectory)


def test_35b_context_limit_checked_before_any_work():
    with torch.device("meta"):  # shapes only: the check must come before any tensor work
        big = CloverForBlockDiffusion(preset_config("clover-35b-a3b"))
    engine = Engine(big, DecodeConfig(max_new_tokens=72))
    with pytest.raises(ValueError, match=r"prompt 0 \(131001 tokens\) \+ max_new_tokens \(72\) exceeds the model's context of 131072"):
        engine.add([[1] * 131_001])


def test_filled_in_order(model, prompts):
    from clover.engine.trajectory import filled_in_order

    # block 0 fills position 1 first (position 0 still masked), block 1 fills two positions together
    assert filled_in_order([(0, 1), (0, 0), (0, 2), (1, 0), (1, 0)]) == [True, False, True, True, True]
    ar = run(model, prompts, mode="ar", max_new_tokens=11)
    assert all(all(filled_in_order(s.trajectory)) for s in ar)
    lc = run(model, prompts, threshold=0.95, max_new_tokens=11)
    flags = [f for s in lc for f in filled_in_order(s.trajectory)]
    assert len(flags) == sum(len(s.token_ids) for s in lc) and not all(flags)  # a random model fills out of order


def test_steps_run_without_grad_and_enter_no_grad_only_where_grad_is_on(monkeypatch):
    from clover.engine.engine import without_grad

    seen, entered, real = [], [], torch.no_grad
    monkeypatch.setattr(torch, "no_grad", lambda: entered.append(1) or real())

    @without_grad
    def probe(x):
        seen.append(torch.is_grad_enabled())
        return x + 1

    assert probe(1) == 2
    with torch.inference_mode():  # the server's decoding thread: grad is off already
        assert probe(2) == 3
    assert seen == [False, False] and entered == [1]
