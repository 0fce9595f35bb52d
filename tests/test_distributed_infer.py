"""Inference across processes (torchrun, gloo, 2 CPU processes): --tp 2 and --ep 2 give the greedy
output of one process in every decoding mode, batch > 1; the shards add up to the whole model."""

import json
import sys
from pathlib import Path

import pytest
import torch

import clover
from clover.distributed.parallel import check_parallel, load_parallel
from clover.models import preset_config

from distributed_utils import EXIT_PROBE_ENV, REPO, assert_groups_ended, kill_tree, run_bounded, torchrun
from helpers import save_tiny_model

PROMPTS = ["to be or", "Hello there, my friend, how"]  # batch 2, different lengths (left padding)
MODES = ["low_confidence", "self_spec", "ar"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_tp_and_ep_on_two_ranks_equal_one_process_in_every_mode(tiny, tmp_path):
    model, tok = clover.load(tiny, device="cpu")
    want = {m: [g.token_ids for g in clover.generate(model, tok, PROMPTS, max_new_tokens=20, block_size=8, mode=m)]
            for m in MODES}
    assert want["self_spec"] == want["ar"]  # self_spec reproduces ar greedy (with rollbacks on this model)
    out = tmp_path / "gen.json"
    run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                 str(REPO / "tests" / "dist_generate_worker.py"), tiny, str(out), json.dumps(PROMPTS), ",".join(MODES)])
    got = json.loads(out.read_text())
    from clover.structured import generate_json
    from distributed_utils import SCHEMA

    want["json"] = generate_json(model, tok, "A person:", SCHEMA, block_size=8, max_new_tokens=40).text
    assert json.loads(want["json"]).keys() == {"name", "age"}
    for kind in ("tp", "ep"):
        for m in MODES + ["json"]:
            assert got[f"{kind}/{m}"] == want[m], (kind, m)


def test_tp_without_torchrun_is_a_one_line_error(tiny, capsys):
    from clover.cli import main

    assert main(["generate", "--model", tiny, "--tp", "2", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc-per-node 2" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("split", ["--tp", "--ep"])
def test_cli_generate_under_torchrun(tiny, split):
    model, tok = clover.load(tiny, device="cpu")
    want = clover.generate(model, tok, PROMPTS, max_new_tokens=12, block_size=8, mode="low_confidence")
    # torchrun also checks that the process group ended with the command (tests/exit_probe)
    r = torchrun(2, ["generate", "--model", tiny, "--device", "cpu", split, "2", "--block-size", "8",
                     "--max-new-tokens", "12", "--json", *sum((["--prompt", p] for p in PROMPTS), [])])
    got = json.loads(r.stdout)  # rank 0 alone prints: one JSON document
    assert [g["text"] for g in got] == [g.text for g in want]


def test_shards_add_up_to_the_model(tiny):
    """Every sharded parameter's pieces over the ranks tile the full tensor; replicated ones are equal."""
    full = dict(clover.load(tiny, device="cpu")[0].named_parameters())
    for tp, ep in ((2, 1), (1, 2)):
        ranks = [dict(load_parallel(tiny, tp, ep, r, "cpu", torch.float32).named_parameters()) for r in range(2)]
        assert ranks[0].keys() == full.keys()
        for name, p in full.items():
            a, b = ranks[0][name], ranks[1][name]
            if a.shape == p.shape:
                assert torch.equal(a, p) and (torch.equal(b, p) or not b.any()), name
            else:
                assert a.numel() + b.numel() == p.numel(), name


def test_bad_splits_are_refused():
    c = preset_config("clover-tiny")
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_parallel(c, 4, 1)
    with pytest.raises(ValueError, match="not both"):
        check_parallel(c, 2, 2)
    check_parallel(c, 1, 8)
    with pytest.raises(ValueError, match="num_experts"):
        check_parallel(c, 1, 3)


def test_serve_under_torchrun_answers_the_openai_client(tiny):
    """`torchrun --nproc-per-node 2 -m clover serve --tp 2`: rank 0 serves HTTP and drives rank 1;
    the official client's answers (chat and completions, streamed and not, two requests batched)
    equal those of a one-process server with the same settings."""
    import os
    import signal
    import subprocess
    import threading
    import time

    import openai

    from clover.api import eos_ids
    from clover.server import Settings, create_app
    from server_utils import RunningServer

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "clover",
           "serve", "--model", tiny, "--device", "cpu", "--tp", "2", "--port", "0", "--served-model-name", "tiny"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **EXIT_PROBE_ENV}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        url, deadline = None, time.time() + 180
        lines, errors = [], []
        readers = [threading.Thread(target=into.extend, args=(stream,), daemon=True)
                   for stream, into in ((proc.stdout, lines), (proc.stderr, errors))]
        for r in readers:
            r.start()
        while url is None:
            assert time.time() < deadline and proc.poll() is None, f"server did not start: {''.join(errors)[-3000:]}"
            for line in list(lines):
                if "clover serve:" in line and "http://" in line:
                    url = line.split("http://")[1].split()[0]
            time.sleep(0.2)
        model, tok = clover.load(tiny, device="cpu")
        settings = Settings(model_id="tiny", block_size=model.config.block_size)
        with RunningServer(create_app(model, tok, settings, eos_ids(model, tok))) as local:
            answers = {}
            for name, base in (("two", f"http://{url}/v1"), ("one", local.url + "/v1")):
                c = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
                chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi there"}],
                                                 max_tokens=12, temperature=0)
                comp = c.completions.create(model="tiny", prompt=PROMPTS, max_tokens=10, temperature=0)
                stream = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "to be"}], max_tokens=10, temperature=0,
                    stream=True, extra_body={"mode": "self_spec"}))
                answers[name] = (chat.choices[0].message.content, [ch.text for ch in comp.choices], stream)
        assert answers["two"] == answers["one"]
        assert answers["one"][1][0] and len(answers["one"][1]) == 2
        # Ctrl-C (SIGINT to every process): each rank ends its group, rank 0's exit hook no traceback
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        readers[1].join(timeout=30)  # stderr read to its end
        err = "".join(errors)
        assert_groups_ended(err, 2)
        assert "Exception ignored in atexit" not in err, err[-3000:]
    finally:
        kill_tree(proc)
