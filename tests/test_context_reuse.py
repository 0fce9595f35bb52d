"""A request's context laid out once (engine/infill.Context): each job of a request starts from a copy of
the cache its jobs committed so far and feeds only what its prompt adds. The reference is the same layout
rule with every job fed whole (a fresh cache, each segment of the context in one forward of the width it
was first fed in): equal slot values and confidences, alone and beside other requests' jobs, with fewer
tokens fed than jobs that each lay out their whole prompt."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model, with_block_additions

from clover.engine import infill
from clover.engine.batch import RowBatch
from clover.engine.infill import Context, Row, Slot, TextRule, Unit
from clover.engine.runner import make_runner
from clover.engine.slots import SlotJob, SlotMode
from functools import partial


@pytest.fixture(scope="module")
def model():
    """Its block additions perturbed from their zero start, so a clean window's width changes what it computes."""
    return with_block_additions(tiny_model(5))


def test_a_clean_window_width_changes_the_cache(model):
    runner, ids = make_runner("eager", model), torch.randint(0, 100, (1, 30))
    outs = []
    with torch.inference_mode():
        for width in (2, 5):
            cache = runner.new_cache(1, capacity=40)
            runner.forward(ids, cache, clean_block_size=width, logits_to_keep=1)
            outs.append(runner.forward(ids[:, :4], cache, block_size=4, draft_len=4, clean_block_size=4, logits_to_keep=4))
    assert (outs[0] - outs[1]).abs().max() > 1e-2


class Whole(Context):
    """The reference: the same segments in the same widths, every job fed whole in a fresh cache."""

    def __init__(self, model, width=None):
        super().__init__(width)
        self.model, self.segments = model, []

    def keep(self, batch, rows):
        old = self.tokens
        super().keep(batch, rows)
        self.cache = None  # never copied
        if self.tokens == old:
            return
        extends = self.tokens[: len(old)] == old
        new = self.tokens[len(old):] if extends else self.tokens
        self.segments = (self.segments if extends else []) + ([(new, batch.clean_block_size)] if new else [])

    def start(self, rows):
        if not self.segments or not self.extends(rows):
            return None
        runner, n = make_runner("eager", self.model), len(self.tokens)
        cache = runner.new_cache(1, capacity=n + 1)
        for tokens, width in self.segments:
            runner.forward(torch.tensor([tokens]), cache, clean_block_size=width, logits_to_keep=1)
        return cache, n


def _units(g: torch.Generator, shape: list[tuple[int, int, int]]) -> list[Unit]:
    """Units of (scaffold length, slot width, kind: 0 options, 1 text) with random tokens."""
    rand = lambda n: torch.randint(0, 100, (n,), generator=g).tolist()  # noqa: E731
    out = []
    for scaffold, width, kind in shape:
        if kind == 0:
            choices = [rand(1 + i % width) for i in range(3)]
            out.append(Slot(rand(scaffold), rand(1), choices=choices, values=list(range(3))))
        else:
            out.append(Slot(rand(scaffold), rand(1), text=TextRule(lambda t: (t, t)), width=width))
    return out + [Unit(rand(2))]


SHAPES = [[(3, 2, 0), (1, 3, 1)], [(2, 4, 1)], [(0, 1, 0), (4, 2, 0), (2, 3, 1)], [(1, 2, 0)]]
EXTRA = [0, 3, 0, 7]  # tokens a job's prompt adds beyond the last job's prompt and row (0: the same prompt)


def _request(model, make_context, seed: int, mode: SlotMode | None = None):
    """A request's jobs one after another (every other job's prompt: the last prompt, its row's tokens and
    a few more), each its rows' (values, confidences); `mode`: run beside another request (a generator)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(0, 100, (30,), generator=torch.Generator().manual_seed(99)).tolist()  # every request's
    context, mask = make_context(), model.config.mask_token_id
    prompt = common + torch.randint(0, 100, (11 + seed,), generator=g).tolist()
    out = []
    for k, shape in enumerate(SHAPES):
        row = Row(prompt, _units(g, shape), 5, model.config.max_block_size)
        job = SlotJob(partial(infill._start_denoise, model, [row], 0.6, context))
        if mode is None:
            mode = SlotMode()
            mode.join(job)
            while mode.running:
                mode.step()
            mode = None
        else:
            yield job
        assert job.error is None, job.error
        out.append([(s.value, s.confidence) for s in row.slots])
        prompt = prompt + (row.tokens(mask) if k % 2 else []) + torch.randint(0, 100, (EXTRA[k],), generator=g).tolist()
    return out


def _alone(model, make_context, seed):
    gen = _request(model, make_context, seed)
    try:
        next(gen)
    except StopIteration as stop:
        return stop.value


def _same(a, b):
    assert [[v for v, _ in job] for job in a] == [[v for v, _ in job] for job in b]
    for ja, jb in zip(a, b):
        torch.testing.assert_close(torch.tensor([c for _, c in ja]), torch.tensor([c for _, c in jb]), atol=1e-4, rtol=1e-4)


class Fed:
    """Tokens fed to the model while inside."""

    def __init__(self, model):
        self.tokens, self.rows, self.commits = 0, [], 0  # commits: forwards that draft nothing
        self.handle = model.register_forward_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs, out):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens += ids.numel()
        self.rows.append(ids.shape[0])
        self.commits += not kwargs.get("draft_len")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.mark.parametrize("seed,width", [(0, None), (3, None), (4, 1), (5, 3)])
def test_jobs_starting_from_the_request_context_equal_each_job_fed_whole(model, seed, width):
    """`width`: the context's clean windows (None: each segment in its job's first width)."""
    with torch.inference_mode(), Fed(model) as reused:
        got = _alone(model, lambda: Context(width), seed)
    with torch.inference_mode(), Fed(model) as whole:
        want = _alone(model, lambda: Whole(model, width), seed)
    with torch.inference_mode(), Fed(model) as apart:
        _alone(model, lambda: None, seed)  # every job lays out its whole prompt in its own width
    _same(got, want)
    assert reused.tokens < whole.tokens and reused.tokens < apart.tokens


def test_requests_side_by_side_reply_as_each_fed_whole_alone(model, monkeypatch):
    """Two requests' jobs (of one shape) share forwards, their caches copied side by side: each request's
    results are its own, fed whole, alone (contexts laid out causally: their first jobs share a prefix)."""
    with torch.inference_mode():
        want = [_alone(model, lambda: Whole(model, 1), seed) for seed in (1, 2)]
    monkeypatch.setattr(RowBatch, "split_min_saved", 1)
    mode = SlotMode()
    gens = [_request(model, lambda: Context(1), seed, mode) for seed in (1, 2)]
    got, jobs = [None, None], [next(g) for g in gens]
    with torch.inference_mode(), Fed(model) as fed:
        while any(g is not None for g in gens):
            for job in jobs:
                if job is not None:
                    mode.join(job)
            while mode.running:
                mode.step()
            for i, g in enumerate(gens):
                if g is None:
                    continue
                try:
                    jobs[i] = next(g)
                except StopIteration as stop:
                    got[i], gens[i], jobs[i] = stop.value, None, None
    for a, b in zip(got, want):
        _same(a, b)
    assert max(fed.rows) == 2 and fed.commits  # forwards served both requests; their common prefix ran once


def test_a_job_whose_prompt_does_not_extend_the_context_prefills_whole(model):
    row = lambda prompt: Row(prompt, [Slot([5], [6], choices=[[7], [8]], values=[0, 1])], 4, 32)  # noqa: E731
    context = Context()
    context.tokens, context.cache = [1, 2, 3], object()
    assert context.extends([row([1, 2, 3, 4])]) and not context.extends([row([1, 2, 3])])
    assert not context.extends([row([1, 2, 9, 4])]) and not context.extends([row([1, 2, 3, 4])] * 2)
    assert Context().start([row([1, 2])]) is None  # nothing kept yet


def test_forced_tool_calls_reply_as_with_every_job_fed_whole(tmp_path, monkeypatch):
    """A forced-call reply of several jobs (function pick, arguments, another call?, over calls) equals the
    reply whose jobs each feed their context whole under the same layout; both feed less than no reuse."""
    import clover
    from helpers import save_tiny_model

    from clover.server import structured
    from clover.server.protocol import ToolPlan

    model, tok = clover.load(save_tiny_model(tmp_path / "m", seed=2))
    with_block_additions(model)
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
        "required": ["city", "n"]}}} for n in ("weather", "time", "place")]
    plan = ToolPlan(tools, [t["function"] for t in tools], "required", True)
    newline = tok("\n", add_special_tokens=False).input_ids[0]
    monkeypatch.setattr(structured, "_end_of_turn", lambda *_: newline)  # "another call?": always yes, up to 3

    def replies(make):
        monkeypatch.setattr(structured, "Context", make)
        with torch.inference_mode(), Fed(model) as fed:
            out = [structured.infill_tool_call(model, tok, tok(f"Call {i}: the weather in town {i}?").input_ids, plan,
                                               0.5, 5, 400, max_calls=3) for i in range(3)]
        return [(r.tool_calls, r.info["forward_passes"]) for r in out], fed.tokens

    def ids(calls):
        return [([c["function"] for c in r], f) for r, f in calls]

    got, reused = replies(Context)
    want, whole = replies(lambda width: Whole(model, width))
    _, apart = replies(lambda width: None)
    assert ids(got) == ids(want) and all(len(calls) == 3 for calls, _ in got)
    assert reused < apart and reused < whole


@pytest.mark.parametrize("seed", [0, 6])
def test_a_request_context_feeds_the_first_windows_scaffold_as_prompt(model, seed):
    """Under a request context of its own width, window 0's scaffold before its first slot rides with the
    prompt (`Row.lead_in`): the job computes what a job whose prompt ends with that scaffold computes, its
    draft window starts at the slot, and its row's tokens still hold the scaffold."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, 100, (n,), generator=g).tolist()  # noqa: E731
    prompt, head, ends = rand(23), rand(4), rand(1)
    units = lambda scaffold: [Slot(scaffold, ends, text=TextRule(lambda t: (t, t)), width=3),  # noqa: E731
                              Slot([7, 8], ends, choices=[[9], [10, 11]], values=[0, 1])]
    mask = model.config.mask_token_id
    got, want = Row(prompt, units(head), 5, model.config.max_block_size), Row(prompt + head, units([]), 5, 64)
    with torch.inference_mode():
        for row in (got, want):
            mode = SlotMode()
            mode.join(SlotJob(partial(infill._start_denoise, model, [row], 0.6, Context(1))))
            while mode.running:
                mode.step()
    assert got.lead == len(head) and got.fed == prompt + head and got.draft(0, mask)[0] == want.draft(0, mask)[0]
    assert [s.value for s in got.slots] == [s.value for s in want.slots]
    assert got.tokens(mask) == head + want.tokens(mask)



class Unclosed(Context):
    """A causal context that keeps only where each job's first forward left it (never where a job ended)."""

    def close(self, batch, rows, committed):
        pass


def _two_jobs(model, context, seed: int):
    """A job of several windows, then a job whose prompt is the first's prompt, its row and a few tokens:
    each job's (values, confidences)."""
    g = torch.Generator().manual_seed(seed)
    prompt, mask, out = torch.randint(0, 100, (17 + seed,), generator=g).tolist(), model.config.mask_token_id, []
    for k, shape in enumerate([[(3, 2, 0), (1, 3, 1), (2, 2, 0)], [(1, 2, 0), (0, 3, 1)]]):
        row = Row(prompt, _units(g, shape), 5, model.config.max_block_size)
        mode = SlotMode()
        mode.join(SlotJob(partial(infill._start_denoise, model, [row], 0.6, context)))
        while mode.running:
            mode.step()
        assert k or len(row.windows) > 2
        out.append([(s.value, s.confidence) for s in row.slots])
        prompt = prompt + row.tokens(mask) + torch.randint(0, 100, (seed % 3,), generator=g).tolist()
    return out


@pytest.mark.parametrize("seed", [2, 7])
def test_a_job_starts_where_the_last_job_ended_under_a_causal_context(model, seed):
    """Context(1).close: a job whose prompt holds the last job's row starts after the windows that job
    committed (fewer tokens fed) and replies as the job that starts after its prompt only, and as fed whole."""
    with torch.inference_mode(), Fed(model) as ended:
        got = _two_jobs(model, Context(1), seed)
    with torch.inference_mode(), Fed(model) as first:
        want = _two_jobs(model, Unclosed(1), seed)
    with torch.inference_mode():
        whole = _two_jobs(model, Whole(model, 1), seed)
    _same(got, want)
    _same(got, whole)
    assert ended.tokens < first.tokens
