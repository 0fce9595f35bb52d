"""`clover bench structured`, the structured-output benchmark, and (`--corpus`) coverage on the
real-world schema corpus (clover/structured/corpus.py).

Seeded JSON requests in the default model's training domains (people records, arithmetic, lookups, comparisons, tool-call arguments,
sorting), each with a JSON schema and the ground-truth value, answered three ways:

* **infill**: `generate_json` (the schema's scaffold laid out, the values denoised); the tool kinds
  are infilled inside the call frame after the rendered tools, as the server serves a forced tool
  call (`infill_json` with the `<tool_call>` prefix and suffix);
* **grammar**: the same schema decoded left to right under its grammar (`generate_json(method="grammar")`,
  the tool kinds `grammar_json` inside the call frame): the path schemas the infiller cannot lay out take;
* **free**: the same prompt (and call frame) generated freely by the engine, then parsed and
  validated the same way (`generate_json(method="free")`).

Measured per kind and overall: valid rate (parses and validates), exact rate (valid and every field
equal to the ground truth, `fields_right`), field rate (share of fields right), forward passes and
seconds per case. docs/structured.md.
"""

from __future__ import annotations

import json
import random
from typing import Callable

from ..chat import CALL_END, CALL_HEAD
from ..data import tasks
from ..errors import UserError
from ..settings import INFILL_THRESHOLD
from ..structured.generate import JsonResult, generate_json, infill_json
from ..structured.result import BudgetTooSmall
from ..structured.grammar import grammar_json
from ..structured.normalize import normalize
from .report import load_checked, markdown_table, progress, set_threads, write_json

BENCH_SEED = 1000
KINDS = ("record", "arithmetic", "lookup", "compare", "tool_arith", "tool_convert", "sort")
METHODS = ("infill", "grammar", "free")
METRICS = ("cases", "valid_rate", "exact_rate", "field_rate", "forward_passes_per_case", "seconds_per_case")
SORT_MAX = 6  # tasks.task_sort's longest list

_INTEGER = {"type": "integer"}


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


RECORD_SCHEMA = _obj({"name": {"type": "string", "maxLength": 8},
                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                      "city": {"enum": list(tasks.CITIES)}, "pet": {"enum": list(tasks.PETS)}})
ANSWER_SCHEMA = _obj({"answer": _INTEGER})
LOOKUP_SCHEMA = _obj({"key": {"type": "string", "minLength": 1, "maxLength": 1},
                      "value": {"type": "integer", "minimum": 0, "maximum": 99}})
COMPARE_SCHEMA = _obj({"older": {"type": "boolean"}})
SORT_SCHEMA = _obj({"sorted": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                               "minItems": 1, "maxItems": SORT_MAX}})


def _people(rng: random.Random, k: int) -> tuple[list[tuple], str]:
    """k people (name, age, city, pet) and their material, as decision groups write it."""
    rows = list(zip(rng.sample(tasks.PEOPLE, k), rng.sample(range(18, 80), k),
                    [rng.choice(tasks.CITIES) for _ in range(k)], [rng.choice(tasks.PETS) for _ in range(k)]))
    return rows, " ".join(f"{p} is {a}, lives in {c}, has a {t}." for p, a, c, t in rows)


def _chat_case(kind: str, text: str, schema: dict, expected) -> dict:
    return dict(kind=kind, messages=[{"role": "user", "content": text}], tools=None, prefix="", suffix="",
                schema=schema, expected=expected)


def _tool_case(kind: str, rng: random.Random, toolbox_kind: str) -> dict:
    from ..data import toolbox

    case = toolbox.make_case(rng, toolbox_kind)
    (call,) = case["calls"]
    spec = next(t["function"] for t in case["tools"] if t["function"]["name"] == call["name"])
    return dict(kind=kind,
                messages=[{"role": "user", "content": case["request"]}], tools=case["tools"],
                prefix=CALL_HEAD + json.dumps(call["name"]) + ', "arguments": ',
                suffix=CALL_END, schema=spec["parameters"], expected=call["arguments"])


def make_case(rng: random.Random, kind: str) -> dict:
    """One case: {"kind", "messages", "tools" (None but for tool kinds), "prefix"/"suffix" (the call
    frame of tool kinds, else ""), "schema", "expected"}."""
    if kind == "record":
        rows, material = _people(rng, rng.randint(1, 3))
        name, age, city, pet = rng.choice(rows)
        return _chat_case(kind, f"{material} Give {name}'s record as JSON.", RECORD_SCHEMA,
                          {"name": name, "age": age, "city": city, "pet": pet})
    if kind == "arithmetic":
        ex = tasks.make_example(rng.choice(["add", "sub"]), rng)
        return _chat_case(kind, f"{ex['prompt']} Answer as JSON.", ANSWER_SCHEMA, {"answer": int(ex["answer"])})
    if kind == "lookup":
        ex = tasks.task_lookup(rng)
        key = ex["prompt"].rsplit("What is ", 1)[1].rstrip("?")
        return _chat_case(kind, f"{ex['prompt']} Give the key and its value as JSON.", LOOKUP_SCHEMA,
                          {"key": key, "value": int(ex["answer"])})
    if kind == "compare":
        rows, material = _people(rng, rng.randint(2, 4))
        (a, age_a, *_), (b, age_b, *_) = rng.sample(rows, 2)
        return _chat_case(kind, f"{material} Is {a} older than {b}? Answer as JSON.", COMPARE_SCHEMA,
                          {"older": age_a > age_b})
    if kind == "tool_arith":
        return _tool_case(kind, rng, rng.choice(["add", "subtract"]))
    if kind == "tool_convert":
        return _tool_case(kind, rng, "convert")
    if kind == "sort":
        ex = tasks.task_sort(rng, SORT_MAX)
        return _chat_case(kind, f"{ex['prompt']}. Answer as JSON.", SORT_SCHEMA,
                          {"sorted": [int(x) for x in ex["answer"].split()]})
    raise ValueError(f"unknown case kind {kind!r} (known: {', '.join(KINDS)})")


def cases(n: int = 10, seed: int = BENCH_SEED) -> list[dict]:
    """`n` cases of each kind, kind by kind (seeded: the same n and seed give the same cases)."""
    rng = random.Random(seed)
    return [make_case(rng, kind) for kind in KINDS for _ in range(n)]


# ---- scoring -------------------------------------------------------------------------------------
def same(got, want) -> bool:
    """JSON values equal: numbers by value (12 == 12.0), booleans only to booleans, lists in order,
    objects key by key."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)):
        return isinstance(got, (int, float)) and float(got) == float(want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same, got, want))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], v) for k, v in want.items())
    return type(got) is type(want) and got == want


def fields_right(value, expected) -> tuple[int, int]:
    """(fields right, fields): an object's top-level fields compared one by one (a missing one is
    wrong), any other value as one field."""
    if not isinstance(expected, dict):
        return int(same(value, expected)), 1
    got = value if isinstance(value, dict) else {}
    return sum(k in got and same(got[k], v) for k, v in expected.items()), len(expected)


# ---- running -------------------------------------------------------------------------------------
def case_prompt(tokenizer, case: dict):
    """What the model reads: the chat messages (generate_json renders them), or for a tool kind the
    rendered request with its tools (clover.agent.bench.prompt_renderer) as text."""
    if not case["tools"]:
        return case["messages"]
    from ..chat import prompt_renderer

    return prompt_renderer(tokenizer)(case["messages"], case["tools"])


def answer(model, tokenizer, case: dict, method: str, threshold: float = INFILL_THRESHOLD, block_size: int = 32,
           max_new_tokens: int = 64) -> JsonResult:
    """The case answered by `method` ("infill", "grammar" or "free"); a case whose smallest valid
    document does not fit max_new_tokens is refused (not valid, its reason as the error)."""
    import time

    start = time.perf_counter()
    try:
        return _answer(model, tokenizer, case, method, threshold, block_size, max_new_tokens)
    except BudgetTooSmall as e:
        return JsonResult("", None, False, method, 0, time.perf_counter() - start, None, str(e), complete=False)


def _answer(model, tokenizer, case, method, threshold, block_size, max_new_tokens) -> JsonResult:
    from ..api import encode

    prompt = case_prompt(tokenizer, case)
    if method == "infill" and case["prefix"]:
        return infill_json(model, tokenizer, encode(tokenizer, prompt), case["schema"], prefix=case["prefix"],
                           suffix=case["suffix"], threshold=threshold, block_size=block_size)
    if method == "grammar" and case["prefix"]:
        return grammar_json(model, tokenizer, encode(tokenizer, prompt), normalize(case["schema"]),
                            prefix=case["prefix"], suffix=case["suffix"], max_new_tokens=max_new_tokens)
    if case["prefix"]:
        prompt += case["prefix"]
    return generate_json(model, tokenizer, prompt, case["schema"], threshold=threshold, block_size=block_size,
                         max_new_tokens=max_new_tokens, method="auto" if method == "infill" else method)


def record(case: dict, method: str, out: JsonResult) -> dict:
    right, total = fields_right(out.value, case["expected"]) if out.valid else (0, len(case["expected"]))
    return dict(kind=case["kind"], method=method, ran=out.method, request=case["messages"][-1]["content"],
                schema=case["schema"], expected=case["expected"], text=out.text, value=out.value, valid=out.valid,
                error=out.error, exact=out.valid and right == total, fields_right=right, fields=total,
                forward_passes=out.forward_passes, seconds=out.seconds)


def summarize_group(records: list[dict]) -> dict:
    n = len(records)
    if not n:
        return dict.fromkeys(METRICS, None) | {"cases": 0}
    return dict(cases=n, valid_rate=sum(r["valid"] for r in records) / n,
                exact_rate=sum(r["exact"] for r in records) / n,
                field_rate=sum(r["fields_right"] for r in records) / sum(r["fields"] for r in records),
                forward_passes_per_case=sum(r["forward_passes"] for r in records) / n,
                seconds_per_case=sum(r["seconds"] for r in records) / n)


def summarize(records: list[dict]) -> dict:
    """{method: {"overall": metrics, "per_kind": {kind: metrics}}} in METHODS and KINDS order."""
    out = {}
    for m in METHODS:
        mine = [r for r in records if r["method"] == m]
        kinds = [k for k in KINDS if any(r["kind"] == k for r in mine)]
        out[m] = dict(overall=summarize_group(mine),
                      per_kind={k: summarize_group([r for r in mine if r["kind"] == k]) for k in kinds})
    return out


def run_benchmark(model, tokenizer, n: int = 10, seed: int = BENCH_SEED, threshold: float = INFILL_THRESHOLD,
                  block_size: int = 32, max_new_tokens: int = 64,
                  progress: Callable[[int], None] | None = None) -> dict:
    """The whole benchmark: settings, {method: metrics overall and per kind}, and one record per case
    and method. The methods take turns going first (an equal share of any contention),
    after one untimed warm-up of each."""
    import torch

    if n < 1 or max_new_tokens < 1:
        raise ValueError("n and max_new_tokens must be >= 1")
    todo = cases(n, seed)
    records = []
    with torch.inference_mode():
        for m in METHODS:  # warm-up, not counted
            answer(model, tokenizer, todo[0], m, threshold, block_size, max_new_tokens)
        for i, case in enumerate(todo):
            for m in METHODS[i % len(METHODS):] + METHODS[:i % len(METHODS)]:
                records.append(record(case, m, answer(model, tokenizer, case, m, threshold, block_size,
                                                      max_new_tokens)))
            if progress:
                progress(1)
    records.sort(key=lambda r: METHODS.index(r["method"]))  # stable: cases stay in order
    return dict(n=n, seed=seed, threshold=threshold, block_size=block_size, max_new_tokens=max_new_tokens,
                kinds=list(KINDS), cases=len(todo), results=summarize(records), records=records)



def _rate_cell(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _kinds_and_overall(summary: dict) -> list[tuple[str, dict]]:
    """(label, metrics) for each kind, then the bold overall row."""
    return [*summary["per_kind"].items(), ("**overall**", summary["overall"])]


def run(args) -> int:
    """Schema-guided infilling vs free generation + validation on seeded JSON requests."""
    import torch

    if args.n < 1 or args.max_new_tokens < 1:
        raise UserError("--n and --max-new-tokens must be >= 1")
    if args.corpus:
        return run_corpus(args)
    if not 0 <= args.threshold <= 1:
        raise UserError("--threshold must be in [0, 1]")
    model, tokenizer = load_checked(args, [args.block_size], low=2)
    with progress(args.n * len(KINDS), "bench structured") as bar:
        out = run_benchmark(model, tokenizer, args.n, args.seed, args.threshold, args.block_size,
                            args.max_new_tokens, progress=bar.update)
    described = args.model or "default model"
    print(f"Structured output: {described}; {args.n} seeded cases of each of {len(KINDS)} kinds (seed {args.seed}), "
          f"threshold {args.threshold:g}, block {args.block_size}, {model.device} "
          f"{str(model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads. infill = generate_json "
          f"(tool kinds: infill_json inside the <tool_call> frame, as the server's forced calls); grammar = the same "
          f"schema decoded left to right under its xgrammar mask (method='grammar'); free = the same "
          f"prompt generated freely (low_confidence, up to {args.max_new_tokens} tokens), then parsed and validated. "
          f"Valid = parses and validates; exact = valid and every field equals the ground truth; fields = share of "
          f"fields right; forwards after the prompt prefill. docs/structured.md.\n")
    rows = [[m, kind, g["cases"], *(_rate_cell(g[k]) for k in ("valid_rate", "exact_rate", "field_rate")),
             f"{g['forward_passes_per_case']:.1f}", f"{g['seconds_per_case']:.3f}"]
            for m in METHODS for kind, g in _kinds_and_overall(out["results"][m])]
    print(markdown_table(["method", "kind", "cases", "valid %", "exact %", "fields %", "forwards / case", "s / case"],
                         rows))
    if args.records:
        with open(args.records, "w") as f:
            for rec in out["records"]:
                f.write(json.dumps(rec) + "\n")
    write_json(args, dict(model=described, threads=torch.get_num_threads(),
                          **{k: v for k, v in out.items() if k != "records"}))
    return 0


def run_corpus(args) -> int:
    """Coverage (valid / total) of the schema corpus: every entry infilled, decoded under its grammar
    or refused; 0 invalid replies is the guarantee, coverage the share answered validly."""
    import torch

    from ..api import load
    from ..structured import corpus

    if args.per_file < 0 or args.max_tokens < 1:
        raise UserError("--per-file must be >= 0 and --max-tokens >= 1")
    entries = corpus.load(per_file=args.per_file, only=args.only)
    if not entries:
        raise UserError(f"--only {args.only!r} matches no corpus entry")
    set_threads(args.threads)
    model, tokenizer = load(args.model, args.device)
    described = args.model or "default model"
    if args.random_weights is not None:  # same dims, vocabulary and tokenizer; no training
        from ..models import CloverForBlockDiffusion

        torch.manual_seed(args.random_weights)
        model = CloverForBlockDiffusion(model.config).to(device=model.device, dtype=model.dtype).eval()
        described = f"random weights (seed {args.random_weights}) at the {described}'s config and tokenizer"
    records = []
    with progress(len(entries), "bench structured --corpus") as bar, torch.inference_mode():
        for e in entries:
            records.append(corpus.answer(model, tokenizer, e, args.max_tokens, args.threshold, args.block_size))
            bar.update(1)
    out = corpus.summarize(records)
    print(f"Structured output on the schema corpus: {described}; {len(entries)} schemas (SchemaStore documents via "
          f"check-jsonschema with {args.per_file} definitions each, JSON Schema meta-schemas, pydantic models, "
          f"BFCL-style functions, OpenAPI/Kubernetes payloads), each answered as a json_schema response_format "
          f"(normalised, then infilled or decoded under its grammar, or refused: a 400 naming the keyword), "
          f"up to {args.max_tokens} tokens, {model.device}, {torch.get_num_threads()} threads. valid = json.loads + "
          f"jsonschema accept the returned text; coverage = valid / total; refused = a 400 naming the keyword (or "
          f"max_tokens: the smallest valid document does not fit); invalid = complete replies that fail (a 500 in "
          f"the server); cut = max_tokens ran out (never returned: a 400); errors = exceptions (a 500); slowest = "
          f"the longest answer or refusal, wall time. docs/structured.md.\n")
    header = ["", "schemas", "valid", "coverage %", "refused", "invalid", "cut", "errors", "forwards / reply",
              "s / reply", "slowest s", "> 60 s"]

    def row(label, g):
        return [label, g["total"], g["valid"], _rate_cell(g["coverage"]), g["refused"], g["invalid"] - g["incomplete"],
                g["incomplete"], g["errors"], f"{g['forward_passes_per_reply']:.1f}", f"{g['seconds_per_reply']:.2f}",
                f"{g['slowest_seconds']:.1f}", g["over_60s"]]
    print(markdown_table(["source"] + header[1:], [row(k, g) for k, g in out["per_source"].items()]
                         + [row("**overall**", out["overall"])]))
    print()
    print(markdown_table(["method"] + header[1:], [row(k, g) for k, g in out["per_method"].items()]))
    refused = {}
    for r in records:
        if r["method"] == "refused":
            refused[r["keyword"]] = refused.get(r["keyword"], 0) + 1
    if refused:
        print("\nRefused, by keyword: " + ", ".join(f"`{k}` {v}" for k, v in sorted(refused.items(), key=lambda kv: -kv[1])))
    if args.records:
        with open(args.records, "w") as f:
            for rec in records:
                f.write(json.dumps(rec, default=str) + "\n")
    write_json(args, dict(model=described, threads=torch.get_num_threads(), schemas=len(entries), **out))
    return 0
