"""Long contexts. Memory: no single allocation of a prefill (the engine's chunked one) or of a decode
step grows with the square of the context, and a step copies no cache (bench/long_context.py
measures the time and RSS); the probe is checked against a forward that does grow so: the whole
prompt in one forward, whose attention mask is [L, L]. Scheduling: a long prompt prefills chunk by
chunk between the decoding steps of the running rows, which it never stalls for longer than a chunk."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from clover.engine import DecodeConfig, Engine
from clover.models import CloverForBlockDiffusion, preset_config
from clover.server.scheduler import RowJob, Scheduler

CHUNK = 64


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return CloverForBlockDiffusion(preset_config("clover-tiny", max_position_embeddings=4096)).eval()


def largest_allocation(fn) -> int:
    """Bytes of the largest memory any single op allocated itself while `fn` ran (CPU profiler)."""
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.self_cpu_memory_usage for e in prof.events())


def prompt(length: int) -> list[int]:
    return torch.randint(2, 100, (length,), generator=torch.Generator().manual_seed(length)).tolist()


@pytest.mark.parametrize("mode, block", [("ar", 1), ("low_confidence", 8)])
def test_prefill_and_decode_allocations_grow_at_most_linearly(model, mode, block):
    def run(length):
        cfg = DecodeConfig(mode=mode, block_size=block, max_new_tokens=2 * block, prefill_chunk=CHUNK)
        return lambda: Engine(model, cfg).generate([prompt(length)])

    small, large = largest_allocation(run(1024)), largest_allocation(run(2048))
    assert large <= 2.3 * small, (small, large)


def test_decode_step_allocations_grow_at_most_linearly(model):
    def step_at(length):
        cache = model.new_cache(1, capacity=length + 16)
        ids = torch.tensor([prompt(length)])
        with torch.inference_mode():
            for a in range(0, length, CHUNK):
                model(ids[:, a:a + CHUNK], cache=cache, logits_to_keep=1)
        return lambda: model(ids[:, :8], cache=cache, block_size=8, draft_len=8, logits_to_keep=8)

    small, large = largest_allocation(step_at(1024)), largest_allocation(step_at(2048))
    assert large <= 2.3 * small, (small, large)


@pytest.mark.parametrize("draft", [0, 8])
def test_a_decode_step_copies_no_cache(model, draft):
    """The keys a step attends to are the cache's own storage: no allocation of a step is as large as
    one attention layer's K over the context (a cat of the cache and the new keys would be)."""
    length = 2048
    cache = model.new_cache(1, capacity=length + 16)
    ids = torch.tensor([prompt(length)])
    with torch.inference_mode():
        for a in range(0, length, CHUNK):
            model(ids[:, a:a + CHUNK], cache=cache, logits_to_keep=1)
    layer = next(iter(cache.key.values()))
    one_layer_k = length * layer.shape[1] * layer.shape[3] * layer.element_size()
    n = draft or 1
    step = largest_allocation(lambda: model(ids[:, :n], cache=cache, block_size=8, draft_len=draft, logits_to_keep=n))
    assert step < one_layer_k / 2, (step, one_layer_k)


def test_the_probe_sees_a_quadratic_allocation(model):
    """One unchunked forward of the whole prompt builds an [L, L] mask: 4x at 2L."""
    def whole(length):
        ids = torch.tensor([prompt(length)])
        return lambda: model(ids, cache=model.new_cache(1, capacity=length), logits_to_keep=1)

    small, large = largest_allocation(whole(1024)), largest_allocation(whole(2048))
    assert large > 3.5 * small, (small, large)


@pytest.mark.parametrize("mode, block", [("ar", 1), ("low_confidence", 8)])
def test_a_long_prompt_prefills_between_the_running_rows_steps(model, mode, block):
    """`add(interleave=True)`: the running rows get a decoding forward between every two prefill
    chunks of a long prompt, and every row's output equals its output alone."""
    cfg = DecodeConfig(mode=mode, block_size=block, threshold=0.5, max_new_tokens=48, prefill_chunk=CHUNK)
    short, long = [prompt(5), prompt(12)], prompt(20 * CHUNK + 3)
    engine = Engine(model, cfg)
    calls, forward = [], engine.runner.forward

    def counted(ids, cache, **kw):
        calls.append(cache is engine.batch.cache)
        return forward(ids, cache, **kw)

    engine.runner.forward = counted
    first = engine.add(short)
    engine.step()
    late = engine.add([long], interleave=True)
    assert engine.prefilling == late and late[0] not in engine.seqs
    start = len(calls)
    while engine.prefilling:
        engine.step()
    during = calls[start:]  # True: the running rows' forward; False: a chunk of the long prompt
    assert engine.batch.prefill_forwards(long) == 20
    assert during.count(False) == 21  # and the last chunk less its last clean window (which rides with the rows' step)
    assert all(a or b for a, b in zip(during, during[1:])), "two prefill chunks with no decoding step between"
    assert all(not s.finished for s in first)  # they were decoding all along
    while engine.running:
        engine.step()
    for seq, p in zip(first + late, short + [long]):
        alone = Engine(model, cfg).generate([p])[0]
        assert (seq.token_ids, seq.trajectory) == (alone.token_ids, alone.trajectory)


def test_a_row_cancelled_while_it_prefills_leaves(model):
    engine = Engine(model, DecodeConfig(mode="ar", block_size=1, max_new_tokens=8, prefill_chunk=CHUNK))
    engine.add([prompt(5)])
    [seq] = engine.add([prompt(4 * CHUNK)], interleave=True)
    engine.step()
    engine.finish(seq)
    assert seq.finished and not engine.prefilling
    while engine.running:
        engine.step()
    assert seq not in engine.seqs and not seq.token_ids


class Mailbox:
    """A ticket whose posts are kept (no event loop)."""

    def __init__(self):
        self.events = []

    def post(self, item):
        self.events.append(item)


def test_the_server_prefills_a_long_prompt_between_the_other_rows_tokens(model):
    """The scheduler's loop (admit, then one step of every engine), driven by hand so the order is
    fixed: a long prompt that arrives while a row decodes prefills one chunk per turn, the running
    row gets tokens at every turn, and the long request's reply equals its reply alone."""
    key = DecodeConfig(mode="ar", block_size=1, prefill_chunk=CHUNK).engine_key()
    sched = Scheduler(model, (), max_batch=4)
    short, long = RowJob(Mailbox(), 0, prompt(5), 64, key), RowJob(Mailbox(), 0, prompt(12 * CHUNK + 5), 6, key)
    with torch.inference_mode():
        sched._admit([short])
        sched._step_all()
        sched._admit([long])
        engine = sched.engines[key]
        assert engine.prefilling == [long.seq] and sched.running_rows == 2
        turns = 0
        while engine.prefilling:
            before = len(short.ticket.events)
            sched._step_all()
            assert len(short.ticket.events) == before + 1  # a token of the running row at every turn
            turns += 1
        assert turns == 13  # 12 chunks, the last less its last token (AR: clean windows of 1)
        while sched.engines:
            sched._step_all()
    alone = Engine(model, sched.config(key, 6)).generate([long.prompt_ids])[0]
    assert long.seq.token_ids == alone.token_ids and long.ticket.events[-1].token_ids == alone.token_ids
