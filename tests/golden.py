"""Golden outputs of the decoding core: token ids and forward counts of `generate` in every mode
(single rows and batches of different prompt lengths), `decide`, structured output and the server
(completions, chat, streams, a forced tool call, response_format), on a fixed prompt set, with the
shipped default model and a seeded tiny random model (tests/helpers.py). Recorded before a refactor
of the engine / server, compared after it by tests/test_golden.py: the shape may change, the outputs
may not.

    PYTHONPATH=. python tests/golden.py          # (re)write tests/golden.json
    PYTHONPATH=. python tests/golden.py --check  # compare, print the first differences
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
GOLDEN = HERE / "golden.json"
PROMPTS = ["Shall I compare thee", "To be, or not to be: that is", "Sort: 41 7 93 28 65 12 80\n"]
MODES = [("low_confidence", {}), ("topk", {}), ("entropy", {"steps": 3}), ("margin", {}), ("self_spec", {}),
         ("ar", {}), ("low_confidence", {"temperature": 0.8, "top_p": 0.9, "seed": 7})]
MATERIAL = "Ann is 34, lives in Rome, has a cat. Bob is 51, lives in Oslo, has a dog."
QUESTIONS = [{"question": "Who is the oldest?", "options": ["Ann", "Bob"]},
             {"question": "Where does Ann live?", "options": ["Rome", "Oslo", "Paris"]},
             {"question": "Is Ann older than Bob?", "type": "boolean"},
             {"question": "How old is Bob?", "type": "integer", "max_tokens": 2}]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Rome"]}}, "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}


def _gen(g) -> dict:
    return {"ids": g.token_ids, "forwards": g.forward_passes, "finish": g.finish_reason}


def generate_cases(model, tok, block_size: int, threshold: float, max_new: int, singles: bool = True) -> dict:
    """Every mode on the prompt batch (and, with `singles`, on the first prompt alone)."""
    import clover

    out = {}
    for mode, extra in MODES:
        name = mode + ("+" + ",".join(f"{k}={v}" for k, v in extra.items()) if extra else "")
        kw = dict(max_new_tokens=max_new, block_size=block_size, threshold=threshold, mode=mode, **extra)
        out[name] = {"batch": [_gen(g) for g in clover.generate(model, tok, PROMPTS, **kw)]}
        if singles:
            out[name]["single"] = _gen(clover.generate(model, tok, PROMPTS[0], **kw))
    budgets = {"ids": [], "forwards": []}
    from clover.api import decode_config
    from clover.engine import Engine

    engine = Engine(model, decode_config(model, tok, max_new_tokens=max_new, block_size=block_size, threshold=threshold))
    first = engine.add([tok(PROMPTS[0]).input_ids], [max_new])
    engine.step()
    later = engine.add([tok(p).input_ids for p in PROMPTS[1:]], [max_new // 2, max_new])  # join mid-run
    while engine.running:
        engine.step()
    for s in first + later:
        budgets["ids"].append(s.token_ids)
        budgets["forwards"].append(s.forward_passes)
    out["join_mid_run"] = budgets
    return out


def decide_cases(model, tok) -> dict:
    from clover.decision import decide

    out = {}
    for mode in ("joint", "independent"):
        d = decide(model, tok, MATERIAL, QUESTIONS, mode=mode, threshold=0.5, block_size=8)
        out[mode] = {"answers": [a.answer for a in d.answers],
                     "confidence": [round(a.confidence, 4) for a in d.answers],
                     "forwards": d.forward_passes}
    return out


def structured_cases(model, tok) -> dict:
    from clover.structured import generate_json

    r = generate_json(model, tok, "A person:", SCHEMA, threshold=0.5, block_size=8)
    f = generate_json(model, tok, "A person:", SCHEMA, threshold=0.5, block_size=8, max_new_tokens=24, method="free")
    return {"infill": {"text": r.text, "ids": r.token_ids, "forwards": r.forward_passes, "method": r.method},
            "free": {"text": f.text, "ids": f.token_ids, "forwards": f.forward_passes, "method": f.method}}


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def server_cases(model, tok) -> dict:
    from clover.api import eos_ids
    from clover.server import Settings, create_app
    from server_utils import RunningServer, raw

    settings = Settings(model_id="tiny", block_size=4, threshold=0.5, max_batch=8, max_queue=32)
    out = {}
    with RunningServer(create_app(model, tok, settings, eos_ids(model, tok))) as server:
        def post(path, body):
            status, _, text = raw(server, "POST", path, body)
            return status, text

        status, text = post("/v1/completions", {"model": "tiny", "prompt": PROMPTS[:2], "max_tokens": 12})
        body = json.loads(text)
        out["completions"] = {"status": status, "texts": [c["text"] for c in body["choices"]],
                              "finish": [c["finish_reason"] for c in body["choices"]], "usage": body["usage"]}
        status, text = post("/v1/completions", {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 10,
                                                "stream": True, "stream_options": {"include_usage": True}})
        chunks = _sse(text)
        out["completions_stream"] = {"status": status, "pieces": [c["choices"][0]["text"] for c in chunks if c["choices"]],
                                     "usage": chunks[-1].get("usage")}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12}
        status, text = post("/v1/chat/completions", chat)
        body = json.loads(text)
        out["chat"] = {"status": status, "message": body["choices"][0]["message"], "usage": body["usage"],
                       "finish": body["choices"][0]["finish_reason"]}
        status, text = post("/v1/chat/completions", chat | {"stream": True, "stop": ["e"]})
        chunks = _sse(text)
        out["chat_stream"] = {"status": status, "deltas": [c["choices"][0]["delta"] for c in chunks if c["choices"]],
                              "finish": [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]}
        forced = chat | {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                         "max_tokens": 64}
        status, text = post("/v1/chat/completions", forced)
        body = json.loads(text)
        msg = body["choices"][0]["message"]
        out["forced_call"] = {"status": status, "calls": [c["function"] for c in msg.get("tool_calls") or []],
                              "content": msg.get("content"), "usage": body.get("usage")}
        fmt = chat | {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
                      "max_tokens": 48}
        status, text = post("/v1/chat/completions", fmt)
        body = json.loads(text)
        out["response_format"] = {"status": status, "content": body["choices"][0]["message"]["content"],
                                  "usage": body.get("usage")}
    return out


def record() -> dict:
    import clover
    from helpers import save_tiny_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, tok = clover.load(device="cpu")
    out = {"default": {"generate": generate_cases(model, tok, 32, 0.95, 24, singles=False)}}
    with tempfile.TemporaryDirectory() as folder:
        tiny, ttok = clover.load(save_tiny_model(folder), device="cpu")
        out["tiny"] = {"generate": generate_cases(tiny, ttok, 4, 0.5, 20), "decide": decide_cases(tiny, ttok),
                       "structured": structured_cases(tiny, ttok), "server": server_cases(tiny, ttok)}
    return json.loads(json.dumps(out))  # tuples -> lists, as read back


def differences(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in differences(a.get(k), b.get(k), f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    got = record()
    if "--check" in sys.argv:
        diff = differences(json.loads(GOLDEN.read_text()), got)
        print("\n".join(diff[:20]) or "identical")
        sys.exit(1 if diff else 0)
    tmp = GOLDEN.with_suffix(".tmp")
    text = json.dumps(got, indent=1, sort_keys=True)
    text = re.sub(r"\[[-\d,\s]*\]", lambda m: " ".join(m.group(0).split()), text)  # id lists on one line
    tmp.write_text(text + "\n")
    tmp.replace(GOLDEN)
    print(f"wrote {GOLDEN}")
