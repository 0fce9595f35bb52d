"""Build the default model's data set: Shakespeare passages + seeded synthetic tasks + the decision
benchmark's train split + tool-use dialogues, split into train / held-out, written as JSONL (`text`
and chat `messages` records) plus the held-out task set for accuracy evaluation."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

from . import toolbox

from . import shakespeare, tasks
from clover.chat import render_chat


def _write(path: Path, recs) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        n = 0
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    return n


def task_records(examples, rng: random.Random, chat_frac: float, think_frac: float):
    for ex in examples:
        if rng.random() < chat_frac:
            yield {"messages": tasks.chat_messages(ex, think=rng.random() < think_frac)}
        else:
            yield {"text": tasks.plain_text(ex)}


def heldout_tasks(seed: int, n_heldout: int, n_eval: int) -> list[dict]:
    """The held-out task examples (eval prompts first, then the loss set) that no training set repeats."""
    return tasks.generate_split(seed + 1, n_heldout + n_eval * len(tasks.TASKS))


def build(out_dir, seed: int = 0, n_train: int = 60000, n_heldout: int = 2000, n_eval: int = 40,
          shakespeare_frac: float = 0.06, chat_frac: float = 0.4, think_frac: float = 0.5,
          n_decision: int = 0, n_single_questions: int = 0, n_tool: int = 0) -> dict:
    """Writes train.jsonl, heldout.jsonl (loss), eval_tasks.jsonl (prompts + answers per task),
    tokenizer_corpus.txt. `shakespeare_frac`: share of training records that are play passages.
    With `n_decision`, decision groups come from the decision benchmark's train split (2-8 questions,
    `tasks.decision_train_examples`) plus `n_single_questions` one-question groups (so answering one
    question alone, the independent mode, is in distribution too) instead of the generic `group`
    task; `n_tool` adds tool-use dialogues (`clover.data.toolbox`)."""
    out = Path(out_dir)
    rng = random.Random(seed)
    # held-out tasks first; the training set never repeats one of their prompts
    heldout = heldout_tasks(seed, n_heldout, n_eval)
    eval_set = heldout[:n_eval * len(tasks.TASKS)]
    held = heldout[n_eval * len(tasks.TASKS):]
    train_tasks = tuple(t for t in tasks.TASKS if t != "group") if n_decision else tasks.TASKS
    train = tasks.generate_split(seed + 2, n_train, train_tasks, exclude={e["prompt"] for e in heldout})
    if n_decision:
        train += tasks.decision_train_examples(seed, n_decision)
        train += [tasks.group_as_example(tasks.decision_group(rng, 1, 1)) for _ in range(n_single_questions)]
    plays = shakespeare.plays()
    names = sorted(plays)
    held_plays = {names[i] for i in range(0, len(names), 10)}  # every 10th play is held out
    train_pass = [p for n in names if n not in held_plays for p in shakespeare.passages(plays[n])]
    held_pass = [p for n in sorted(held_plays) for p in shakespeare.passages(plays[n])]
    rng.shuffle(train_pass)
    n_sh = int(n_train * shakespeare_frac / (1 - shakespeare_frac))
    train_recs = list(task_records(train, rng, chat_frac, think_frac)) + [{"text": p} for p in train_pass[:n_sh]]
    tool_held = toolbox.training_dialogues(seed + toolbox.HELD_DIALOGUE_SEED, n_tool // 20) if n_tool else []
    train_recs += toolbox.training_dialogues(seed + toolbox.TRAIN_DIALOGUE_SEED, n_tool)
    rng.shuffle(train_recs)
    held_recs = list(task_records(held, rng, chat_frac, think_frac)) + [{"text": p} for p in held_pass[:len(held) // 5]]
    held_recs += tool_held
    stats = {
        "train_records": _write(out / "train.jsonl", train_recs),
        "heldout_records": _write(out / "heldout.jsonl", held_recs),
        "eval_tasks": _write(out / "eval_tasks.jsonl", eval_set),
        "held_out_plays": sorted(held_plays),
        "seed": seed,
    }
    with (out / "tokenizer_corpus.txt").open("w", encoding="utf-8") as f:
        for n in names:
            f.write(plays[n] + "\n\n\n")
        for ex in train[:20000]:
            f.write(tasks.plain_text(ex) + "\n\n\n")
        for rec in tool_held:
            f.write(render_chat(rec["messages"], tools=rec["tools"]) + "\n\n\n")
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    return stats


def focus_name(round: int) -> str:
    """Round 1 writes focus.jsonl (and trains runs/default/focus), round r > 1 focus{r}.jsonl."""
    return "focus" if round == 1 else f"focus{round}"


def recorded_rounds(provenance: dict) -> int:
    """How many focus rounds a model's recipe.json records (its `<focus_name>_stage` entries, in order)."""
    return sum(1 for _ in itertools.takewhile(lambda i: f"{focus_name(i)}_stage" in provenance, itertools.count(1)))


def build_focus(out_dir, base_train, seed: int = 0, n_tasks: int = 100000, replay_frac: float = 0.25,
                n_heldout: int = 2000, n_eval: int = 40, chat_frac: float = 0.4, think_frac: float = 0.3,
                round: int = 1, n_decision: int = 0, n_tool: int = 0, tool_start: int = 0) -> dict:
    """The focus stage's data (focus.jsonl): `n_tasks` fresh examples of the evaluated short tasks
    (addition, subtraction, sorting, copying, reversing, lookup; a new seed, none of the held-out
    prompts) plus a random `replay_frac` of the base training records, so decision groups, tool
    dialogues and Shakespeare are not forgotten. Why: the first two stages spend most of their tokens
    on those long records and the short tasks, which need exact retrieval from the prompt, stay
    unlearned at a few million tokens. Each `round` draws its own examples and its own replayed quarter
    (seeds offset by 10 per round), so a further round never repeats the previous one's data.
    `n_decision` adds that many fresh decision groups (none of the decision benchmark's held-out
    material): replay alone let the group skill fade to chance over two rounds. `n_tool` adds fresh
    tool-use dialogues: numbers tool_start .. tool_start + n_tool of the base data's dialogue stream
    (which the agent benchmark excludes up to its TRAINING_SEEDS bound), so the caller passes the base
    data's n_tool plus earlier rounds' to keep every round's dialogues new."""
    from .dataset import read_records

    offset = 10 * (round - 1)
    rng = random.Random(seed + 5 + offset)
    short = tuple(t for t in tasks.TASKS if t != "group")
    exclude = {e["prompt"] for e in heldout_tasks(seed, n_heldout, n_eval)}
    fresh = tasks.generate_split(seed + 6 + offset, n_tasks, short, exclude=exclude)
    groups = []
    if n_decision:
        held_groups = {r["material"] for r in tasks.decision_benchmark(seed, n_heldout=5000)[1]}
        groups = [tasks.group_as_example(r)
                  for r in tasks.decision_split(seed * 2 + 1001 + offset, n_decision, exclude=held_groups)]
    recs = list(task_records(fresh + groups, rng, chat_frac, think_frac))
    if n_tool:
        bound = dict(toolbox.TRAINING_SEEDS)[toolbox.TRAIN_DIALOGUE_SEED]
        if tool_start + n_tool > bound:
            raise ValueError(f"tool dialogues {tool_start}..{tool_start + n_tool} pass the agent benchmark's "
                             f"exclusion bound {bound} (clover.data.toolbox.TRAINING_SEEDS)")
        recs += toolbox.training_dialogues(seed + toolbox.TRAIN_DIALOGUE_SEED, tool_start + n_tool)[tool_start:]
    replay = [r for r in read_records(base_train) if rng.random() < replay_frac]
    recs += replay
    rng.shuffle(recs)
    name = focus_name(round)
    stats = {"focus_records": _write(Path(out_dir) / f"{name}.jsonl", recs), "fresh_tasks": len(fresh),
             "fresh_decision_groups": len(groups), "fresh_tool_dialogues": n_tool,
             "replayed": len(replay), "seed": seed, "round": round}
    (Path(out_dir) / f"{name}_stats.json").write_text(json.dumps(stats, indent=2))
    return stats


# answer budgets of the held-out evaluation (clover.eval.suite.MAX_GEN_TOKS), per task
DISTILL_BUDGETS = {"add": 16, "sub": 16, "sort": 32, "copy": 48, "reverse": 48, "lookup": 8, "group": 64}


def build_distill_prompts(path, seed: int = 0, n_prompts: int = 20000, chat_frac: float = 0.3,
                          n_heldout: int = 2000, n_eval: int = 40) -> dict:
    """The self-distillation stage's prompts (clover/training/distill.py): `n_prompts` fresh task
    prompts, every evaluated task (decision groups included), none of the held-out prompts, each with
    the evaluation's answer budget; `chat_frac` of them as a chat turn (non-thinking), the rest plain
    ("prompt\\n", as the evaluation asks). Only prompts: the answers are the teacher's."""
    rng = random.Random(seed + 3001)
    exclude = {e["prompt"] for e in heldout_tasks(seed, n_heldout, n_eval)}
    recs = []
    for ex in tasks.generate_split(seed + 3002, n_prompts, exclude=exclude):
        budget = DISTILL_BUDGETS[ex["task"]]
        if rng.random() < chat_frac:
            recs.append({"messages": [{"role": "user", "content": ex["prompt"]}], "max_new_tokens": budget})
        else:
            recs.append({"prompt": tasks.plain_prompt(ex), "max_new_tokens": budget})
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    stats = {"prompts": _write(tmp, recs), "seed": seed, "chat_frac": chat_frac}
    tmp.replace(path)
    return stats
