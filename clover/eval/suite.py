"""The offline evaluation suite: seeded JSONL files behind the lm-eval task YAMLs in `tasks/`.

* held-out synthetic tasks of the default model (`clover.data.tasks`, the same examples as the
  recipe's `eval_tasks.jsonl`: `generate_split(seed + 1, ...)`, whose prompts the training split
  excludes): `arithmetic` (add, sub), `sorting`, `copy` (copy, reverse), `lookup`, `decisions`
  (decision groups, answers "A1: x A2: y ...");
* `arithmetic_mc`: the same arithmetic prompts as four-way multiple choice (loglikelihood);
* `word_problems`: GSM8K-style grade-school word problems (2-3 steps, integer answers, a worked
  solution ending in "#### N"), generated here with the same seed.

Files live in `data_dir()` ($CLOVER_EVAL_DATA, else ~/.cache/clover/eval/suite-v1-seed0) and are
written on first use, so task YAMLs work from an installed package; `build_suite(DIR)` writes them
anywhere (`clover eval --build-suite DIR`). Same seed, same files, byte for byte.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from ..data import tasks as T
from ..utils.files import atomic_write

VERSION = 1
SEED = 0  # the default recipe's seed (recipes/default/recipe.toml)
PER_TASK = 40  # held-out prompts per synthetic task (the recipe's n_eval)
N_WORD_PROBLEMS = 100
FILES = ("arithmetic", "sorting", "copy", "lookup", "decisions", "arithmetic_mc", "word_problems")
MAX_GEN_TOKS = {"arithmetic": 16, "sorting": 32, "copy": 48, "lookup": 8, "decisions": 64, "word_problems": 96}  # = YAMLs
GROUPS = {"arithmetic": ("add", "sub"), "sorting": ("sort",), "copy": ("copy", "reverse"),
          "lookup": ("lookup",), "decisions": ("group",)}


def data_dir() -> Path:
    env = os.environ.get("CLOVER_EVAL_DATA")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "clover" / "eval" / f"suite-v{VERSION}-seed{SEED}"


# ---- multiple choice ------------------------------------------------------------------------------
def distractors(answer: int, rng: random.Random, k: int = 3) -> list[int]:
    """k wrong answers near the right one (off by one, by ten, a digit swap), all >= 0, distinct."""
    pool = {answer + 1, answer - 1, answer + 10, answer - 10, answer + 100, answer - 100, answer + 2}
    s = str(answer)
    if len(s) > 1:
        pool.add(int(s[:-2] + s[-1] + s[-2]))
    pool = sorted(x for x in pool if x >= 0 and x != answer)
    rng.shuffle(pool)
    return pool[:k]


def multiple_choice(ex: dict, rng: random.Random) -> dict:
    choices = [str(x) for x in distractors(int(ex["answer"]), rng)] + [ex["answer"]]
    rng.shuffle(choices)
    return {"task": ex["task"], "prompt": ex["prompt"], "answer": ex["answer"], "choices": choices,
            "gold": choices.index(ex["answer"])}


# ---- GSM8K-style word problems ----------------------------------------------------------------------
ITEMS = ["apples", "pencils", "stamps", "marbles", "cookies", "books", "shells", "cards"]


def word_problem(rng: random.Random) -> dict:
    """A 2-3 step word problem with its worked solution, GSM8K style ("... #### N")."""
    a, b = rng.sample(T.PEOPLE, 2)
    item = rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        x, y, z = rng.randint(5, 60), rng.randint(2, 40), rng.randint(1, 20)
        z = min(z, x + y)
        q = f"{a} has {x} {item}. {a} buys {y} more and gives {z} to {b}. How many {item} does {a} have now?"
        sol = f"{a} has {x}+{y}={x + y} {item} after buying. After giving {z} away, {x + y}-{z}={x + y - z}."
        ans = x + y - z
    elif kind == 1:
        n, per, extra = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 30)
        q = f"{a} fills {n} boxes with {per} {item} each and has {extra} {item} left over. How many {item} did {a} have?"
        sol = f"The boxes hold {n}*{per}={n * per} {item}. With the rest, {n * per}+{extra}={n * per + extra}."
        ans = n * per + extra
    elif kind == 2:
        price, n, paid = rng.randint(2, 15), rng.randint(2, 8), 0
        paid = price * n + rng.randint(0, 50)
        q = f"{a} buys {n} {item} at {price} dollars each and pays with {paid} dollars. How much change does {a} get?"
        sol = f"The {item} cost {n}*{price}={n * price} dollars. The change is {paid}-{n * price}={paid - n * price}."
        ans = paid - n * price
    else:
        x, k, y = rng.randint(3, 40), rng.randint(2, 5), rng.randint(1, 25)
        q = f"{b} has {x} {item}. {a} has {k} times as many as {b}, plus {y} more. How many {item} do they have together?"
        sol = f"{a} has {k}*{x}+{y}={k * x + y}. Together {x}+{k * x + y}={x + k * x + y}."
        ans = x + k * x + y
    return {"task": "word_problem", "prompt": q, "answer": str(ans), "solution": f"{sol}\n#### {ans}"}


# ---- building and loading ---------------------------------------------------------------------------
def suite_records(seed: int = SEED, per_task: int = PER_TASK, n_word: int = N_WORD_PROBLEMS) -> dict[str, list[dict]]:
    held = T.generate_split(seed + 1, per_task * len(T.TASKS))  # == the recipe's eval_tasks.jsonl
    keep = ("task", "prompt", "answer")
    out = {name: [{k: ex[k] for k in keep} for ex in held if ex["task"] in tasks] for name, tasks in GROUPS.items()}
    rng = random.Random(seed + 1000)
    out["arithmetic_mc"] = [multiple_choice(ex, rng) for ex in out["arithmetic"]]
    rng = random.Random(seed + 2000)
    seen, words = set(), []
    while len(words) < n_word:
        wp = word_problem(rng)
        if wp["prompt"] not in seen:
            seen.add(wp["prompt"])
            words.append(wp)
    out["word_problems"] = words
    return out


def build_suite(folder: str | Path | None = None, seed: int = SEED) -> Path:
    """Write <name>.jsonl for every suite task (atomically per file); returns the folder."""
    folder = Path(folder) if folder else data_dir()
    folder.mkdir(parents=True, exist_ok=True)
    for name, recs in suite_records(seed).items():
        atomic_write(folder / f"{name}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    return folder


def jsonl_path(name: str) -> Path:
    if name not in FILES:
        raise ValueError(f"unknown suite file {name!r} (known: {', '.join(FILES)})")
    path = data_dir() / f"{name}.jsonl"
    if not path.is_file():
        build_suite(path.parent)
    return path


def load(name: str):
    """The suite file `name` as a datasets.DatasetDict with one `test` split (for lm-eval)."""
    import datasets

    recs = [json.loads(line) for line in jsonl_path(name).read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(recs)})
