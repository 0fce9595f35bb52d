"""Sampled structured replies (temperature, top_p, top_k, seed with response_format): every token drawn
from the model's distribution restricted to what the schema's grammar allows. The constrained sampler
against a naive reference on random logits; replies on a tiny random model (head not sharpened, so
samples differ) valid over many seeds, the same seed the same reply, different seeds different ones."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import save_tiny_model
from jsonschema import validate

import clover
from clover.engine.constraint import constrained_sample
from clover.engine.sampling import Draw, draw_distribution
from clover.server.protocol import APIError
from clover.server.structured import format_plan, infill_format
from clover.settings import SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pet": {"enum": ["cat", "dog", "fish"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
PARAMS = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_p=0.6),
          SamplingParams(temperature=0.5, top_k=4, top_p=0.9), SamplingParams(temperature=2.0, top_p=0.05)]


def naive(logits: torch.Tensor, allowed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The reference, a row at a time in plain Python: softmax of logits / temperature with the disallowed
    tokens at -inf, then the top_k likeliest, then the smallest prefix (by probability) reaching top_p."""
    out = torch.zeros_like(logits, dtype=torch.float64)
    for b in range(logits.shape[0]):
        scaled = {v: float(logits[b, v]) / params.temperature for v in range(logits.shape[1]) if allowed[b, v]}
        order = sorted(scaled, key=lambda v: -scaled[v])
        if params.top_k:
            order = [v for v in order if scaled[v] >= scaled[order[min(params.top_k, len(order)) - 1]]]
        z = sum(math.exp(scaled[v]) for v in order)
        kept, mass = [], 0.0
        for v in order:
            if mass >= params.top_p:
                break
            kept.append(v)
            mass += math.exp(scaled[v]) / z
        z = sum(math.exp(scaled[v]) for v in kept)
        for v in kept:
            out[b, v] = math.exp(scaled[v]) / z
    return out


def _random(batch: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g) * 2
    allowed = torch.rand(batch, vocab, generator=g) < 0.4
    allowed[:, 0] = True  # every row allows something
    return logits, allowed


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_the_constrained_distribution_equals_the_naive_reference(params):
    logits, allowed = _random(5, 40, 0)
    masked = logits.masked_fill(~allowed, float("-inf"))
    got = draw_distribution(masked, params).double()
    assert torch.allclose(got, naive(logits, allowed, params), atol=1e-6)
    assert (got[~allowed] == 0).all()


@pytest.mark.parametrize("params", PARAMS[:3], ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_constrained_draws_follow_the_reference_and_never_leave_the_grammar(params):
    batch, vocab, draws = 3, 12, 6000
    logits, allowed = _random(batch, vocab, 1)
    masked = logits.masked_fill(~allowed, float("-inf"))
    tokens = constrained_sample(masked.repeat(draws, 1), params, torch.Generator().manual_seed(5)).view(draws, batch)
    freq = torch.stack([torch.bincount(tokens[:, b], minlength=vocab) for b in range(batch)]).double() / draws
    assert (freq[~allowed] == 0).all()
    assert (freq - naive(logits, allowed, params)).abs().max() < 0.03


def test_a_row_that_allows_nothing_gives_a_disallowed_token():
    masked = torch.full((2, 6), float("-inf"))
    masked[1, 3] = 0.0
    tokens = constrained_sample(masked, PARAMS[0], torch.Generator().manual_seed(0))
    assert tokens.tolist() == [0, 3]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return clover.load(save_tiny_model(tmp_path_factory.mktemp("sampled"), peak=1.0))


def _sampled(loaded, schema, params: SamplingParams | None, text="A person, please.", max_tokens=80):
    model, tok = loaded
    plan = format_plan({"type": "json_schema", "json_schema": {"schema": schema}})
    return infill_format(model, tok, tok(text).input_ids, plan, 0.5, 4, max_tokens,
                         draw=Draw.of(params) if params else None)


def test_sampled_replies_validate_over_many_seeds_and_a_seed_repeats(loaded):
    replies = []
    for seed in range(12):
        r = _sampled(loaded, PERSON, SamplingParams(temperature=0.9, top_p=0.95, seed=seed))
        validate(json.loads(r.content), PERSON)
        assert r.info["method"] == "grammar" and r.info["valid"] and r.finish == "stop"
        replies.append(r.content)
    assert len(set(replies)) > 6, replies  # different seeds, different replies
    again = _sampled(loaded, PERSON, SamplingParams(temperature=0.9, top_p=0.95, seed=3))
    assert again.content == replies[3]


def test_sampled_requests_batched_by_the_scheduler_equal_their_solo_replies(loaded):
    """Each request draws from its own generator: batched with others (same seed or not), its reply is
    the one it gets alone."""
    from clover.engine import slots
    from clover.server.scheduler import Scheduler
    from clover.server.structured import infill_format_task

    model, tok = loaded
    asks = [("Ann?", 1), ("Bob, please.", 2), ("Ann?", 2), ("Who?", 1)]
    alone = [_sampled(loaded, PERSON, SamplingParams(temperature=0.9, seed=seed), text).content for text, seed in asks]
    plan = format_plan({"type": "json_schema", "json_schema": {"schema": PERSON}})
    sched = Scheduler(model, (tok.eos_token_id,), max_batch=8)
    tasks = [slots.Task(infill_format_task(model, tok, tok(text).input_ids, plan, 0.5, 4, 80,
                                           draw=Draw.of(SamplingParams(temperature=0.9, seed=seed))))
             for text, seed in asks]
    for task in tasks:
        task.resume()
    sched.submit(tasks)
    sched.start()
    try:
        together = [t.future.result(timeout=300).content for t in tasks]
    finally:
        sched.stop()
    assert together == alone


def test_greedy_is_unchanged_and_a_near_zero_top_p_is_greedy_under_the_grammar(loaded):
    greedy = _sampled(loaded, PERSON, None)
    assert greedy.info["method"] == "infill"  # a greedy reply is still infilled when it can be
    plan_schema = {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string",
                                                                                         "maxLength": 5}]}},
                   "required": ["v"]}
    argmax = _sampled(loaded, plan_schema, None)
    assert argmax.info["method"] == "grammar"
    for seed in range(3):  # top_p near 0 keeps the likeliest allowed token: the greedy grammar reply
        assert _sampled(loaded, plan_schema, SamplingParams(temperature=1.0, top_p=1e-9, seed=seed)).content == \
            argmax.content


def test_a_schema_only_the_infiller_honours_is_refused_when_sampled(loaded, monkeypatch):
    from clover.server import structured
    from clover.structured import Refused

    def refuse(*a, **k):
        raise Refused("x", "#/name", "beyond the grammar")

    monkeypatch.setattr(structured, "check_grammar", refuse)
    assert _sampled(loaded, PERSON, None).info["method"] == "infill"
    with pytest.raises(APIError) as e:
        _sampled(loaded, PERSON, SamplingParams(temperature=0.8, seed=1))
    assert e.value.status == 400 and e.value.param == "temperature" and "temperature 0" in e.value.message


# ---- clover serve with the official openai client -----------------------------------------------------------
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The official client on a tiny tool-chat model whose head is not sharpened (samples differ)."""
    import openai
    from server_utils import RunningServer, tools_model

    from clover.api import eos_ids
    from clover.server import Settings, create_app

    model, tokenizer = tools_model(tmp_path_factory.mktemp("sampled-serve"), 0)
    model.lm_head.weight.data /= 40.0
    settings = Settings(model_id="tiny", block_size=4, threshold=0.5, max_batch=8, max_queue=16, max_tool_calls=3)
    with RunningServer(create_app(model, tokenizer, settings, eos_ids(model, tokenizer))) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("fmt", [{"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
                                 {"type": "json_object"}], ids=["json_schema", "json_object"])
def test_over_http_a_sampled_reply_validates_and_its_seed_repeats_it_whole_or_streamed(served, fmt):
    kw = dict(messages=ASK, response_format=fmt, max_tokens=100, temperature=0.8, top_p=0.95)
    replies = []
    for seed in range(4):
        got = served.chat.completions.create(model="tiny", seed=seed, **kw)
        value = json.loads(got.choices[0].message.content)
        if fmt["type"] == "json_schema":
            validate(value, PERSON)
        assert isinstance(value, dict) and got.choices[0].finish_reason == "stop"
        assert got.model_extra["clover"]["structured"][0]["method"] == "grammar"
        replies.append(got.choices[0].message.content)
    assert len(set(replies)) > 1, replies
    assert served.chat.completions.create(model="tiny", seed=2, **kw).choices[0].message.content == replies[2]
    chunks = list(served.chat.completions.create(model="tiny", seed=2, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == replies[2]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_over_http_n_sampled_choices_are_independent_whole_or_streamed(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    kw = dict(messages=ASK, response_format=fmt, max_tokens=100, temperature=0.9, seed=11)
    one = served.chat.completions.create(model="tiny", **kw)
    many = served.chat.completions.create(model="tiny", n=3, **kw)
    texts = [c.message.content for c in many.choices]
    assert [c.index for c in many.choices] == [0, 1, 2] and len(many.model_extra["clover"]["structured"]) == 3
    for text in texts:
        validate(json.loads(text), PERSON)
    assert texts[0] == one.choices[0].message.content  # choice i is seeded seed + i
    assert len(set(texts)) > 1, texts
    assert many.usage.completion_tokens > one.usage.completion_tokens
    got = {0: "", 1: "", 2: ""}
    finish = {}
    for chunk in served.chat.completions.create(model="tiny", n=3, stream=True, **kw):
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [got[i] for i in range(3)] == texts and finish == {0: "stop", 1: "stop", 2: "stop"}


CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"]}}}


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_over_http_sampled_forced_tool_calls_validate_and_their_seed_repeats_them(served):
    from server_utils import TOOL_ASK, WEATHER

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    kw = dict(messages=TOOL_ASK, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=120, temperature=1.0)
    replies = []
    for seed in range(6):
        got = served.chat.completions.create(model="tiny", seed=seed, **kw).choices[0]
        assert got.finish_reason == "tool_calls" and 1 <= len(got.message.tool_calls) <= 3
        for name, arguments in _calls(got.message):
            validate(json.loads(arguments), schemas[name])
        replies.append(_calls(got.message))
    assert len(set(map(tuple, replies))) > 1, replies
    assert _calls(served.chat.completions.create(model="tiny", seed=4, **kw).choices[0].message) == replies[4]
    calls: dict[int, list[str]] = {}
    for chunk in served.chat.completions.create(model="tiny", seed=4, stream=True, **kw):
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            calls.setdefault(d.index, ["", ""])
            calls[d.index][0] += d.function.name or ""
            calls[d.index][1] += d.function.arguments or ""
    assert [tuple(calls[i]) for i in sorted(calls)] == replies[4]
    named = dict(kw, tool_choice={"type": "function", "function": {"name": "get_time"}})
    for seed in range(3):
        (name, arguments), = _calls(served.chat.completions.create(model="tiny", seed=seed, **named).choices[0].message)
        assert name == "get_time"
        validate(json.loads(arguments), schemas[name])
