"""Joint decision mode (`clover.decide`, `clover decide`, the decision benchmark) on a tiny random
model and the character tokenizer (tests/helpers.py): constrained slots, joint == independent for
one question, the slot layout fed to the model, clear errors."""

import json
import random

import pytest
import torch

import clover
from clover.cli import main
from clover.data import tasks
from clover.decision import decide, parse_question
from clover.decision.decide import _pieces, _rows, _Slot
from helpers import save_tiny_model

MATERIAL = "Ann is 34, lives in Rome, has a cat. Bob is 51, lives in Oslo, has a dog."
MIXED = [
    {"question": "Who is the oldest?", "options": ["Ann", "Bob"]},
    {"question": "Where does Ann live?", "options": ["Rome", "Oslo", "Paris", "X"]},  # 1..5 tokens
    {"question": "Is Ann older than Bob?", "type": "boolean"},
    {"question": "How old is Bob?", "type": "integer", "max_tokens": 2},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return clover.load(save_tiny_model(tmp_path_factory.mktemp("decide-model")), device="cpu")


def _bias_logits(model, token_id: int, amount: float = 60.0):
    """A hook making `token_id` by far the model's favourite everywhere (outside every option)."""
    def hook(module, inputs, output):
        output = output.clone()
        output[..., token_id] += amount
        return output
    return model.lm_head.register_forward_hook(hook)


@pytest.mark.parametrize("mode", ["joint", "independent"])
def test_constrained_slots_never_leave_their_options(tiny, mode):
    model, tok = tiny
    favourite = tok.convert_tokens_to_ids("z")
    handle = _bias_logits(model, favourite)
    try:
        for seed in range(3):
            rng = random.Random(seed)
            qs = rng.sample(MIXED, len(MIXED))
            d = decide(model, tok, MATERIAL, qs, mode=mode, threshold=rng.choice([0.0, 0.5, 1.0]))
            assert_answers_fit(qs, d.answers)
            assert all(0.0 <= a.confidence <= 1.0 for a in d.answers)
    finally:
        handle.remove()


def test_joint_with_one_question_equals_independent(tiny):
    model, tok = tiny
    for q in MIXED + [{"question": "Say hi", "type": "text", "max_tokens": 5}]:
        joint = decide(model, tok, MATERIAL, [q], mode="joint")
        alone = decide(model, tok, MATERIAL, [q], mode="independent")
        assert [a.answer for a in joint.answers] == [a.answer for a in alone.answers]
        assert joint.answers[0].confidence == pytest.approx(alone.answers[0].confidence, abs=1e-6)
        assert joint.forward_passes == alone.forward_passes == 1


def test_slot_layout_matches_training_rendering_and_masks(tiny):
    model, tok = tiny
    mask = model.config.mask_token_id
    qs = [parse_question(q, i) for i, q in enumerate(MIXED)]
    (row,) = _rows(model, tok, MATERIAL, qs, "joint", block_size=64)
    assert row.prompt == tok(tasks.group_prompt(MATERIAL, [q["question"] for q in MIXED]), add_special_tokens=False).input_ids
    assert tasks.group_prompt(MATERIAL, ["a?"]) == tasks.plain_prompt(
        tasks.group_as_example({"material": MATERIAL, "questions": ["a?"], "answers": ["x"]}))
    tokens, offsets = row.region(0, mask)
    allowed = [q.options or [str(v) for v in range(100)] for q in qs]  # integer, 2 digits: 0..99
    widths = [max(len(tok(" " + o, add_special_tokens=False).input_ids) for o in opts) for opts in allowed]
    assert [s.width for s in row.slots] == widths == [4, 6, 4, 3]  # the longest allowed answer, in tokens
    for s, off, w in zip(row.slots, offsets, widths):
        assert tokens[off - len(s.scaffold): off] == s.scaffold and tokens[off: off + w] == [mask] * w
    assert tokens.count(mask) == sum(widths)
    # end markers: the next scaffold's first token, EOS after the last slot
    assert [s.end for s in row.slots[:-1]] == [s.scaffold[0] for s in row.slots[1:]]
    assert row.slots[-1].end == clover.api.eos_ids(model, tok)[0]
    # committed slots are re-laid out at their own length: the region is then the training answer text
    answers = ["Bob", "X", "no", "51"]
    for s, a in zip(row.slots, answers):
        s.commit(tok(" " + a, add_special_tokens=False).input_ids, a, 1.0)
    text = tok.decode(row.region(0, mask)[0])
    ex = tasks.group_as_example({"material": MATERIAL, "questions": [q.text for q in qs], "answers": answers})
    assert text == ex["answer"] == "A1: Bob A2: X A3: no A4: 51"
    full = tok(tasks.plain_text(ex), add_special_tokens=False).input_ids
    assert full == row.prompt + row.region(0, mask)[0]  # prompt + region tokenise exactly as the training text


def test_windows_fed_to_the_model(tiny):
    """Token shift and windows: the draft window is [last prompt token, region[:-1]] with masks in
    open slots and block size = window; a finished window is committed (as one clean window) in the
    first forward of the next one."""
    model, tok = tiny
    mask = model.config.mask_token_id
    ids_of = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    calls = []
    real = model.forward

    def spy(input_ids, **kw):
        calls.append((input_ids.clone(), kw))
        return real(input_ids, **kw)

    qs = MIXED[:3]  # char tokens: "A1:" + 4 masks (" Ann") | " A2:" + 6 masks (" Paris") | " A3:" + 4 (" yes")
    (row,) = _rows(model, tok, MATERIAL, [parse_question(q, i) for i, q in enumerate(qs)], "joint", block_size=20)
    assert [len(w) for w in row.windows] == [2, 1]  # 7 + 10 tokens fit in 20, the third slot starts a new window
    model.forward = spy
    try:
        d = decide(model, tok, MATERIAL, qs, mode="joint", threshold=1.0, block_size=20)  # one slot per forward
    finally:
        del model.forward
    decoding = [(ids, kw) for ids, kw in calls if kw.get("draft_len")]
    assert len(decoding) == d.model_calls == d.forward_passes == 3
    prompt = tok(tasks.group_prompt(MATERIAL, [q["question"] for q in qs]), add_special_tokens=False).input_ids
    ids, kw = decoding[0]
    assert kw["block_size"] == kw["draft_len"] == 17 and ids.shape[1] > 17  # the last prefill chunk rides along
    window = ids[0, -17:].tolist()
    assert window == [prompt[-1]] + ids_of("A1:") + [mask] * 4 + ids_of(" A2:") + [mask] * 5
    # second forward: the slot committed first is laid out at its answer's length, the other still masked
    window = decoding[1][0][0].tolist()
    # (slot 1 committed: slot 2's 6 masks minus the last, which the shifted window never shows; slot 2
    # committed: slot 1's 4 masks)
    assert window.count(mask) in (4, 5) and decoding[1][0].shape[1] == decoding[1][1]["draft_len"]
    # third forward: window 1 (final) committed in front as one clean window, then window 2
    a1, a2 = d.answers[0].answer, d.answers[1].answer
    region1 = ids_of(f"A1: {a1} A2: {a2}")
    ids, kw = decoding[2]
    assert kw["draft_len"] == kw["block_size"] == 8 and kw["clean_block_size"] == len(region1)
    assert ids[0].tolist() == [prompt[-1]] + region1[:-1] + [region1[-1]] + ids_of(" A3:") + [mask] * 3


def test_option_lengths_end_marker_scoring():
    """Options of different token lengths: a shorter option must be followed by the end marker."""
    from helpers import tiny_tokenizer

    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<unused0>")  # a token no option contains
    slot = _Slot(parse_question({"question": "q", "options": ["Al", "Alan"]}), 1, end=end, tokenizer=tok, eos={2})
    ids = {o: tok(" " + o, add_special_tokens=False).input_ids for o in ("Al", "Alan")}
    assert slot.width == 5 and slot.choices == [ids["Al"], ids["Alan"]]
    vocab = len(tok)

    def logp(tokens):
        lp = torch.full((slot.width, vocab), -20.0)
        for i, t in enumerate(tokens):
            lp[i, t] = 0.0
        return lp

    assert slot.propose(logp(ids["Al"] + [end]), 0)[1] == "Al"  # " Al" then the end marker
    assert slot.propose(logp(ids["Alan"]), 0)[1] == "Alan"  # " Al" continued by "an"
    tokens, value, conf = slot.propose(logp(ids["Al"] + [end]), 0)
    assert tokens == ids["Al"] and conf > 0.99


def test_errors_are_clear(tiny):
    model, tok = tiny
    nine = [{"question": f"Q{i}?", "type": "boolean"} for i in range(9)]
    with pytest.raises(ValueError, match="9 questions: at most 8 per group"):
        decide(model, tok, MATERIAL, nine)
    split = decide(model, tok, MATERIAL, nine, split=True)
    assert len(split.answers) == 9 and all(isinstance(a.answer, bool) for a in split.answers)
    with pytest.raises(ValueError, match="material is empty"):
        decide(model, tok, "  ", MIXED)
    with pytest.raises(ValueError, match="question 2: unknown answer type 'float'"):
        decide(model, tok, MATERIAL, [MIXED[0], {"question": "x?", "type": "float"}])
    with pytest.raises(ValueError, match="question 1: option 2 is an empty string"):
        decide(model, tok, MATERIAL, [{"question": "x?", "options": ["a", ""]}])
    with pytest.raises(ValueError, match="no questions"):
        decide(model, tok, MATERIAL, [])
    with pytest.raises(ValueError, match="unknown mode"):
        decide(model, tok, MATERIAL, MIXED, mode="both")
    with pytest.raises(ValueError, match="max_tokens"):
        decide(model, tok, MATERIAL, [{"question": "x?", "type": "integer", "max_tokens": 9}])


def test_cli_decide_json_and_errors(tiny, tmp_path, capsys):
    model, tok = tiny
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (tmp_path / "material.txt").write_text(MATERIAL)
    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps(q) for q in MIXED) + "\n")
    args = ["decide", "--model", str(folder), "--material", str(tmp_path / "material.txt"),
            "--questions", str(tmp_path / "q.jsonl")]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"answers", "forward_passes", "seconds"} and len(out["answers"]) == len(MIXED)
    assert out["answers"][0]["answer"] in ("Ann", "Bob") and isinstance(out["answers"][2]["answer"], bool)
    assert isinstance(out["answers"][3]["answer"], int) and out["forward_passes"] >= 1
    api = decide(model, tok, MATERIAL, MIXED)
    assert [a["answer"] for a in out["answers"]] == [a.answer for a in api.answers]
    (tmp_path / "bad.jsonl").write_text('{"question": "x?", "options": ["a", ""]}\n')
    assert main(args[:-1] + [str(tmp_path / "bad.jsonl")]) == 2
    assert "option 2 is an empty string" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("\n")
    assert main(["decide", "--model", str(folder), "--material", str(tmp_path / "empty.txt"),
                 "--questions", str(tmp_path / "q.jsonl")]) == 2
    assert "material is empty" in capsys.readouterr().err


def test_decision_benchmark_splits():
    train, held = tasks.decision_benchmark(seed=3, n_train=200, n_heldout=50)
    assert (train, held) == tasks.decision_benchmark(seed=3, n_train=200, n_heldout=50)  # seeded
    assert not {r["material"] for r in train} & {r["material"] for r in held}
    for r in train + held:
        assert 2 <= len(r["questions"]) <= 8 == tasks.decision_group.__defaults__[1]
        for i, (q, spec, a) in enumerate(zip(r["questions"], r["specs"], r["answers"])):
            parsed = parse_question({"question": q, **spec}, i)
            if parsed.type == "options":
                assert a in parsed.options
            elif parsed.type == "boolean":
                assert a in ("yes", "no")
            else:
                assert a.isdigit() and len(a) <= parsed.max_tokens
    assert max(len(r["questions"]) for r in held) > 5  # the benchmark goes past the recipe's 2-5
    ex = tasks.decision_train_examples(seed=3, n_train=5)
    assert ex[0]["answer"].startswith("A1: ") and ex[0]["prompt"] == f"{train[0]['material']} Q1: {train[0]['questions'][0]}" + \
        "".join(f" Q{i + 2}: {q}" for i, q in enumerate(train[0]["questions"][1:]))


def test_bench_decide_prints_both_modes(tiny, tmp_path, capsys):
    model, tok = tiny
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    assert main(["bench", "decide", "--model", str(folder), "--groups", "2", "--threads", "1",
                 "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "| joint |" in out and "| independent |" in out and "groups all right" in out
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [r["mode"] for r in results] == ["joint", "independent"]
    assert all(0 <= r["questions_right"] <= 100 for r in results)


def test_server_decide_route(tiny):
    import http.client

    from clover.api import eos_ids
    from clover.server import Settings, create_app
    from server_utils import RunningServer

    model, tok = tiny
    app = create_app(model, tok, Settings(model_id="tiny"), eos_ids(model, tok))

    def post(server, body):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/decide", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())

    with RunningServer(app) as server:
        status, out = post(server, {"material": MATERIAL, "questions": MIXED, "mode": "joint"})
        assert status == 200 and set(out) == {"answers", "forward_passes", "seconds"}
        api = decide(model, tok, MATERIAL, MIXED)
        assert [a["answer"] for a in out["answers"]] == [a.answer for a in api.answers]
        assert out["forward_passes"] == api.forward_passes
        status, out = post(server, {"material": MATERIAL, "questions": [{"question": "x?", "options": ["a", ""]}]})
        assert status == 400 and "option 2 is an empty string" in out["error"]["message"]
        assert out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == "questions"
        status, out = post(server, {"material": MATERIAL, "questions": [MIXED[2]] * 9})
        assert status == 400 and "at most 8" in out["error"]["message"]
        status, out = post(server, {"material": " ", "questions": MIXED})
        assert status == 400 and out["error"]["message"] == "material is empty"
        status, out = post(server, {"questions": MIXED})
        assert status == 400 and out["error"]["param"] == "material"
        status, out = post(server, {"material": MATERIAL, "questions": MIXED, "mode": "both"})
        assert status == 400 and out["error"]["param"] == "mode"


def test_layout_tokenises_as_training_text_with_the_default_tokenizer():
    """With the default model's BPE tokenizer ("A1:" then " Paris", digits single), prompt + the
    region with every answer committed tokenise exactly like the training text of the group."""
    from clover.api import DEFAULT_MODEL

    if not (DEFAULT_MODEL / "tokenizer.json").is_file():
        pytest.skip("no default model")
    from transformers import AutoTokenizer

    from clover.models import CloverConfig

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)

    class Stub:  # _rows needs the config (mask id, max block) and EOS only
        config = CloverConfig.from_pretrained(DEFAULT_MODEL)
        generation_config = None

    _, held = tasks.decision_benchmark(seed=0, n_train=50, n_heldout=20)
    for g in held:
        qs = [parse_question({"question": q, **s}, i) for i, (q, s) in enumerate(zip(g["questions"], g["specs"]))]
        (row,) = _rows(Stub, tok, g["material"], qs, "joint", block_size=64)
        for s, a in zip(row.slots, g["answers"]):
            s.commit(_pieces(tok, [a])[0], a, 1.0)  # the answer's tokens as decide lays them out
        region = [t for w in range(len(row.windows)) for t in row.region(w, Stub.config.mask_token_id)[0]]
        assert row.prompt + region == tok(tasks.plain_text(tasks.group_as_example(g)), add_special_tokens=False).input_ids


def test_batched_rows_equal_rows_alone(tiny):
    """Rows share forwards (left-padded prompts, right-padded windows, lockstep windows): independent
    mode equals each question alone, and split groups equal the groups decided one by one."""
    model, tok = tiny
    qs = MIXED + [{"question": "Who has the cat? And the dog?", "options": ["Ann", "Bob"]}]
    batched = decide(model, tok, MATERIAL, qs, mode="independent")
    for q, a in zip(qs, batched.answers):
        alone = decide(model, tok, MATERIAL, [q], mode="joint").answers[0]
        assert a.answer == alone.answer and a.confidence == pytest.approx(alone.confidence, abs=1e-4)
    ten = (MIXED * 3)[:10]
    split = decide(model, tok, MATERIAL, ten, split=True, block_size=16)
    groups = decide(model, tok, MATERIAL, ten[:8], block_size=16).answers + \
        decide(model, tok, MATERIAL, ten[8:], block_size=16).answers
    assert [a.answer for a in split.answers] == [a.answer for a in groups]
    assert [a.confidence for a in split.answers] == pytest.approx([a.confidence for a in groups], abs=1e-4)


def assert_answers_fit(questions, answers) -> None:
    """Every answer is one its question allows: an option, a boolean, an integer in [0, 100), a string."""
    assert len(answers) == len(questions)
    for q, a in zip(questions, answers):
        if "options" in q:
            assert a.answer in q["options"]
        elif q["type"] == "boolean":
            assert isinstance(a.answer, bool)
        elif q["type"] == "integer":
            assert isinstance(a.answer, int) and 0 <= a.answer < 100
        else:
            assert isinstance(a.answer, str)
