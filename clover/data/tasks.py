"""Seeded synthetic tasks for the default model, its evaluation and the joint-decision mode.

Every generator takes a `random.Random` and returns a plain dict, so other tools (evaluation,
joint decision) can reuse the same material:

    {"task": "add", "prompt": "What is 47+385?", "answer": "432", "think": "7+5=12 ..."}

`think` is a short reasoning trace (column-wise carries, ...) or None. Rendering:
* `plain_text(ex)`  -> "prompt answer" as raw text (the base-model format, one line per example);
* `chat_messages(ex, think)` -> Qwen-style messages; with `think` the assistant turn starts with
  "<think>\\n{trace}\\n</think>\\n\\n", without it with the empty block "<think>\\n\\n</think>\\n\\n"
  (what the chat template's `enable_thinking=False` generation prompt writes).

Decision-question groups (`decision_group`) are several linked questions about one small table:
{"task": "group", "material": str, "questions": [...], "answers": [...]} (2-8 questions).
"""

from __future__ import annotations

import random
import string

from clover.chat import EMPTY_THINK, THINK_CLOSE, THINK_OPEN

PEOPLE = ["Ann", "Bob", "Cid", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jon", "Kim", "Lou", "Max", "Ned"]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Kyiv", "Riga", "Bern", "Doha"]
PETS = ["cat", "dog", "fish", "bird", "frog"]

TASKS = ("add", "sub", "sort", "copy", "reverse", "lookup", "group")


def _digits(rng: random.Random, lo: int, hi: int) -> int:
    n = rng.randint(lo, hi)
    return rng.randint(10 ** (n - 1) if n > 1 else 0, 10**n - 1)


def add_trace(a: int, b: int) -> str:
    """Column-wise addition with carries, least significant column first."""
    da, db = str(a)[::-1], str(b)[::-1]
    carry, steps, out = 0, [], []
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={s}")
        out.append(str(s % 10))
        carry = s // 10
    if carry:
        out.append("1")
    return "; ".join(steps) + ". So " + "".join(reversed(out)) + "."


def sub_trace(a: int, b: int) -> str:
    da, db = str(a)[::-1], str(b)[::-1]
    borrow, steps = 0, []
    for i in range(len(da)):
        x = int(da[i]) - borrow
        y = int(db[i]) if i < len(db) else 0
        if x < y:
            steps.append(f"{x}+10-{y}={x + 10 - y} borrow")
            borrow = 1
        else:
            steps.append(f"{x}-{y}={x - y}")
            borrow = 0
    return "; ".join(steps) + f". So {a - b}."


def task_add(rng: random.Random, max_digits: int = 3) -> dict:
    a, b = _digits(rng, 1, max_digits), _digits(rng, 1, max_digits)
    return {"task": "add", "prompt": f"What is {a}+{b}?", "answer": str(a + b), "think": add_trace(a, b)}


def task_sub(rng: random.Random, max_digits: int = 3) -> dict:
    a, b = _digits(rng, 1, max_digits), _digits(rng, 1, max_digits)
    a, b = max(a, b), min(a, b)
    return {"task": "sub", "prompt": f"What is {a}-{b}?", "answer": str(a - b), "think": sub_trace(a, b)}


def task_sort(rng: random.Random, max_len: int = 6) -> dict:
    xs = [rng.randint(0, 99) for _ in range(rng.randint(3, max_len))]
    ys = sorted(xs)
    think = "Smallest first: " + ", ".join(map(str, ys)) + "."
    return {"task": "sort", "prompt": "Sort: " + " ".join(map(str, xs)), "answer": " ".join(map(str, ys)), "think": think}


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 3)))


def task_copy(rng: random.Random, max_len: int = 8) -> dict:
    ws = [_word(rng) for _ in range(rng.randint(3, max_len))]
    return {"task": "copy", "prompt": "Copy: " + " ".join(ws), "answer": " ".join(ws), "think": None}


def task_reverse(rng: random.Random, max_len: int = 6) -> dict:
    ws = [_word(rng) for _ in range(rng.randint(3, max_len))]
    return {"task": "reverse", "prompt": "Reverse: " + " ".join(ws), "answer": " ".join(reversed(ws)), "think": None}


def task_lookup(rng: random.Random, max_pairs: int = 6) -> dict:
    keys = rng.sample(string.ascii_lowercase, rng.randint(3, max_pairs))
    vals = [rng.randint(0, 99) for _ in keys]
    k = rng.randrange(len(keys))
    facts = " ".join(f"{a}={v}" for a, v in zip(keys, vals))
    think = f"The pair with {keys[k]} is {keys[k]}={vals[k]}."
    return {"task": "lookup", "prompt": f"{facts}. What is {keys[k]}?", "answer": str(vals[k]), "think": think}


def decision_group(rng: random.Random, min_q: int = 2, max_q: int = 8) -> dict:
    """A small table of people and 2-8 linked questions about it (some depend on others' answers)."""
    n = rng.randint(3, 5)
    names = rng.sample(PEOPLE, n)
    ages = rng.sample(range(18, 80), n)
    cities = [rng.choice(CITIES[:4]) for _ in names]
    pets = [rng.choice(PETS) for _ in names]
    rows = list(zip(names, ages, cities, pets))
    material = " ".join(f"{p} is {a}, lives in {c}, has a {t}." for p, a, c, t in rows)
    oldest = max(rows, key=lambda r: r[1])
    youngest = min(rows, key=lambda r: r[1])
    pool = []
    i, j = rng.sample(range(n), 2)
    pool.append((f"How old is {names[i]}?", str(ages[i])))
    pool.append((f"Where does {names[j]} live?", cities[j]))
    pool.append(("Who is the oldest?", oldest[0]))
    pool.append(("Where does the oldest live?", oldest[2]))  # linked to the previous question
    pool.append(("Who is the youngest?", youngest[0]))
    pool.append(("What pet does the youngest have?", youngest[3]))  # linked
    pool.append((f"Is {names[i]} older than {names[j]}?", "yes" if ages[i] > ages[j] else "no"))
    c = rng.choice(CITIES[:4])
    pool.append((f"How many live in {c}?", str(sum(x == c for x in cities))))
    pool.append((f"What pet does {names[j]} have?", pets[j]))
    k = rng.randint(min_q, min(max_q, len(pool)))
    picked = sorted(rng.sample(range(len(pool)), k))
    qs = [pool[p][0] for p in picked]
    ans = [pool[p][1] for p in picked]
    return {"task": "group", "material": material, "questions": qs, "answers": ans}


def group_as_example(g: dict) -> dict:
    """Render a decision group as one prompt/answer example (answers as 'A1: x A2: y ...')."""
    qs = " ".join(f"Q{i + 1}: {q}" for i, q in enumerate(g["questions"]))
    ans = " ".join(f"A{i + 1}: {a}" for i, a in enumerate(g["answers"]))
    return {"task": "group", "prompt": f"{g['material']} {qs}", "answer": ans, "think": None,
            "questions": g["questions"], "answers": g["answers"], "material": g["material"]}


GENERATORS = {
    "add": task_add,
    "sub": task_sub,
    "sort": task_sort,
    "copy": task_copy,
    "reverse": task_reverse,
    "lookup": task_lookup,
    "group": lambda rng: group_as_example(decision_group(rng, 2, 5)),
}


def make_example(task: str, rng: random.Random) -> dict:
    if task not in GENERATORS:
        raise ValueError(f"unknown task {task!r} (known: {', '.join(GENERATORS)})")
    return GENERATORS[task](rng)


def plain_text(ex: dict) -> str:
    """Base-model format: 'prompt\\nanswer' (the trainer appends end-of-text)."""
    return f"{ex['prompt']}\n{ex['answer']}"


def plain_prompt(ex: dict) -> str:
    return f"{ex['prompt']}\n"


def chat_messages(ex: dict, think: bool) -> list[dict]:
    if think and ex.get("think"):
        reply = f"{THINK_OPEN}\n{ex['think']}\n{THINK_CLOSE}\n\n{ex['answer']}"
    else:
        reply = EMPTY_THINK + ex["answer"]
    return [{"role": "user", "content": ex["prompt"]}, {"role": "assistant", "content": reply}]


def generate_split(seed: int, n: int, tasks=TASKS, exclude: set | None = None) -> list[dict]:
    """`n` examples cycling over `tasks`, none of whose prompts is in `exclude`."""
    rng = random.Random(seed)
    out, seen = [], set(exclude or ())
    while len(out) < n:
        ex = make_example(tasks[len(out) % len(tasks)], rng)
        if ex["prompt"] in seen:
            continue
        seen.add(ex["prompt"])
        out.append(ex)
    return out


# ---- joint decision mode: answer specs and the decision benchmark --------------------------------
# New functions only: the rendering above (`group_as_example`, `plain_text`) is what the default
# model is trained on and stays as it is.
def group_prompt(material: str, questions: list[str]) -> str:
    """The prompt of a decision group exactly as training renders it ('<material> Q1: ... Q2: ...\\n');
    the answers follow as 'A1: x A2: y' (`group_as_example`)."""
    g = {"material": material, "questions": list(questions), "answers": [""] * len(questions)}
    return plain_prompt(group_as_example(g))


def question_spec(question: str, material: str) -> dict:
    """The answer spec of one `decision_group` question: {"options": [...]}, {"type": "boolean"} or
    {"type": "integer", "max_tokens": digits}. Names come from the material ('X is 34, ...')."""
    import re

    if question.startswith("Is "):
        return {"type": "boolean"}
    if question.startswith(("How old", "How many")):
        return {"type": "integer", "max_tokens": 2}
    if question.startswith("Who "):
        return {"options": re.findall(r"(\w+) is \d+,", material)}
    if question.startswith("Where "):
        return {"options": list(CITIES[:4])}
    if question.startswith("What pet"):
        return {"options": list(PETS)}
    raise ValueError(f"no answer spec for {question!r}")


def decision_record(g: dict) -> dict:
    """A `decision_group` with one answer spec per question (for `clover.decide` and its benchmark)."""
    return {**g, "specs": [question_spec(q, g["material"]) for q in g["questions"]]}


def decision_split(seed: int, n: int, exclude: set | None = None, min_q: int = 2, max_q: int = 8) -> list[dict]:
    """`n` decision records (2-8 linked questions each) whose material is not in `exclude`."""
    rng = random.Random(seed)
    out, seen = [], set(exclude or ())
    while len(out) < n:
        g = decision_group(rng, min_q, max_q)
        if g["material"] in seen:
            continue
        seen.add(g["material"])
        out.append(decision_record(g))
    return out


def decision_benchmark(seed: int = 0, n_train: int = 5000, n_heldout: int = 500) -> tuple[list[dict], list[dict]]:
    """(train, held-out) splits of the decision benchmark; no held-out material appears in train.
    Train records render for training with `group_as_example` (`decision_train_examples`)."""
    train = decision_split(seed * 2 + 101, n_train)
    heldout = decision_split(seed * 2 + 102, n_heldout, exclude={r["material"] for r in train})
    return train, heldout


def decision_train_examples(seed: int = 0, n_train: int = 5000) -> list[dict]:
    """The benchmark's train split as prompt/answer examples (the training rendering)."""
    return [group_as_example(r) for r in decision_benchmark(seed, n_train, 0)[0]]
