"""Fill policies and sampling on hand-built logits, and the engine's block bookkeeping driven by a
scripted stand-in model (so every expected count is exact)."""

from types import SimpleNamespace

import torch

from clover.engine import DecodeConfig, Engine, SamplingParams, make_policy, sample
from clover.engine.policies import margin, neg_entropy, select_count, select_threshold

V, MASK, EOS = 16, 15, 14


def probs_for(best, conf):
    """[1, len(best), V] distributions: `conf[j]` on token best[j], the rest spread over the others."""
    p = torch.full((1, len(best), V), 0.0)
    for j, (t, c) in enumerate(zip(best, conf)):
        p[0, j, :MASK] = (1 - c) / (MASK - 1)
        p[0, j, t] = c
    return p


def test_confidence_equal_to_threshold_is_not_filled():
    probs = probs_for([1, 2, 3], [0.95, 0.96, 0.95])
    chosen = make_policy("low_confidence", 3, 0.95).select(probs, probs.argmax(-1), torch.ones(1, 3, dtype=torch.bool), torch.zeros(1, dtype=torch.long))
    assert chosen.tolist() == [[False, True, False]]


def test_all_below_threshold_fills_exactly_the_best_leftmost():
    score = torch.tensor([[0.3, 0.7, 0.2, 0.7], [0.1, 0.1, 0.1, 0.1]])
    masked = torch.tensor([[True, True, True, True], [False, True, True, True]])
    assert select_threshold(score, masked, 0.95).tolist() == [[False, True, False, False], [False, True, False, False]]


def test_a_step_that_passes_only_after_the_predicted_end_also_fills_the_best_up_to_it():
    score = torch.tensor([[0.5, 0.4, 0.6, 0.99], [0.5, 0.97, 0.6, 0.99], [0.7, 0.4, 0.6, 0.2]])
    masked = torch.ones(3, 4, dtype=torch.bool)
    ends = torch.tensor([[False, False, True, True], [False, False, True, True], [False, True, False, True]])
    # row 0: only the position after the first end (col 2) passes: the best of cols 0-2 (the end) joins it;
    # row 1: col 1, before the end, passes: nothing forced; row 2: none passes, the best up to col 1
    assert select_threshold(score, masked, 0.95, ends).tolist() == [
        [False, False, True, True], [False, True, False, True], [True, False, False, False]]
    assert select_threshold(score, masked, 0.95).tolist() == [  # without ends: as before
        [False, False, False, True], [False, True, False, True], [True, False, False, False]]


def naive_select_threshold(score, masked, threshold, ends):
    out = []
    for s, m, e in zip(score.tolist(), masked.tolist(), ends.tolist()):
        chosen = [mj and sj > threshold for sj, mj in zip(s, m)]
        first_end = next((j for j in range(len(s)) if m[j] and e[j]), len(s))
        pool = [j for j in range(min(first_end + 1, len(s))) if m[j]]
        if pool and not any(chosen[j] for j in pool):
            chosen[max(pool, key=lambda j: (s[j], -j))] = True
        out.append(chosen)
    return out


def test_end_aware_threshold_selection_equals_a_naive_loop_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        score = torch.rand(5, 8, generator=g).round(decimals=1)  # ties included
        masked, ends = torch.rand(5, 8, generator=g) < 0.7, torch.rand(5, 8, generator=g) < 0.3
        t = float(torch.rand(1, generator=g))
        assert select_threshold(score, masked, t, ends).tolist() == naive_select_threshold(score, masked, t, ends)


def test_filled_positions_are_never_refilled_and_full_rows_fill_nothing():
    score = torch.tensor([[0.99, 0.1], [0.99, 0.99]])
    masked = torch.tensor([[False, True], [False, False]])
    assert select_threshold(score, masked, 0.95).tolist() == [[False, True], [False, False]]


def test_threshold_zero_fills_all_and_one_fills_one():
    score = torch.rand(2, 8) * 0.5 + 0.2
    masked = torch.ones(2, 8, dtype=torch.bool)
    assert select_threshold(score, masked, 0.0).all()
    assert select_threshold(score, masked, 1.0).sum(1).tolist() == [1, 1]


def test_count_selection_ranks_with_leftmost_ties():
    score = torch.tensor([[0.5, 0.9, 0.5, 0.5, 0.1]])
    masked = torch.tensor([[True, True, True, True, False]])
    assert select_count(score, masked, torch.tensor([3])).tolist() == [[True, True, True, False, False]]


def test_topk_budget_finishes_the_block_in_steps():
    policy = make_policy("topk", 8, steps=3)
    masked = torch.ones(1, 8, dtype=torch.bool)
    counts = []
    for step in range(3):
        probs = torch.softmax(torch.randn(1, 8, V), -1)
        chosen = policy.select(probs, probs.argmax(-1), masked, torch.tensor([step]))
        counts.append(int(chosen.sum()))
        masked &= ~chosen
    assert counts == [3, 3, 2] and not masked.any()


def test_entropy_and_margin_scores():
    sharp, flat = torch.tensor([0.9, 0.05, 0.05]), torch.tensor([0.5, 0.45, 0.05])
    probs = torch.stack([flat, sharp])[None]
    assert (neg_entropy(probs, None)[0, 1] > neg_entropy(probs, None)[0, 0]).item()
    assert torch.allclose(margin(probs, None)[0], torch.tensor([0.05, 0.85]))


def test_mask_token_is_never_predicted():
    logits = torch.zeros(2, 3, V)
    logits[..., MASK] = 50.0
    tokens, probs = sample(logits, SamplingParams(), MASK)
    assert (tokens != MASK).all() and (probs[..., MASK] == 0).all()
    tokens, _ = sample(logits, SamplingParams(temperature=1.0, seed=0), MASK, torch.Generator().manual_seed(0))
    assert (tokens != MASK).all()
    assert logits[0, 0, MASK] == 50.0  # the caller's logits are left alone


def test_sampling_is_seeded_and_filters():
    logits = torch.randn(4, 8, V)
    draw = lambda p: sample(logits, p, MASK, torch.Generator().manual_seed(p.seed))[0]
    hot = SamplingParams(temperature=1.5, seed=3)
    assert torch.equal(draw(hot), draw(hot))
    greedy = sample(logits, SamplingParams(), MASK)[0]
    assert torch.equal(draw(SamplingParams(temperature=1.0, top_k=1, seed=1)), greedy)
    assert torch.equal(draw(SamplingParams(temperature=1.0, top_p=1e-6, seed=1)), greedy)


# ---- the engine's block logic against a scripted model ---------------------------------------------
class ScriptedModel:
    """Stand-in model: at call c, draft column j predicts script[c][j] = (token, confidence)."""

    def __init__(self, script):
        self.script = script
        self.calls = 0
        self.device = torch.device("cpu")
        self.config = SimpleNamespace(mask_token_id=MASK, max_position_embeddings=64, max_block_size=64)

    def new_cache(self, rows, capacity):
        return SimpleNamespace(select_rows=lambda idx: None)

    def __call__(self, ids, logits_to_keep=0, logits_index=None, **_):
        best, conf = zip(*self.script[min(self.calls, len(self.script) - 1)])
        self.calls += 1
        logits = probs_for(best, conf).log().expand(ids.shape[0], -1, -1)[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits if logits_index is None else logits[:, logits_index])


def run_scripted(script, max_new_tokens=4, threshold=0.95, sampling=SamplingParams(), mode="low_confidence"):
    model = ScriptedModel(script)
    cfg = DecodeConfig(mode=mode, block_size=len(script[0]), threshold=threshold, max_new_tokens=max_new_tokens,
                       eos_token_ids=(EOS,), sampling=sampling)
    return Engine(model, cfg).generate([[1, 2, 3]])[0], model.calls


def test_eos_mid_block_ends_generation_and_drops_what_follows():
    hi, lo = 0.99, 0.5
    seq, calls = run_scripted([[(4, hi), (5, lo), (EOS, hi), (6, hi)], [(4, hi), (5, hi), (EOS, hi), (6, hi)]], 8)
    # step 0 fills 4, EOS, 6; 6 follows the EOS and is dropped; step 1 fills the gap before the EOS
    assert seq.token_ids == [4, 5, EOS] and seq.finish_reason == "stop"
    assert seq.trajectory == [(0, 0), (0, 1), (0, 0)] and calls == seq.forward_passes == 2


def test_threshold_zero_fills_each_block_in_one_step():
    seq, calls = run_scripted([[(4, 0.3), (5, 0.2), (6, 0.1), (7, 0.4)]], max_new_tokens=10, threshold=0.0)
    assert seq.token_ids == [4, 5, 6, 7, 4, 5, 6, 7, 4, 5] and seq.finish_reason == "length"
    assert calls == seq.forward_passes == 3  # the last block is partial: 2 of its 4 targets


def test_threshold_one_fills_one_token_per_step_most_confident_first():
    seq, calls = run_scripted([[(4, 0.3), (5, 0.2), (6, 0.1), (7, 0.4)]], max_new_tokens=4, threshold=1.0)
    assert seq.token_ids == [4, 5, 6, 7] and calls == 4
    assert [step for _, step in seq.trajectory] == [1, 2, 3, 0]


def test_top_k_1_and_a_tiny_top_p_decode_what_greedy_decodes_in_the_same_steps():
    """The policies judge confidence on the model's distribution, not on the truncated one the token is
    drawn from (one-hot at top_k=1: every position would pass the threshold at once)."""
    script = [[(4, 0.3), (5, 0.2), (6, 0.1), (7, 0.4)], [(4, 0.6), (5, 0.97), (6, 0.5), (7, 0.4)]]
    assert run_scripted(script, max_new_tokens=8)[1] > 2  # greedy low_confidence: more than a step per block
    for mode in ("low_confidence", "margin"):
        greedy = run_scripted(script, max_new_tokens=8, mode=mode)
        for sampling in (SamplingParams(temperature=1.0, top_k=1, seed=0), SamplingParams(temperature=0.7, top_p=1e-6, seed=1)):
            seq, calls = run_scripted(script, max_new_tokens=8, sampling=sampling, mode=mode)
            assert (seq.token_ids, seq.trajectory, calls) == (greedy[0].token_ids, greedy[0].trajectory, greedy[1])


def test_sampled_scores_are_the_models_distribution():
    logits = torch.randn(3, 5, V)
    _, want = sample(logits, SamplingParams(), MASK)
    for params in (SamplingParams(temperature=0.5, top_k=2, seed=0), SamplingParams(temperature=2.0, top_p=0.3, seed=0)):
        tokens, probs = sample(logits, params, MASK, torch.Generator().manual_seed(0))
        assert torch.equal(probs, want) and (want.gather(-1, tokens[..., None]) > 0).all()


def test_an_end_tail_confident_beyond_the_end_costs_no_forwards(monkeypatch):
    """The tail after the answer's end grows more confident to the right (as the default model's does
    on free text): without the end rule each step fills only the tail's best, moving the end left by
    one, and the kept tokens wait; with it the end is filled first and the answer after it."""
    script = [[(4, 0.5), (5, 0.4), (EOS, 0.6), (EOS, 0.8), (EOS, 0.9), (EOS, 0.99)]]
    seq, calls = run_scripted(script, max_new_tokens=8)
    assert seq.token_ids == [4, 5, EOS] and seq.finish_reason == "stop"
    assert calls == seq.forward_passes == 3 and seq.trajectory == [(0, 1), (0, 2), (0, 0)]
    from clover.engine import policies
    plain = policies.select_threshold
    monkeypatch.setattr(policies, "select_threshold", lambda score, masked, t, ends=None: plain(score, masked, t))
    before, before_calls = run_scripted(script, max_new_tokens=8)
    assert before.token_ids == seq.token_ids and before_calls == 6
