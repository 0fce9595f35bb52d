"""Structured output and tool calls for the public families (SDAR, SDAR-MoE, LLaDA2, Fast-dLLM v2),
decoded under the grammar in each family's own block layout (clover/engine/family_grammar.py):

* the block decoder (a confident left prefix of each block's masks per forward, every token passed
  by the grammar) gives the tokens of a slow reference written plainly - the whole sequence
  recomputed without a cache for every forward, the same left-prefix rule - for several rows
  decoded side by side in one slot mode (shared forwards), at a threshold that fills several
  tokens per forward and at one that fills one;
* `clover serve --model DIR` on a random-weight folder in each family's published layout, with the
  official openai client: chat, stream, forced tool calls (tool_choice "required" and a named
  function), tool_choice "auto", response_format json_schema (whole and streamed) - every JSON reply
  valid for its schema, max_tokens too small for any valid document a 400;
* `clover generate --model DIR --json-schema FILE`."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
from family_chat import write_chat_family
from test_families import VOCAB, confident, write_family

from clover.engine.family_grammar import choose_token_task, decode_blocks_task, fill_prefix
from clover.engine.slots import drive
from clover.engine.infill import Constraint
from clover.engine.slots import SlotMode, Task
from clover.models.family_seam import FamilySeam

FAMILIES = ["sdar", "sdar_moe", "llada2_moe", "Fast_dLLM_Qwen"]
STOP = 2  # the folders' EOS
LENGTHS = (5, 8, 3, 10)  # odd, a whole block, shorter than a block


class Toy:
    """A grammar whose allowed tokens depend on the tokens accepted so far (the previous one and the
    count): ordinary tokens only, the stop token once `least` are written, done after `most`."""

    def __init__(self, least: int = 6, most: int = 15):
        self.prev, self.n, self.least, self.most = 0, 0, least, most

    def allowed(self) -> torch.Tensor:
        ok = torch.tensor([t >= 6 and (3 * t + 5 * self.prev + self.n) % 4 != 0 for t in range(VOCAB)])
        ok[STOP] = self.n >= self.least
        return ok

    def allow(self, logits: torch.Tensor) -> None:
        logits[:, ~self.allowed()] = float("-inf")

    def accept(self, t: int) -> bool:
        assert bool(self.allowed()[t]), "a token the grammar forbids was committed"
        self.prev, self.n = t, self.n + 1
        return self.n < self.most and t != STOP


def toy_rule(mask: int, budget: int = 40) -> Constraint:
    g = Toy()
    return Constraint(g.allow, g.accept, {STOP}, None, None, 0, budget, mask)


def reference(seam, prompt: list[int], block: int, threshold: float) -> tuple[list[int], int]:
    """The slow decoder: every forward recomputes the whole sequence (prompt, tokens so far, the
    current block's masks) with no cache; the block's masked positions are read left to right, the
    first always taken, each next one while its allowed choice has probability >= threshold."""
    g, mask, shift = Toy(), seam.config.mask_token_id, seam.shift
    tokens, forwards = [], 0
    while True:
        n = len(prompt) + len(tokens)
        end = (n // block + 1) * block
        ids = torch.tensor([prompt + tokens + [mask] * (end - n)])
        logits = seam(ids, block_size=block).logits[0].float()
        forwards += 1
        for i, pos in enumerate(range(n, end)):
            row = logits[pos - 1 if shift else pos].clone()
            row[mask] = float("-inf")
            row[~g.allowed()] = float("-inf")
            t = int(row.argmax())
            if i > 0 and float(torch.softmax(row, -1)[t]) < threshold:
                break
            more = g.accept(t)
            if t == STOP:
                return tokens, forwards
            tokens.append(t)
            if not more:
                return tokens, forwards


def side_by_side(seam, prompts, block: int, threshold: float):
    """The block decoder's (tokens, forwards) of every prompt, their jobs run together in one slot mode."""
    tasks = [Task(decode_blocks_task(seam, p, toy_rule(seam.config.mask_token_id), threshold, block))
             for p in prompts]
    mode = SlotMode()
    for t in tasks:
        mode.join(t.resume())
    shared = 0
    while mode.running:
        shared += 1
        for job in mode.step():
            assert job.error is None, job.error
            job.task.resume(job)
    return [t.future.result() for t in tasks], shared


@torch.no_grad()
@pytest.mark.parametrize("model_type", FAMILIES)
def test_block_grammar_decoder_equals_the_slow_reference(tmp_path, model_type):
    write_family(tmp_path, model_type)
    seam = FamilySeam(confident(tmp_path, model_type, peak=12.0))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(6, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    for threshold in (0.5, 1.5):  # several tokens per forward; one (nothing is confident past 1)
        got, shared = side_by_side(seam, prompts, 4, threshold)
        want = [reference(seam, p, 4, threshold) for p in prompts]
        assert [(tokens, forwards) for tokens, _, forwards in got] == want
        assert all(complete for _, complete, _ in got)
        assert shared < sum(f for _, f in want)  # the rows shared forwards
        if threshold > 1:
            assert all(len(t) == f - 1 or len(t) == f for t, f in want)  # one token per forward (+ the stop)
        else:
            assert sum(len(t) for t, _ in want) > sum(f for _, f in want)  # the prefix rule fills several


def test_fill_prefix_stops_at_the_first_unsure_column():
    """The first column is always taken; the prefix ends at the first column below the threshold."""
    logits = torch.full((4, VOCAB), -20.0)
    for col, t in enumerate([10, 11, 12, 13]):
        logits[col, t] = 30.0
    logits[0, 14] = logits[2, 14] = 30.0  # the first and third columns are a coin toss
    rule = Constraint(lambda x: None, lambda t: True, {STOP}, None, None, 0, 10, 3)
    assert fill_prefix(rule, logits, 0.9) == ([10, 11], False) and rule.tokens == [10, 11]


@torch.no_grad()
@pytest.mark.parametrize("model_type", ["sdar", "llada2_moe", "Fast_dLLM_Qwen"])
def test_choose_token_reads_the_next_position(tmp_path, model_type):
    """The choice after a forced call (another call or the end of the turn) is the likelier option at
    the position right after the context, as a full recompute in the family's layout reads it."""
    write_family(tmp_path, model_type)
    seam = FamilySeam(confident(tmp_path, model_type, peak=4.0))
    block = seam.decode_defaults["block_size"]
    g = torch.Generator().manual_seed(9)
    for n in (3, 8, 13):
        prompt = torch.randint(6, VOCAB, (n,), generator=g).tolist()
        end = (n // block + 1) * block
        logits = seam(torch.tensor([prompt + [seam.config.mask_token_id] * (end - n)]), block_size=block).logits[0]
        row = logits[n - 1 if seam.shift else n]
        options = row[6:].topk(2).indices.add(6).flip(0).tolist()  # the likelier one second
        assert drive(choose_token_task(seam, prompt, options)) == (1, 1)


@pytest.mark.parametrize("model_type", ["sdar", "llada2_moe"])
def test_auto_reply_in_the_family_frame_is_read_back(model_type):
    """tool_choice "auto": a reply the model writes in its family's frame (a <tool_call> JSON block,
    then its end of turn) comes back as an OpenAI call."""
    from family_chat import chat_tokenizer

    from clover.server.choice import Choice
    from clover.server.protocol import ToolPlan

    tok = chat_tokenizer(model_type)
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' + tok.eos_token
    choice = Choice(tok, [], False, ToolPlan([WEATHER], [WEATHER["function"]], "auto"))
    choice.update(tok(text, add_special_tokens=False).input_ids, "stop")
    assert choice.finish_reason == "tool_calls" and choice.content == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]


# ---- clover serve with the official openai client ----------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    """The official client on `clover serve --model DIR` (in-process: uvicorn's run hands over its app)."""
    import uvicorn
    from server_utils import RunningServer, client

    from clover.cli import main

    folder = tmp_path_factory.mktemp(request.param)
    write_chat_family(folder, request.param)
    apps, run = [], uvicorn.Server.run
    uvicorn.Server.run = lambda self, sockets=None: (apps.append(self.config.app), [s.close() for s in sockets or []])
    try:
        assert main(["serve", "--model", str(folder), "--port", "0", "--threads", "1", "--served-model-name",
                     "fam", "--max-tool-calls", "2"]) == 0
    finally:
        uvicorn.Server.run = run
    with RunningServer(apps[0]) as s:
        yield client(s), folder


def _valid(args: str, tool: dict) -> None:
    jsonschema.validate(json.loads(args), tool["function"]["parameters"])


def test_chat_and_stream(served):
    c, _ = served
    got = c.chat.completions.create(model="fam", messages=ASK, max_tokens=6)
    assert got.choices[0].finish_reason in ("length", "stop") and got.usage.completion_tokens <= 6
    chunks = list(c.chat.completions.create(model="fam", messages=ASK, max_tokens=6, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == got.choices[0].message.content


def test_forced_tool_calls_are_valid(served):
    c, _ = served
    tools = [WEATHER, TIME]
    got = c.chat.completions.create(model="fam", messages=ASK, tools=tools, tool_choice="required", max_tokens=300)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and 1 <= len(choice.message.tool_calls) <= 2
    for call in choice.message.tool_calls:
        _valid(call.function.arguments, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])
    named = {"type": "function", "function": {"name": "get_time"}}
    got = c.chat.completions.create(model="fam", messages=ASK, tools=tools, tool_choice=named, max_tokens=120)
    calls = got.choices[0].message.tool_calls
    assert [k.function.name for k in calls] == ["get_time"]
    _valid(calls[0].function.arguments, TIME)
    chunks = list(c.chat.completions.create(model="fam", messages=ASK, tools=tools, tool_choice=named,
                                            max_tokens=120, stream=True))
    streamed = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert "".join(d.function.arguments or "" for d in streamed) == calls[0].function.arguments  # greedy: the same


def test_forced_call_fits_any_budget_its_smallest_call_fits(served):
    """From the smallest call's budget up, a forced call is valid and within max_tokens (the call frame
    counts against it: the arguments are decoded in what the frame leaves), never a 400."""
    import re

    c, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="fam", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=1)
    least = int(re.search(r"needs (\d+) tokens", e.value.body["message"]).group(1))
    for budget in (least, least + 3, least + 7):
        got = c.chat.completions.create(model="fam", messages=ASK, tools=[WEATHER], tool_choice="required",
                                        max_tokens=budget, parallel_tool_calls=False)
        assert got.usage.completion_tokens <= budget and got.choices[0].finish_reason == "tool_calls"
        _valid(got.choices[0].message.tool_calls[0].function.arguments, WEATHER)


def test_tool_choice_auto(served):
    """The reply is text or calls in the family's `<tool_call>` frame, read back; never a broken call."""
    c, _ = served
    got = c.chat.completions.create(model="fam", messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=12)
    choice = got.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or []:
        _valid(call.function.arguments, WEATHER)


def test_response_format_json_schema(served):
    c, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    got = c.chat.completions.create(model="fam", messages=ASK, response_format=fmt, max_tokens=60)
    assert got.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got.choices[0].message.content), PERSON)
    chunks = list(c.chat.completions.create(model="fam", messages=ASK, response_format=fmt, max_tokens=60,
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == got.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.chat.completions.create(model="fam", messages=ASK, response_format=fmt, max_tokens=3)
    got = c.chat.completions.create(model="fam", messages=ASK, response_format={"type": "json_object"}, max_tokens=80)
    assert isinstance(json.loads(got.choices[0].message.content), dict)


def test_sampled_structured_replies_in_the_family_layout(served):
    """temperature + seed under the grammar in the family's own blocks: valid, the same seed the same reply,
    for a response_format reply and forced calls."""
    c, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    kw = dict(model="fam", messages=ASK, max_tokens=60, temperature=1.5, seed=5)
    got = c.chat.completions.create(response_format=fmt, **kw).choices[0].message.content
    jsonschema.validate(json.loads(got), PERSON)
    assert c.chat.completions.create(response_format=fmt, **kw).choices[0].message.content == got
    calls = c.chat.completions.create(tools=[WEATHER, TIME], tool_choice="required", **kw).choices[0].message
    for call in calls.tool_calls:
        _valid(call.function.arguments, WEATHER if call.function.name == "get_weather" else TIME)


def test_request_decoding_reaches_the_family_grammar(served):
    """A request's threshold and block_size decide how a family's structured reply is decoded (its
    forwards), for response_format and for a forced call: at threshold 0 a block's whole masked prefix
    fills per forward, at 1 only what the grammar forces rides along; a larger block, fewer forwards."""
    c, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    named = {"type": "function", "function": {"name": "get_weather"}}

    def forwards(threshold: float, block_size: int, **kw) -> int:
        got = c.chat.completions.create(model="fam", messages=ASK, max_tokens=120,
                                        extra_body={"threshold": threshold, "block_size": block_size}, **kw)
        return got.model_extra["clover"]["structured"][0]["forward_passes"]

    for kw in ({"response_format": fmt}, {"tools": [WEATHER], "tool_choice": named}):
        loose = forwards(0.0, 4, **kw)
        assert forwards(1.0, 4, **kw) > loose > forwards(0.0, 8, **kw)


def test_what_a_vllm_client_sends(served, capsys):
    """n > 1 (whole and streamed), stop strings, no-op sampling fields pass; what the server cannot honour
    is a 400 naming the field (logprobs, penalties, logit_bias, a mode meaningless for the family), and
    `clover serve --mode` of such a mode is one line, exit 2."""
    from clover.cli import main

    c, folder = served
    cc = c.chat.completions.create
    text = cc(model="fam", messages=ASK, max_tokens=12).choices[0].message.content
    got = cc(model="fam", messages=ASK, max_tokens=12, n=2, presence_penalty=0, frequency_penalty=0.0, logit_bias={})
    assert [ch.message.content for ch in got.choices] == [text, text]  # greedy: the same twice
    chunks = list(cc(model="fam", messages=ASK, max_tokens=12, n=2, stream=True))
    for i in range(2):
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks
                       if ch.choices and ch.choices[0].index == i) == text
    stop = text[len(text) // 2]
    got = cc(model="fam", messages=ASK, max_tokens=12, stop=[stop]).choices[0]
    assert (got.message.content, got.finish_reason) == (text[: text.index(stop)], "stop")
    for kw, param in [({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
                      ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": -1}, "frequency_penalty"),
                      ({"logit_bias": {"7": 5}}, "logit_bias"), ({"extra_body": {"repetition_penalty": 1.2}},
                                                                 "repetition_penalty"),
                      ({"extra_body": {"mode": "self_spec"}}, "mode")]:
        with pytest.raises(openai.BadRequestError) as e:
            cc(model="fam", messages=ASK, max_tokens=4, **kw)
        assert e.value.body["param"] == param, e.value.body
    capsys.readouterr()
    assert main(["serve", "--model", str(folder), "--port", "0", "--threads", "1", "--mode", "self_spec"]) == 2
    err = capsys.readouterr().err.strip()
    assert "self_spec" in err and len(err.splitlines()) == 1


def test_tokenize_and_detokenize(served):
    """vLLM's /tokenize counts what the generation endpoints feed the model (chat messages with tools,
    a completions prompt); /detokenize gives the text back; mistakes are 400s naming the field."""
    from urllib.error import HTTPError
    from urllib.request import Request, urlopen

    c, _ = served
    root = str(c.base_url).removesuffix("/").removesuffix("/v1")

    def post(path, body):
        req = Request(root + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except HTTPError as e:
            return e.code, json.loads(e.read())

    for tools in (None, [WEATHER]):
        got = c.chat.completions.create(model="fam", messages=ASK, max_tokens=2, tools=tools)
        status, out = post("/tokenize", {"messages": ASK, "tools": tools})
        assert status == 200 and out["count"] == len(out["tokens"]) == got.usage.prompt_tokens
    got = c.completions.create(model="fam", prompt="Hello there", max_tokens=2)
    status, out = post("/tokenize", {"model": "fam", "prompt": "Hello there"})
    assert out["count"] == got.usage.prompt_tokens and out["max_model_len"] == c.models.list().data[0].max_model_len
    assert post("/detokenize", {"tokens": out["tokens"]}) == (200, {"prompt": "Hello there"})
    assert post("/tokenize", {"prompt": "x", "messages": ASK})[1]["error"]["param"] == "messages"
    assert post("/tokenize", {"model": "other", "prompt": "x"})[0] == 404
    status, out = post("/detokenize", {"tokens": [10**7]})
    assert status == 400 and out["error"]["param"] == "tokens"


def test_cli_generate_json_schema(tmp_path):
    from test_families_engine import _clover

    write_chat_family(tmp_path / "m", "llada2_moe")
    (tmp_path / "s.json").write_text(json.dumps(PERSON))
    run = _clover("generate", "--model", str(tmp_path / "m"), "--prompt", "Ann", "--json-schema",
                  str(tmp_path / "s.json"), "--max-new-tokens", "60", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["valid"] and out["method"] == "grammar"
    jsonschema.validate(json.loads(out["text"]), PERSON)
