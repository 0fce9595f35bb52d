"""A small local toolbox (calculator, weather table, unit converter, staff ages) and seeded tool-use
cases: the default model's tool-use training dialogues and the agent benchmark share them.

A case is {"kind", "tools": [OpenAI specs], "request": str, "calls": [{"name", "arguments"}] (empty:
answer without a tool), "answer": str (the direct answer when there is no call)}. `Toolbox(seed)` is
one world (weather and ages drawn from the seed); `Toolbox.run` executes a call for real and
`final_answer` is what the model should say once it has the results.
"""

from __future__ import annotations

import json
import random

from . import tasks

# The recipe's tool dialogues: held-out loss records are cases(recipe_seed + HELD_DIALOGUE_SEED, ..),
# training records cases(recipe_seed + TRAIN_DIALOGUE_SEED, ..) (focus rounds continue that stream).
HELD_DIALOGUE_SEED, TRAIN_DIALOGUE_SEED = 3, 4
# Training requests the agent benchmark excludes: cases(recipe_seed + s, n) for each (s, n). `cases` is
# prefix-stable, so 20000 covers every training dialogue up to number 20000 (the recipe's base data
# uses 8000 and 8000 // 20 held out; focus rounds continue the training stream, bounded by this).
TRAINING_SEEDS = ((HELD_DIALOGUE_SEED, 400), (TRAIN_DIALOGUE_SEED, 20000))

UNITS = {"km": 1000.0, "mi": 1609.344, "m": 1.0, "ft": 0.3048}


def _spec(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required}}}


SPECS = {
    "add": _spec("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]),
    "subtract": _spec("subtract", "Subtract b from a.", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]),
    "get_weather": _spec("get_weather", "Temperature in a city (C).", {"city": {"type": "string"}}, ["city"]),
    "convert_length": _spec("convert_length", "Convert a length.", {
        "value": {"type": "number"}, "from_unit": {"enum": list(UNITS)}, "to_unit": {"enum": list(UNITS)}},
        ["value", "from_unit", "to_unit"]),
    "get_age": _spec("get_age", "Age of a staff member.", {"name": {"type": "string"}}, ["name"]),
}


def _num(x: float) -> str:
    return f"{round(x, 1):g}"


class Toolbox:
    """One seeded world: the tools' real implementations."""

    def __init__(self, seed: int = 0):
        rng = random.Random(seed)
        self.weather = {c: rng.randint(-5, 35) for c in tasks.CITIES}
        self.ages = {p: rng.randint(18, 79) for p in tasks.PEOPLE}

    def run(self, name: str, arguments: dict) -> str:
        """The tool's result as text; a bad call gets an error message (as a real tool would send)."""
        try:
            if name == "add":
                return str(int(arguments["a"]) + int(arguments["b"]))
            if name == "subtract":
                return str(int(arguments["a"]) - int(arguments["b"]))
            if name == "get_weather":
                return str(self.weather[arguments["city"]])
            if name == "convert_length":
                v = float(arguments["value"]) * UNITS[arguments["from_unit"]] / UNITS[arguments["to_unit"]]
                return _num(v)
            if name == "get_age":
                return str(self.ages[arguments["name"]])
        except (KeyError, TypeError, ValueError) as e:
            return f"error: bad arguments ({e})"
        return f"error: unknown tool {name}"


def final_answer(case: dict, results: list[str]) -> str:
    """The reply once the tool results are in (the training target and the episode's expected answer)."""
    kind, calls = case["kind"], case["calls"]
    if kind in ("add", "subtract"):
        a, b = calls[0]["arguments"]["a"], calls[0]["arguments"]["b"]
        return f"{a}{'+' if kind == 'add' else '-'}{b} = {results[0]}."
    if kind in ("weather", "weather2"):
        return " and ".join(f"{results[i]} C in {c['arguments']['city']}" for i, c in enumerate(calls)) + "."
    if kind == "convert":
        a = calls[0]["arguments"]
        return f"{a['value']} {a['from_unit']} is {results[0]} {a['to_unit']}."
    if kind == "age":
        return f"{calls[0]['arguments']['name']} is {results[0]}."
    raise ValueError(f"no final answer for kind {kind!r}")


def _call(fn: str, **arguments) -> dict:
    return {"name": fn, "arguments": arguments}


KINDS = ("add", "subtract", "weather", "weather2", "convert", "age", "irrelevant")
_NEEDS = {"add": "add", "subtract": "subtract", "weather": "get_weather", "weather2": "get_weather",
          "convert": "convert_length", "age": "get_age"}


def make_case(rng: random.Random, kind: str) -> dict:
    """One seeded request with the tools on offer (the needed one + 0-2 others, shuffled)."""
    answer = None
    if kind == "add":
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        req, calls = rng.choice(["What is {a}+{b}?", "Add {a} and {b}."]).format(a=a, b=b), [_call("add", a=a, b=b)]
    elif kind == "subtract":
        a, b = sorted((rng.randint(0, 999), rng.randint(0, 999)), reverse=True)
        req, calls = f"What is {a}-{b}?", [_call("subtract", a=a, b=b)]
    elif kind == "weather":
        c = rng.choice(tasks.CITIES)
        req = rng.choice(["What is the weather in {c}?", "How warm is it in {c}?"]).format(c=c)
        calls = [_call("get_weather", city=c)]
    elif kind == "weather2":
        c1, c2 = rng.sample(tasks.CITIES, 2)
        req, calls = f"What is the weather in {c1} and {c2}?", [_call("get_weather", city=c1), _call("get_weather", city=c2)]
    elif kind == "convert":
        u1, u2 = rng.sample(list(UNITS), 2)
        v = rng.randint(1, 500)
        req, calls = f"Convert {v} {u1} to {u2}.", [_call("convert_length", value=v, from_unit=u1, to_unit=u2)]
    elif kind == "age":
        p = rng.choice(tasks.PEOPLE)
        req, calls = f"How old is {p}?", [_call("get_age", name=p)]
    elif kind == "irrelevant":  # a task no tool helps with: answered directly
        ex = tasks.make_example(rng.choice(["copy", "sort", "reverse", "lookup"]), rng)
        req, calls, answer = ex["prompt"], [], ex["answer"]
    else:
        raise ValueError(f"unknown case kind {kind!r} (known: {', '.join(KINDS)})")
    need = _NEEDS.get(kind)
    others = [n for n in SPECS if n != need]
    names = ([need] if need else []) + rng.sample(others, rng.randint(0 if need else 1, 1 if need else 2))
    rng.shuffle(names)
    return {"kind": kind, "tools": [SPECS[n] for n in names], "request": req, "calls": calls, "answer": answer}


def case_dialogue(case: dict, box: Toolbox) -> dict:
    """The full training dialogue of a case: {"messages", "tools"} with real tool results."""
    msgs = [{"role": "user", "content": case["request"]}]
    if not case["calls"]:
        msgs.append({"role": "assistant", "content": case["answer"]})
        return {"messages": msgs, "tools": case["tools"]}
    msgs.append({"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
        for c in case["calls"]]})
    results = [box.run(c["name"], c["arguments"]) for c in case["calls"]]
    msgs += [{"role": "tool", "content": r} for r in results]
    msgs.append({"role": "assistant", "content": final_answer(case, results)})
    return {"messages": msgs, "tools": case["tools"]}


SMALL_KINDS = ("weather", "weather2", "age")  # a city or a name: too few requests to keep splits apart


def cases(seed: int, n: int, exclude: set | None = None) -> list[dict]:
    """`n` cases cycling over KINDS; requests are unique and not in `exclude`, except for SMALL_KINDS
    (what tells their held-out cases apart is the tools on offer and the world's values)."""
    rng = random.Random(seed)
    out, seen = [], set(exclude or ())
    while len(out) < n:
        c = make_case(rng, KINDS[len(out) % len(KINDS)])
        if c["request"] in seen and c["kind"] not in SMALL_KINDS:
            continue
        seen.add(c["request"])
        out.append(c)
    return out


def training_dialogues(seed: int, n: int, exclude: set | None = None) -> list[dict]:
    """Tool-use training records; every dialogue lives in its own seeded world."""
    rng = random.Random(seed + 7)
    return [case_dialogue(c, Toolbox(rng.randrange(1 << 30))) for c in cases(seed, n, exclude)]
