"""The local agent benchmark (`clover bench agent`): seeded, offline tool-use cases from
`clover.data.toolbox`, held out from the default model's training dialogues, scored three ways.

* **Call accuracy** (BFCL-style, single turn): the first assistant turn's tool calls against the
  expected ones by AST match (`match_calls`): same function names, same argument keys, values of the
  schema's type and equal, parallel calls in any order.
* **Irrelevance accuracy**: for requests no offered tool helps with, the first turn makes no call.
* **Episodes** (tau-bench-style, multi-turn): the model's calls run for real against the case's
  seeded `Toolbox` world, the results go back as `tool` messages, and the final reply is compared
  with what the real results call for (`toolbox.final_answer`): exact match, and a looser "contains
  every value" match. At most `MAX_ROUNDS` tool rounds.

The model is reached through a `generate(prompts) -> [Turn]` function (`model_generator` wraps the
decoding engine), so the episode logic runs the same under a scripted stand-in in the tests.
docs/agent.md describes the measures and the matching rules.
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from ..chat import CALL_OPEN, after_thinking, function_spec, parse_tool_calls, prompt_renderer, renders_tools
from ..data import toolbox
from ..data.toolbox import TRAINING_SEEDS
from ..engine import DEFAULTS
from ..errors import UserError
from .report import load_checked, markdown_table, write_json

BENCH_SEED = 1000  # the benchmark's cases (the recipe's tool dialogues: toolbox.*_DIALOGUE_SEED)
MAX_ROUNDS = 3
MAX_NEW_TOKENS = DEFAULTS.max_new_tokens  # the budget of each assistant turn
ERROR_KINDS = ("no call", "malformed call", "wrong number of calls", "wrong function", "missing argument",
               "unexpected argument", "type mismatch", "wrong value", "called a tool")
METRICS = ("cases", "call_accuracy", "irrelevance_accuracy", "first_turn_accuracy", "episode_exact",
           "episode_values", "call_validity", "call_attempts", "forward_passes_per_case", "seconds_per_case",
           "generations_per_case", "errors")


@dataclass
class Turn:
    """One generated assistant turn: its text and the forwards it took (prefill not counted)."""
    text: str
    forward_passes: int = 0


def held_out_cases(n: int, seed: int = BENCH_SEED, recipe_seed: int = 0) -> list[dict]:
    """`n` benchmark cases (cycling over toolbox.KINDS) whose requests the recipe's tool-use dialogues
    never use (SMALL_KINDS excepted: see toolbox.cases)."""
    seen = {c["request"] for s, m in TRAINING_SEEDS for c in toolbox.cases(recipe_seed + s, m)}
    return toolbox.cases(seed, n, exclude=seen)


# ---- AST matching (BFCL's checker, for our flat JSON-schema parameters) -----------------------------
_TYPES = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def type_ok(value, schema: dict) -> bool:
    """Is `value` of the schema's type? integer: a JSON integer (12.0 and "12" are not); number: any
    JSON number; an enum without a type: the type of one of its values."""
    kind = schema.get("type")
    if kind is None and "enum" in schema:
        return any(type(value) is type(e) for e in schema["enum"])
    return _TYPES.get(kind, lambda v: True)(value)


def values_equal(got, want, schema: dict) -> bool:
    """Numbers by value (12 == 12.0 for a number parameter), everything else exactly (strings are
    case- and space-sensitive: the tools look them up as given)."""
    if _TYPES["number"](got) and _TYPES["number"](want):
        return float(got) == float(want)
    return type(got) is type(want) and got == want


def call_mismatch(got: dict, want: dict, parameters: dict | None) -> str | None:
    """Why `got` ({"name", "arguments": dict}) is not the call `want`; None when it matches."""
    if got["name"] != want["name"]:
        return "wrong function"
    props = (parameters or {}).get("properties") or {}
    g, w = got["arguments"], want["arguments"]
    if set(w) - set(g):
        return "missing argument"
    if set(g) - set(w):
        return "unexpected argument"
    for key, value in w.items():
        schema = props.get(key, {})
        if not type_ok(g[key], schema):
            return "type mismatch"
        if not values_equal(g[key], value, schema):
            return "wrong value"
    return None


def match_calls(got: list[dict], want: list[dict], tools: list[dict]) -> str | None:
    """AST match of generated calls ({"name", "arguments": dict}) against the expected ones, in any
    order (parallel calls): None when every expected call is matched by its own generated call,
    else the reason (one of ERROR_KINDS)."""
    params = {function_spec(t)["name"]: function_spec(t).get("parameters") for t in tools}
    if len(got) != len(want):
        return "wrong number of calls"
    left = list(got)
    for w in want:
        reasons = [call_mismatch(g, w, params.get(w["name"])) for g in left]
        if None in reasons:
            left.pop(reasons.index(None))
            continue
        return next((r for r in reasons if r != "wrong function"), "wrong function")
    return None


def plain_calls(tool_calls: list[dict]) -> list[dict]:
    """OpenAI tool_calls (arguments as JSON text) -> [{"name", "arguments": dict}]."""
    return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in tool_calls]


def score_first_turn(case: dict, text: str) -> tuple[bool, str | None]:
    """(right, reason when wrong) for the first assistant turn of a case."""
    attempted = text.count(CALL_OPEN)
    if not case["calls"]:
        return (True, None) if not attempted else (False, "called a tool")
    if not attempted:
        return False, "no call"
    _, calls, problems = parse_tool_calls(text)
    if problems:
        return False, "malformed call"
    reason = match_calls(plain_calls(calls), case["calls"], case["tools"])
    return reason is None, reason


# ---- final answers ----------------------------------------------------------------------------------
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[+-]?\d+)?")  # 2.21232e+06: how toolbox writes 1e6 and up


def answer_values(case: dict, expected: str) -> list[str]:
    """What a reply must mention: every number of the expected answer and every string argument of the
    expected calls; for a direct answer (no calls), every token of it."""
    if not case["calls"]:
        return expected.replace(",", " ").split()
    strings = [v for c in case["calls"] for v in c["arguments"].values() if isinstance(v, str)]
    return _NUMBER.findall(expected) + strings


def contains_values(reply: str, values: list[str]) -> bool:
    """Every value appears in `reply` as a whole token; numbers compare by value and by count."""
    have = Counter(float(x) for x in _NUMBER.findall(reply))
    for v, k in Counter(float(x) for x in values if _NUMBER.fullmatch(x)).items():
        if have[v] < k:
            return False
    return all(re.search(rf"(?<!\w){re.escape(v)}(?!\w)", reply) for v in values if not _NUMBER.fullmatch(v))


# ---- episodes ---------------------------------------------------------------------------------------
def _fn_names(tools: list[dict]) -> set[str]:
    return {function_spec(t)["name"] for t in tools}


@dataclass
class Episode:
    """One case played out: the transcript so far and what was measured."""
    case: dict
    box: toolbox.Toolbox
    messages: list[dict] = field(default_factory=list)
    first_turn: str | None = None
    first_right: bool = False
    first_reason: str | None = None
    call_attempts: int = 0
    valid_calls: int = 0
    rounds: int = 0
    final: str | None = None
    done: bool = False
    forward_passes: int = 0
    seconds: float = 0.0
    generations: int = 0

    def __post_init__(self):
        self.messages = [{"role": "user", "content": self.case["request"]}]

    def step(self, turn: Turn, seconds: float, max_rounds: int) -> None:
        """Take one generated turn: score it if first, run its calls (or end the episode)."""
        self.forward_passes += turn.forward_passes
        self.seconds += seconds
        self.generations += 1
        text = after_thinking(turn.text)  # a think block, if the model wrote one anyway
        tools = self.case["tools"]
        if self.first_turn is None:
            self.first_turn = text
            self.first_right, self.first_reason = score_first_turn(self.case, text)
        attempted = text.count(CALL_OPEN)
        self.call_attempts += attempted
        self.valid_calls += len(parse_tool_calls(text, tools)[1])
        content, calls, problems = parse_tool_calls(text)  # unknown names too: the host answers them
        if not attempted:
            self.final, self.done = content, True
            return
        if self.rounds == max_rounds:  # still calling after the last round: no final answer
            self.done = True
            return
        self.rounds += 1
        self.messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        offered = _fn_names(tools)
        for c in plain_calls(calls):
            self.messages.append({"role": "tool", "content": self._run(c) if c["name"] in offered
                                  else f"error: unknown tool {c['name']}"})
        self.messages += [{"role": "tool", "content": f"error: {p}"} for p in problems]

    def _run(self, call: dict) -> str:
        try:
            return self.box.run(call["name"], call["arguments"])
        except Exception as e:  # what Toolbox.run does not catch (e.g. int(1e400)): still the tool's error
            return f"error: bad arguments ({e})"

    def record(self) -> dict:
        case = self.case
        if case["calls"]:
            expected = toolbox.final_answer(case, [self.box.run(c["name"], c["arguments"]) for c in case["calls"]])
        else:
            expected = case["answer"]
        final = self.final
        return dict(kind=case["kind"], request=case["request"], tools=sorted(_fn_names(case["tools"])),
                    expected_calls=case["calls"], first_turn=self.first_turn, first_turn_right=self.first_right,
                    error=self.first_reason, call_attempts=self.call_attempts, valid_calls=self.valid_calls,
                    rounds=self.rounds, final=final, expected_answer=expected,
                    episode_exact=final is not None and final.strip() == expected.strip(),
                    episode_values=final is not None and contains_values(final, answer_values(case, expected)),
                    forward_passes=self.forward_passes, seconds=self.seconds, generations=self.generations,
                    messages=self.messages)


def run_episodes(cases: list[dict], generate: Callable[[list[str]], list[Turn]],
                 render: Callable[[list[dict], list[dict]], str], seed: int = BENCH_SEED,
                 max_rounds: int = MAX_ROUNDS, batch: int = 1, progress: Callable[[int], None] | None = None) -> list[dict]:
    """Play every case to its end and return one record a case. Each case lives in its own seeded
    world; `batch` episodes advance together (one `generate` call a round), a call's wall-clock time
    shared equally among its rows."""
    worlds = random.Random(seed + 7)
    episodes = [Episode(c, toolbox.Toolbox(worlds.randrange(1 << 30))) for c in cases]
    for start in range(0, len(episodes), batch):
        chunk = episodes[start:start + batch]
        while active := [e for e in chunk if not e.done]:
            prompts = [render(e.messages, e.case["tools"]) for e in active]
            t0 = time.perf_counter()
            turns = generate(prompts)
            share = (time.perf_counter() - t0) / len(active)
            for e, turn in zip(active, turns):
                e.step(turn, share, max_rounds)
        if progress:
            progress(len(chunk))
    return [e.record() for e in episodes]


def _pct(flags: list[bool]) -> float | None:
    return 100 * sum(flags) / len(flags) if flags else None


def summarize_group(records: list[dict]) -> dict:
    """The METRICS of a group of case records (None where the group has no case the metric reads)."""
    n = len(records)
    calls = [r for r in records if r["expected_calls"]]
    direct = [r for r in records if not r["expected_calls"]]
    attempts = sum(r["call_attempts"] for r in records)
    errors = Counter(r["error"] for r in records if r["error"])
    return dict(
        cases=n,
        call_accuracy=_pct([r["first_turn_right"] for r in calls]),
        irrelevance_accuracy=_pct([r["first_turn_right"] for r in direct]),
        first_turn_accuracy=_pct([r["first_turn_right"] for r in records]),
        episode_exact=_pct([r["episode_exact"] for r in records]),
        episode_values=_pct([r["episode_values"] for r in records]),
        call_validity=100 * sum(r["valid_calls"] for r in records) / attempts if attempts else None,
        call_attempts=attempts,
        forward_passes_per_case=sum(r["forward_passes"] for r in records) / n if n else None,
        seconds_per_case=sum(r["seconds"] for r in records) / n if n else None,
        generations_per_case=sum(r["generations"] for r in records) / n if n else None,
        errors={k: errors[k] for k in ERROR_KINDS if errors[k]},
    )


def summarize(records: list[dict]) -> dict:
    """{"overall": metrics, "per_kind": {kind: metrics}} in toolbox.KINDS order."""
    kinds = [k for k in toolbox.KINDS if any(r["kind"] == k for r in records)]
    return dict(overall=summarize_group(records),
                per_kind={k: summarize_group([r for r in records if r["kind"] == k]) for k in kinds})


# ---- the model ----------------------------------------------------------------------------------------
def model_generator(model, tokenizer, mode: str = DEFAULTS.mode, threshold: float = DEFAULTS.threshold,
                    block_size: int = DEFAULTS.block_size,
                    max_new_tokens: int = MAX_NEW_TOKENS) -> Callable[[list[str]], list[Turn]]:
    """prompts -> greedy assistant turns from the decoding engine (one batch, up to EOS)."""
    import torch

    from ..api import decode_config
    from ..engine import Engine

    cfg = decode_config(model, tokenizer, max_new_tokens=max_new_tokens, block_size=block_size, threshold=threshold,
                        mode=mode)

    def generate(prompts: list[str]) -> list[Turn]:
        ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        with torch.inference_mode():
            seqs = Engine(model, cfg).generate(ids)
        return [Turn(tokenizer.decode(s.token_ids, skip_special_tokens=True), s.forward_passes) for s in seqs]
    return generate


def run_benchmark(model, tokenizer, n: int = 70, seed: int = BENCH_SEED, mode: str = DEFAULTS.mode,
                  threshold: float = DEFAULTS.threshold, block_size: int = DEFAULTS.block_size, max_new_tokens: int = MAX_NEW_TOKENS,
                  batch: int = 1, max_rounds: int = MAX_ROUNDS, progress=None) -> dict:
    """The whole benchmark for one decoding setting: settings, METRICS overall and per kind, and the
    per-case records (transcripts included)."""
    cases = held_out_cases(n, seed)
    generate = model_generator(model, tokenizer, mode, threshold, block_size, max_new_tokens)
    records = run_episodes(cases, generate, prompt_renderer(tokenizer), seed, max_rounds, batch, progress)
    return dict(mode=mode, threshold=threshold if mode != "ar" else None, block_size=block_size if mode != "ar" else 1,
                seed=seed, n=n, max_rounds=max_rounds, max_new_tokens=max_new_tokens, batch=batch,
                template_renders_tools=renders_tools(tokenizer), **summarize(records), records=records)


# ---- the report (`clover bench agent`) --------------------------------------------------------------------
def _pct_cell(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def run(args) -> int:
    """Tool-call accuracy (AST), irrelevance, and real multi-turn episodes on the seeded toolbox."""
    import torch

    from ..settings import MODES, DecodeConfig

    modes = [m for m in args.mode.split(",") if m]
    if not modes:
        raise UserError("--mode: name at least one decoding mode")
    for m in modes:
        if m not in MODES:
            raise UserError(f"--mode: unknown mode {m!r} (known: {', '.join(MODES)})")
        DecodeConfig(mode=m, block_size=args.block_size, threshold=args.threshold,
                     max_new_tokens=args.max_new_tokens)  # checks the setting
    if args.n < 1 or args.batch < 1:
        raise UserError("--n and --batch must be >= 1")
    model, tokenizer = load_checked(args, [args.block_size])
    from tqdm import tqdm

    bar = tqdm(total=args.n * len(modes), desc="bench agent", file=sys.stderr, leave=False,
               disable=not sys.stderr.isatty())
    runs = []
    for m in modes:
        bar.set_postfix_str(m)
        runs.append(run_benchmark(model, tokenizer, args.n, args.seed, m, args.threshold, args.block_size,
                                  args.max_new_tokens, args.batch, progress=bar.update))
    bar.close()
    described = args.model or "default model"
    print(f"Agent benchmark: {described}; {args.n} held-out toolbox cases (seed {args.seed}, 7 kinds, requests unseen "
          f"in training except weather/weather2/age), greedy, max {args.max_new_tokens} tokens a turn, up to "
          f"{MAX_ROUNDS} tool rounds, {model.device} {str(model.dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads. Call accuracy = first turn's calls AST-match the expected ones "
          f"(BFCL-style); irrelevance = no call where no tool helps; episode = final reply after real tool results "
          f"(exact / contains every value); valid = parsable calls to offered tools / call attempts; forwards and "
          f"seconds summed over an episode's turns (prefill not counted in forwards). docs/agent.md.\n")
    if not runs[0]["template_renders_tools"]:
        print("Note: this model's chat template does not render tools (it predates tool-use training); tools were "
              "rendered by clover.chat.normalize_messages, as the tool-aware template writes them.\n")
    rows = []
    for r in runs:
        setting = r["mode"] if r["mode"] == "ar" else f"{r['mode']} b={r['block_size']} t={r['threshold']:g}"
        for kind, g in [*r["per_kind"].items(), ("overall", r["overall"])]:
            rows.append([setting, f"**{kind}**" if kind == "overall" else kind, g["cases"], _pct_cell(g["call_accuracy"]),
                         _pct_cell(g["irrelevance_accuracy"]), _pct_cell(g["episode_exact"]),
                         _pct_cell(g["episode_values"]), _pct_cell(g["call_validity"]),
                         f"{g['forward_passes_per_case']:.1f}", f"{g['seconds_per_case']:.3f}"])
    print(markdown_table(["decoding", "kind", "cases", "call acc %", "irrelevance %", "episode exact %",
                          "episode values %", "valid calls %", "forwards / case", "s / case"], rows))
    if args.records:
        with open(args.records, "w") as f:
            for r in runs:
                for rec in r["records"]:
                    f.write(json.dumps(dict(mode=r["mode"], **rec)) + "\n")
    write_json(args, dict(model=described, n=args.n, seed=args.seed, threads=torch.get_num_threads(),
                          runs=[{k: v for k, v in r.items() if k != "records"} for r in runs]))
    return 0
