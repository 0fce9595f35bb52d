"""Joint decisions (`clover.decide`, `POST /v1/decide`, `clover decide`) on the public families (SDAR,
SDAR-MoE, LLaDA2, Fast-dLLM v2), whose answers are decoded in each family's own blocks under the rows'
options (clover/engine/family_infill.py), on random-weight folders in the published layout:

* the answers, forwards and confidences equal a slow reference written plainly: every region the
  questions allow enumerated as token sequences, every forward a full recompute of the sequence with
  no cache, the block's masked positions read left to right (the first always taken, each next one
  while its allowed choice has probability >= the threshold);
* answers never leave their options (boolean, integer, text slots too), in joint and independent mode;
* the server's route gives the API's answers, its threshold / block_size reach the decoder, bad bodies
  are 400s; `clover decide --model DIR` prints them."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from test_decide import assert_answers_fit
from test_families import confident, write_family

from clover.decision import decide
from clover.decision.decide import _eos, _rows, parse_questions
from clover.models.family_seam import FamilySeam

FAMILIES = ["sdar", "sdar_moe", "llada2_moe", "Fast_dLLM_Qwen"]
MATERIAL = "Ann is 34, lives in Rome. Bob is 51, lives in Oslo."
OPTIONS = [
    {"question": "Who is the oldest?", "options": ["Ann", "Bob", "Al"]},  # "Al": a prefix of no other, shorter
    {"question": "Where does Ann live?", "options": ["Rome", "Oslo", "R"]},  # "R": a prefix of "Rome"
    {"question": "Is Ann older than Bob?", "type": "boolean"},
    {"question": "Which?", "options": ["x", "xy", "xyz"]},  # ending after x or xy is a choice
]
MIXED = OPTIONS + [{"question": "How old is Bob?", "type": "integer", "max_tokens": 2},
                   {"question": "A colour?", "type": "text", "max_tokens": 4}]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    write_family(folder, request.param)
    loaded = confident(folder, request.param, peak=4.0)
    return FamilySeam(loaded), loaded.tokenizer


def reference(seam, tokenizer, questions, threshold: float, block: int):
    """(answers, confidences, forwards) of one joint row, decoded plainly (see the module docstring)."""
    qs = parse_questions(questions)
    eos = _eos(seam, tokenizer)
    row = _rows(seam, tokenizer, MATERIAL, qs, "joint", block)[0]
    slots, mask = row.slots, seam.config.mask_token_id
    regions = [sum((s.scaffold + c for s, c in zip(slots, pick)), []) + [eos[0]]
               for pick in itertools.product(*(s.choices for s in slots))]
    tokens, probs, forwards = [], [], 0
    while True:
        n = len(row.prompt) + len(tokens)
        end = (n // block + 1) * block
        logits = seam(torch.tensor([row.prompt + tokens + [mask] * (end - n)]), block_size=block).logits[0].float()
        forwards += 1
        for i, pos in enumerate(range(n, end)):
            allowed = {r[len(tokens)] for r in regions if r[: len(tokens)] == tokens}
            x = torch.full_like(logits[0], float("-inf"))
            x[sorted(allowed)] = logits[pos - 1 if seam.shift else pos][sorted(allowed)]
            t = int(x.argmax())
            p = float(torch.softmax(x, -1)[t])
            if i > 0 and p < threshold:
                break
            tokens.append(t)
            probs.append(p)
            if t == eos[0]:
                return _read(slots, regions, tokens, probs), forwards


def _read(slots, regions, tokens, probs):
    """Each slot's answer and confidence: the product of its tokens' and its end marker's probabilities."""
    pick = next(p for r, p in zip(regions, itertools.product(*(s.choices for s in slots))) if r == tokens)
    out, at = [], 0
    for s, c in zip(slots, pick):
        at += len(s.scaffold)
        conf = 1.0
        for p in probs[at: at + len(c) + 1]:
            conf *= p
        out.append((s.values[s.choices.index(c)], conf))
        at += len(c)
    return out


@torch.no_grad()
@pytest.mark.parametrize("threshold", [0.5, 1.0])
def test_family_decide_equals_the_slow_reference(family, threshold):
    seam, tok = family
    for block in (4, seam.decode_defaults["block_size"]):
        want, forwards = reference(seam, tok, OPTIONS, threshold, block)
        got = decide(seam, tok, MATERIAL, OPTIONS, threshold=threshold, block_size=block)
        assert [a.answer for a in got.answers] == [a for a, _ in want]
        assert [a.confidence for a in got.answers] == pytest.approx([c for _, c in want], rel=1e-5)
        assert got.forward_passes == got.model_calls == forwards


@torch.no_grad()
@pytest.mark.parametrize("mode", ["joint", "independent"])
def test_family_answers_stay_in_their_options(family, mode):
    seam, tok = family
    for threshold in (0.0, 0.9):
        d = decide(seam, tok, MATERIAL, MIXED, mode=mode, threshold=threshold)
        assert_answers_fit(MIXED, d.answers)
        assert all(0.0 < a.confidence <= 1.0 for a in d.answers) and d.forward_passes > 0
    one = decide(seam, tok, MATERIAL, MIXED[:1], mode="joint")
    assert [a.answer for a in one.answers] == [a.answer for a in decide(seam, tok, MATERIAL, MIXED[:1],
                                                                        mode="independent").answers]


def test_family_decide_route_and_cli(tmp_path):
    from server_utils import RunningServer, raw
    from test_families_engine import _clover

    from clover.api import eos_ids, load
    from clover.server import Settings, create_app

    write_family(tmp_path / "m", "sdar")
    model, tok = load(tmp_path / "m")
    app = create_app(model, tok, Settings(model_id="fam", block_size=4, threshold=0.9), eos_ids(model, tok))

    def post(server, body):
        status, _, text = raw(server, "POST", "/v1/decide", body, timeout=120)
        return status, json.loads(text)

    with RunningServer(app) as server:
        for extra in ({}, {"threshold": 0.0, "block_size": 8}, {"mode": "independent", "threshold": 1.0}):
            status, out = post(server, {"material": MATERIAL, "questions": MIXED, **extra})
            assert status == 200, out
            api = decide(model, tok, MATERIAL, MIXED, mode=extra.get("mode", "joint"),
                         threshold=extra.get("threshold", 0.9), block_size=extra.get("block_size"))
            assert [a["answer"] for a in out["answers"]] == [a.answer for a in api.answers]
            assert out["forward_passes"] == api.forward_passes
        loose = post(server, {"material": MATERIAL, "questions": MIXED, "threshold": 0.0})[1]["forward_passes"]
        strict = post(server, {"material": MATERIAL, "questions": MIXED, "threshold": 1.0})[1]["forward_passes"]
        assert loose < strict  # the request's threshold reached the decoder
        status, out = post(server, {"material": MATERIAL, "questions": [MIXED[2]] * 9})
        assert status == 400 and "at most 8" in out["error"]["message"]
        status, out = post(server, {"material": MATERIAL, "questions": MIXED, "block_size": 1})
        assert status == 400 and out["error"]["param"] == "block_size"
    (tmp_path / "material.txt").write_text(MATERIAL)
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in MIXED))
    run = _clover("decide", "--model", str(tmp_path / "m"), "--material", str(tmp_path / "material.txt"),
                  "--questions", str(tmp_path / "q.jsonl"), "--json")
    assert run.returncode == 0, run.stderr
    api = decide(model, tok, MATERIAL, MIXED)  # the family's published block size and threshold
    assert [a["answer"] for a in json.loads(run.stdout)["answers"]] == [a.answer for a in api.answers]
    run = _clover("decide", "--model", str(tmp_path / "m"), "--material", str(tmp_path / "material.txt"),
                  "--questions", str(tmp_path / "q.jsonl"), "--block-size", "1")
    assert run.returncode == 2 and "--block-size" in run.stderr and len(run.stderr.strip().splitlines()) == 1
