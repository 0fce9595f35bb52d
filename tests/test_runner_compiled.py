"""CompiledRunner == EagerRunner (fp32 logits within 1e-5, tokens identical), and no recompilation
once warm. Compiling is slow on a small shared CPU (tens of seconds per graph), so the default run
checks one mode (ar, batch 2); CLOVER_COMPILED_TESTS=1 also runs every mode with rows joining and
leaving and self_spec rollback (several minutes)."""

import contextlib
import os
import time

import pytest
import torch

from clover.engine import DecodeConfig, Engine
from clover.compile import RECOMPILE_LIMIT, CompileState, Fused, state_of
from clover.engine import runner as runner_module
from clover.engine.runner import CompiledRunner, EagerRunner
from helpers import runner_calls, tiny_model

FULL = os.environ.get("CLOVER_COMPILED_TESTS") == "1"
full_only = pytest.mark.skipif(not FULL, reason="compiles many graphs: set CLOVER_COMPILED_TESTS=1")


@pytest.fixture(scope="module")
def model():  # two layers (one GDN, one attention): half the compile time of clover-tiny's four
    return tiny_model(99, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


def decode(model, runner, mode, prompts, late=(), budgets=(10, 6), late_budget=5, replay=True, block=4, defer=False,
           draft="diffusion"):
    """Logits of every runner call and the sequences; `late` prompts join after the first step and
    rows with smaller budgets leave early."""
    with runner_calls(runner) as logits:
        engine = Engine(model, DecodeConfig(mode=mode, block_size=block, threshold=0.5, max_new_tokens=max(budgets),
                                            prefill_chunk=4, runner=runner, draft=draft), defer_compile=defer)
        if not replay:
            engine.runner.replay = False  # the RowBatch holds this runner object
        seqs = engine.add(prompts, list(budgets))
        engine.step()
        if late:
            seqs += engine.add(list(late), [late_budget] * len(late))
        while engine.running:
            engine.step()
    return logits, seqs, engine.runner


@contextlib.contextmanager
def eager_flags():
    """While inside: one flag per CompiledRunner call, whether it ran eagerly (a deferred or unsteady shape)."""
    calls, real = [], CompiledRunner.forward

    def counted(self, *a, **kw):
        before = self.eager_calls
        out = real(self, *a, **kw)
        calls.append(self.eager_calls > before)
        return out

    CompiledRunner.forward = counted
    try:
        yield calls
    finally:
        CompiledRunner.forward = real


def graphs(model):  # the model steps' graphs (dynamo) and the modes' fused step functions (`Fused`)
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] + state_of(model).fused_compiles


def assert_same_logits(got, ref):
    """Logits of each call equal; where the eager runner ran the head on some columns only (`index`),
    the compiled runner, whose head costs the same for all (`full_head`), may have returned them all."""
    assert len(got) == len(ref)
    for (a, a_index), (b, b_index) in zip(got, ref):
        if a_index is None and b_index is not None:
            a = a[:, b_index]
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def check_equal(model, mode, prompts, late=(), block=4):
    ref_logits, ref, _ = decode(model, "eager", mode, prompts, late, block=block)
    got_logits, got, runner = decode(model, "compiled", mode, prompts, late, block=block)
    assert [s.token_ids for s in got] == [s.token_ids for s in ref]
    assert [s.forward_passes for s in got] == [s.forward_passes for s in ref]
    assert_same_logits(got_logits, ref_logits)
    assert runner.compiled_calls > runner.eager_calls  # the steps ran compiled, not the eager fallback
    before = graphs(model)
    for replay in (True, False):  # warm: the same shapes replay (the captured graphs), then through dynamo
        again_logits, again, warm = decode(model, "compiled", mode, prompts, late, replay=replay, block=block)
        assert graphs(model) == before, "recompiled in a warm steady decode"
        assert [s.token_ids for s in again] == [s.token_ids for s in ref]
        assert_same_logits(again_logits, ref_logits)
        # replay on: the warm decode's compiled calls skipped dynamo, all of them (self_spec's recorded
        # verifies too: their Replay stores the records on the cache); off: none
        assert warm.compiled_calls > 0
        assert warm.replayed_calls == (warm.compiled_calls if replay else 0)


@pytest.mark.parametrize("mode", ["ar", "low_confidence"])
def test_a_batch_between_buckets_replays_the_bucket_graphs(model, mode):
    """Rows come in buckets (compile.bucket_width): 3 rows run the graphs of 4 with a spare row (the
    model's steps and the mode's fused step), so a server's batch of any size between two buckets
    compiles nothing new; rows leaving (3 -> 2 -> 1) re-home the cache, and every call equals eager."""
    four = [[5, 9, 2, 7, 7, 1, 3, 11, 4], [8, 3, 30, 2, 6, 9, 9, 1, 2], [40, 41, 42, 9, 9, 9, 1, 7, 7],
            [3, 1, 4, 1, 5, 9, 2, 6, 5]]
    decode(model, "compiled", mode, four, budgets=(10, 8, 6, 4))  # rows 4, 3, 2 and 1 (compiled here when run alone)
    three = [[6, 2, 8, 3, 1, 8, 5, 3, 0], [2, 7, 1, 8, 2, 8, 1, 8, 2], [9, 9, 8, 7, 6, 5, 4, 3, 2]]
    before = graphs(model)
    ref_logits, ref, _ = decode(model, "eager", mode, three, budgets=(10, 8, 6))
    got_logits, got, runner = decode(model, "compiled", mode, three, budgets=(10, 8, 6))
    # every graph is made for 1, 2 or 4 rows; ar's steps are the same shapes whatever the tokens, so
    # it compiles nothing (a diffusion decode's window widths depend on when its rows finish blocks)
    assert {key[0][0] for key in runner.state.replays} <= {1, 2, 4}
    assert {layouts[0][0][0] for _, layouts, *_ in runner.state.fused_graphs} <= {1, 2, 4}
    if mode == "ar":
        assert graphs(model) == before, "compiled a graph for 3 rows"
        assert runner.replayed_calls == runner.compiled_calls > 0
    assert runner.eager_calls == 0
    assert [s.token_ids for s in got] == [s.token_ids for s in ref]
    assert_same_logits(got_logits, ref_logits)


def test_deferred_shapes_run_eagerly_until_compiled_when_idle(model):
    """A deferring runner (the server's) runs a shape with no graph eagerly and queues it; once
    `compile_deferred` has compiled the queue (the server does it when idle: nobody waits on a compile
    mid-step), the same decode replays graphs made on zeros of those layouts, equal to eager."""
    prompts = [[5, 9, 2, 7, 7, 1, 3, 11, 4], [8, 3, 30, 2, 6], [40, 41, 42, 9, 9, 9, 1]]
    budgets = (11, 7, 9)  # block 5: shapes no other test compiles
    ref_logits, ref, _ = decode(model, "eager", "low_confidence", prompts, budgets=budgets, block=5)
    before = graphs(model)
    got_logits, got, runner = decode(model, "compiled", "low_confidence", prompts, budgets=budgets, block=5, defer=True)
    assert graphs(model) == before and runner.compiled_calls == 0 and runner.eager_calls > 0  # nothing compiled mid-decode
    assert [s.token_ids for s in got] == [s.token_ids for s in ref]
    assert_same_logits(got_logits, ref_logits)
    waiting = runner_module.deferred(model)
    assert waiting > 0
    while runner_module.compile_deferred(model):
        pass
    assert runner_module.deferred(model) == 0 and graphs(model) > before
    again_logits, again, warm = decode(model, "compiled", "low_confidence", prompts, budgets=budgets, block=5, defer=True)
    assert warm.eager_calls == 0 and warm.replayed_calls == warm.compiled_calls > 0
    assert runner_module.deferred(model) == 0
    assert [s.token_ids for s in again] == [s.token_ids for s in ref]
    assert_same_logits(again_logits, ref_logits)


def test_prompt_chunks_cut_from_longer_prompts_replay(model):
    """A prompt chunk is a slice of its prompt's row, so a longer prompt hands the same chunk shapes
    with another row stride: they must still replay the graphs made for the shorter one (no dynamo
    call, no new graph)."""
    decode(model, "compiled", "ar", [[5, 9, 2, 7, 7, 1, 3, 11, 4, 6]], budgets=(3,))
    before = graphs(model)
    _, _, warm = decode(model, "compiled", "ar", [[8, 3, 30, 2, 6, 1, 1, 4, 9, 12, 5, 2, 7, 3]], budgets=(3,))
    assert graphs(model) == before
    assert warm.replayed_calls == warm.compiled_calls > 0


def test_compiled_ar_equals_eager_batch(model):
    check_equal(model, "ar", [[5, 9, 2, 7, 7, 1, 3, 11, 4], [8, 3, 30, 2, 6]])


def test_compiled_equals_eager_on_bf16_valued_weights(model):
    """A bf16 checkpoint loaded as fp32 (the shipped models): the tiled kernels keep bf16 panels and
    an AR step's experts run tiled (CloverExperts.tiled_pairs = 1); still equal to eager."""
    import copy

    from clover.models.modeling_clover import CloverExperts
    from clover.ops.linear import tiled

    if not tiled.available() or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("bf16 panels need the tiled AVX-512 or AVX2 kernels")
    bf = copy.deepcopy(model)
    with torch.no_grad():
        for p in bf.parameters():
            p.copy_(p.bfloat16().float())
    prompts = [[5, 9, 2, 7, 7, 1, 3, 11, 4], [8, 3, 30, 2, 6]]
    check_equal(bf, "ar", prompts)
    assert all(m.tiled_pairs == 1 for m in bf.modules() if isinstance(m, CloverExperts))
    # bf16 activations (`--linear-dtype bfloat16`, where the CPU has bf16 products): the same graphs
    # follow them, read per call (no recompile), within bf16 rounding of the exact logits
    ref_logits, ref, _ = decode(bf, "compiled", "ar", prompts, budgets=(1, 1))  # one token: no divergence
    before, was = graphs(bf), tiled.use_bf16_activations(True)
    try:
        got_logits, got, _ = decode(bf, "compiled", "ar", prompts, budgets=(1, 1))
    finally:
        tiled.use_bf16_activations(was)
    assert graphs(bf) == before
    assert len(got_logits) == len(ref_logits)
    diffs = [(a - b).abs().max().item() for (a, _), (b, _) in zip(got_logits, ref_logits)]
    scale = max(b.abs().max().item() for b, _ in ref_logits)
    assert max(diffs) <= 2e-2 * scale
    assert max(diffs) > 0 or not tiled.bf16_dot()


@full_only
@pytest.mark.timeout(2400)  # ~10 graphs per mode: over pytest-timeout's 600 s on a loaded 2-core machine
@pytest.mark.parametrize("mode", ["low_confidence", "self_spec", "ar"])
def test_compiled_equals_eager_rows_join_and_leave(model, mode):
    check_equal(model, mode, [[5, 9, 2, 7, 7, 1, 3, 11, 4], [8, 3, 30, 2, 6]], late=[[40, 41, 42, 9, 9, 9, 1]])


@full_only
@pytest.mark.timeout(2400)
def test_compiled_self_spec_of_an_odd_block_equals_eager_and_ar(model):
    """Block 3: a verify of 3 clean columns is left-padded to a 4-column graph (compile.bucket), so the
    recorded segment it rolls back starts with padding; the compiled decode once kept the pad as a
    token and repeated one (the task prompts' accuracy fell from ar's 0.614 to 0.143)."""
    prompts = [[5, 9, 2, 7, 7, 1, 3, 11, 4], [8, 3, 30, 2, 6]]
    check_equal(model, "self_spec", prompts, block=3)
    _, got, _ = decode(model, "compiled", "self_spec", prompts, block=3)
    _, ar, _ = decode(model, "eager", "ar", prompts, block=1)
    assert [s.token_ids for s in got] == [s.token_ids for s in ar]


def test_fused_rollback_states_equal_eager():
    """self_spec's rollback as a compiled runner calls it (`Fused(rolled_states)`, one graph; 3 rows
    run as a bucket of 4) gives the eager function's states within float rounding, the conv states
    exactly, on random records with left padding and odd keeps."""
    from clover.models.cache_clover import rolled_states
    from test_lookup import random_records

    state = CompileState()
    fused = Fused(rolled_states, ("test-rolled",), state)
    g = torch.Generator().manual_seed(1)
    for npad, keep in (([0, 2, 1], [5, 1, 3]), ([1, 0, 0], [2, 5, 4])):
        flat = random_records(g)
        args = (torch.tensor(keep), torch.tensor(npad), *flat)
        got, ref = fused(*args), rolled_states(*args)
        assert len(got) == len(ref) == 4
        for i, (a, b) in enumerate(zip(got, ref)):
            if i % 2:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert state.fused_compiles == 1


@full_only
@pytest.mark.timeout(2400)
def test_compiled_lookup_self_spec_equals_eager_and_ar(model):
    """self_spec with context-lookup drafts on the compiled runner: verifies of a bucketed width,
    AR steps where nothing repeats, the rollback's graph; the tokens are ar's."""
    prompts = [[5, 9, 2, 5, 9, 2, 5, 9, 2], [8, 3, 30, 8, 3]]
    _, ref, _ = decode(model, "eager", "self_spec", prompts, block=3, draft="lookup")
    _, got, _ = decode(model, "compiled", "self_spec", prompts, block=3, draft="lookup")
    _, ar, _ = decode(model, "eager", "ar", prompts, block=1)
    assert [s.token_ids for s in got] == [s.token_ids for s in ar] == [s.token_ids for s in ref]


def test_new_shapes_run_eagerly_once_the_recompile_limit_is_hit(model):
    """Past dynamo's recompile limit (RECOMPILE_LIMIT graphs of the step; here forced to one, which
    the graphs compiled so far already reach) a new shape is not an error (dynamo refuses it before the
    step writes the cache): it runs eagerly, with a warning, and the decode still equals eager; the
    shapes compiled before keep replaying their graphs."""
    prompts = [[5, 9, 2, 7, 7, 1, 3, 11, 4], [8, 3, 30, 2, 6]]
    decode(model, "compiled", "ar", prompts)  # warm: these shapes have graphs (compiled here when run alone)
    three = prompts + [[40, 41, 42, 9, 9, 9, 1]]  # three rows: shapes never compiled
    ref_logits, ref, _ = decode(model, "eager", "ar", three, budgets=(10, 6, 5))
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            _, _, warm = decode(model, "compiled", "ar", prompts)
            assert warm.replayed_calls == warm.compiled_calls > 0 and warm.eager_calls == 0
            with pytest.warns(UserWarning, match="new shapes now run eagerly"):
                got_logits, got, runner = decode(model, "compiled", "ar", three, budgets=(10, 6, 5))
        assert [s.token_ids for s in got] == [s.token_ids for s in ref]
        assert_same_logits(got_logits, ref_logits)
        assert runner.eager_calls > 0 and state_of(model).full
    finally:
        state_of(model).full = False  # the other tests compile new shapes of this model


def test_replay_follows_a_replaced_weight(model):
    """Replays bind the weights by object: a parameter replaced after warm-up (same layout) is read
    by the next replayed step, as the eager runner reads it."""
    prompts = [[5, 9, 2, 7, 7, 1, 3, 11, 4], [8, 3, 30, 2, 6]]
    decode(model, "compiled", "ar", prompts)  # warm (compiles here when run alone)
    old = model.lm_head.weight
    model.lm_head.weight = torch.nn.Parameter(old.detach().flip(0).clone())
    try:
        ref_logits, ref, _ = decode(model, "eager", "ar", prompts)
        got_logits, got, runner = decode(model, "compiled", "ar", prompts)
    finally:
        model.lm_head.weight = old
    assert [s.token_ids for s in got] == [s.token_ids for s in ref]
    assert_same_logits(got_logits, ref_logits)
    assert runner.replayed_calls == runner.compiled_calls > 0


@pytest.mark.parametrize("mode", ["low_confidence", "topk"] + (["entropy", "margin"] if FULL else []))
def test_fused_diffusion_step_equals_eager(mode):
    """The pure functions of a diffusion step compiled as one graph each (`Fused`) give exactly the
    eager functions' outputs on random states: the fill policy and block bookkeeping (`advance`: 3
    rows, an odd block, EOS among the candidates); for probability scores the greedy pick (a custom
    op inside the graph) with `advance` (`pick_and_advance`, banned ids); for the scores that need
    the distribution, greedy sampling + the score (`sample_and_score`, suppressed tokens; its scores
    within float rounding). Each compiled once, then replayed."""
    import functools

    from clover.engine.modes import advance, pick_and_advance, sample_and_score
    from clover.engine.policies import make_policy
    from clover.engine.sampling import SamplingParams

    policy, sampling = make_policy(mode, 5, 0.3, 2), SamplingParams(suppress=(2,))
    step = functools.partial(advance, policy)
    state = CompileState()
    fused_step = Fused(step, ("test-advance", policy), state, shared=(8,))  # 3 rows: run as 4 (a bucket)
    score = functools.partial(sample_and_score, policy, sampling, 1)
    fused_score = Fused(score, ("test-score", policy, sampling, 1), state) if not policy.by_probability else None
    pick = functools.partial(pick_and_advance, policy)  # probability-scored: the greedy pick and `advance` in one
    fused_pick = Fused(pick, ("test-pick", policy), state, shared=(1, 8)) if policy.by_probability else None
    g = torch.Generator().manual_seed(0)
    rows, block, vocab = 3, 5, 37
    before = state.fused_compiles
    for trial in range(6):
        logits = torch.randn(rows, block, vocab, generator=g) * 3
        tokens, scores = score(logits)
        if fused_score is not None:
            got_tokens, got_scores = fused_score(logits)
            assert torch.equal(got_tokens, tokens)  # the scores' sums may run in another order: float rounding
            torch.testing.assert_close(got_scores, scores, rtol=1e-6, atol=1e-6)
        filled = torch.rand(rows, block, generator=g) < 0.4
        args = (tokens, scores, filled,
                torch.randint(0, vocab, (rows, block), generator=g), torch.randint(0, 3, (rows, block), generator=g),
                torch.randint(0, 3, (rows,), generator=g), torch.arange(block)[None, :] < torch.tensor([[5], [3], [4]]),
                torch.randint(0, vocab, (rows, block), generator=g), torch.tensor([0, 3]))
        got, ref = fused_step(*args), step(*args)
        assert len(got) == len(ref) == 7
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype and torch.equal(a, b)
        if fused_pick is not None:
            pick_args = (logits, torch.tensor([2, 1]), *args[2:])
            got, ref = fused_pick(*pick_args), pick(*pick_args)
            assert len(got) == len(ref) == 7 and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, ref))
        # compiled at the first call, replayed after
        assert state.fused_compiles == before + 2


def test_server_settings_choose_the_runner(model):
    """`clover serve --runner compiled` reaches every engine the scheduler builds (not slot jobs)."""
    from clover.server.scheduler import Scheduler
    from clover.settings import DecodeConfig

    for name, cls in (("eager", EagerRunner), ("compiled", CompiledRunner)):
        engine = Engine(model, Scheduler(model, (), runner=name).config(DecodeConfig(block_size=4).engine_key()))
        assert type(engine.runner) is cls


@full_only
@pytest.mark.timeout(1200)
def test_server_with_the_compiled_runner_equals_single_eager_requests(tmp_path):
    """`clover serve --runner compiled`: concurrent streams of different lengths (rows join, share
    steps in row buckets and leave) give the single-request eager replies; new shapes run eagerly and
    are compiled while the server is idle, after which the same traffic replays graphs."""
    import asyncio

    import openai

    import clover
    from clover.api import eos_ids
    from clover.server import Settings, create_app
    from helpers import save_tiny_model
    from server_utils import RunningServer, metric

    model, tokenizer = clover.load(save_tiny_model(tmp_path / "m"))
    prompts = ["the cat", "a dog ran far", "one two three four five", "x", "hello there"]
    budgets = [9, 5, 12, 7, 3]
    refs = [clover.generate(model, tokenizer, p, max_new_tokens=n, block_size=4, threshold=0.5, mode="ar").text
            for p, n in zip(prompts, budgets)]

    async def one(c, prompt, n):
        text = ""
        async for ch in await c.completions.create(model="tiny", prompt=prompt, max_tokens=n, stream=True):
            text += ch.choices[0].text
        return text

    async def go(url):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        out = await asyncio.gather(*(one(c, p, n) for p, n in zip(prompts, budgets)))
        await c.close()
        return out

    settings = Settings(model_id="tiny", block_size=4, threshold=0.5, mode="ar", runner="compiled")
    with eager_flags() as calls:
        with RunningServer(create_app(model, tokenizer, settings, eos_ids(model, tokenizer))) as server:
            got = asyncio.run(go(server.url))
            first, calls[:] = list(calls), []
            deadline = time.time() + 900
            while metric(server, "clover_graphs_deferred") > 0 and time.time() < deadline:
                time.sleep(0.2)
            assert metric(server, "clover_graphs_deferred") == 0 and metric(server, "clover_graphs_compiled_total") > 0
            again = asyncio.run(go(server.url))
    assert got == refs and again == refs
    assert any(first) and len(calls) > sum(budgets) / len(budgets)  # the steps went through the compiled runner
    assert sum(calls) < sum(first)  # fewer eager steps once idle compiled the shapes met


@full_only
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("kind", ["infill", "grammar"])
def test_structured_replies_through_a_compiled_scheduler_equal_eager(tmp_path, kind):
    """Slot jobs (schema infilling, the grammar path) of `--runner compiled`: concurrent structured
    replies equal the eager solo ones while their shapes run eagerly (deferred), and again once the
    idle scheduler compiled them, now through the graphs."""
    import clover
    from helpers import save_tiny_model
    from test_server_slots import ASKS, GRAMMAR, SCHEMA, _concurrent, _reply

    schema = SCHEMA if kind == "infill" else GRAMMAR
    model, tok = clover.load(save_tiny_model(tmp_path / "m"))
    alone = [_reply(model, tok, t, schema) for t in ASKS]
    assert alone[0][1]["method"] == kind

    with eager_flags() as calls:
        # all admitted together both times: the same groups, so the same shapes the second time
        first = _concurrent(model, tok, ASKS, schema, start_after=len(ASKS), runner="compiled")
        first_calls, calls[:] = list(calls), []
        while runner_module.compile_deferred(model):
            pass
        again = _concurrent(model, tok, ASKS, schema, start_after=len(ASKS), runner="compiled")
    assert first == alone and again == alone
    assert any(first_calls) and calls and not any(calls)  # eager while deferred; the second time, graphs only


def test_recompile_limits_hold_in_every_thread_that_compiles(model):
    """dynamo's config is per thread: a thread other than the one that made the model's step (a
    server's scheduler compiling deferred shapes) must compile under the raised limits too, not
    dynamo's default of 8 graphs of `_step` over every model in the process."""
    import threading

    decode(model, "compiled", "ar", [[5, 9, 2, 7, 7, 1, 3, 11, 4], [8, 3, 30, 2, 6]])  # the step made here
    seen, runners = [], []

    def other():  # five rows (graphs of 8 rows: shapes no other test compiles), every call through dynamo
        seen.append(torch._dynamo.config.recompile_limit)
        five = [[5, 9, 2, 7, 7, 1, 3, 11, 4], [8, 3, 30, 2, 6], [1, 2, 3], [4, 4, 4, 4], [9, 8, 7, 6, 5, 4]]
        runners.append(decode(model, "compiled", "ar", five, budgets=(4, 3, 2, 2, 1), replay=False)[2])
        seen.append(torch._dynamo.config.recompile_limit)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen[0] == 8 and seen[1] >= RECOMPILE_LIMIT  # dynamo's default there, then raised
    assert runners[0].eager_calls == 0 and not state_of(model).full
