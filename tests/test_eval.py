"""Evaluation: the lm-eval `clover` model on the shipped offline tasks (generation and multiple
choice), its AR and ELBO likelihoods, lm-eval's `local-completions` against a test server, the
seeded suite, `clover eval` and `clover bench pareto`; a tiny random model, no downloads."""

import json
import os
import re

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'clover-dllm[eval]')")

import clover  # noqa: E402
import clover.eval  # noqa: E402  (registers the lm-eval model "clover")
from clover.cli import main  # noqa: E402
from clover.data.tasks import generate_split  # noqa: E402
from clover.eval import TASKS_DIR, suite  # noqa: E402
from clover.eval.lm import CloverLM  # noqa: E402

BLOCK = 4
LIMIT = 4


@pytest.fixture(autouse=True, scope="module")
def _offline(tmp_path_factory):
    import lm_eval.evaluator

    env_info = lm_eval.evaluator.add_env_info
    lm_eval.evaluator.add_env_info = lambda *a, **k: None  # 3 s of `pip list` per evaluation, not under test
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "CLOVER_EVAL_DATA")}
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                      CLOVER_EVAL_DATA=str(tmp_path_factory.mktemp("suite-cache")))
    yield
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    lm_eval.evaluator.add_env_info = env_info


@pytest.fixture(scope="module")
def loaded(model_dir):
    return clover.load(model_dir)


def lm(loaded, **kw):
    model, tokenizer = loaded
    return CloverLM(pretrained=model, tokenizer=tokenizer, **{"block_size": BLOCK, "threshold": 0.9, **kw})


def evaluate(model, tasks, **kw):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, tasks=tasks, limit=LIMIT, log_samples=True, verbosity="ERROR",
                           task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False), **kw)


class Req:  # what lm-eval hands a model: an object with .args
    def __init__(self, *args):
        self.args = args


def test_suite_is_seeded_and_is_the_recipe_eval_set(tmp_path):
    a, b = suite.build_suite(tmp_path / "a"), suite.build_suite(tmp_path / "b")
    for name in suite.FILES:
        assert (a / f"{name}.jsonl").read_bytes() == (b / f"{name}.jsonl").read_bytes(), name
    recs = suite.suite_records()
    held = generate_split(suite.SEED + 1, suite.PER_TASK * 7)  # the recipe's eval_tasks.jsonl
    assert [r["prompt"] for r in recs["arithmetic"]] == [e["prompt"] for e in held if e["task"] in ("add", "sub")]
    assert {r["task"] for r in recs["decisions"]} == {"group"} and len(recs["lookup"]) == suite.PER_TASK
    for r in recs["arithmetic_mc"]:
        assert len(set(r["choices"])) == 4 and r["choices"][r["gold"]] == r["answer"]
    for r in recs["word_problems"]:  # GSM8K-style: the worked solution ends in "#### answer"
        assert r["solution"].endswith(f"#### {r['answer']}") and int(r["answer"]) >= 0
    # the YAMLs' budgets are the ones the pareto bench uses
    for name, n in suite.MAX_GEN_TOKS.items():
        assert re.search(rf"max_gen_toks: {n}\n", (TASKS_DIR / f"clover_{name}.yaml").read_text()), name
    # first use writes the cache the YAMLs read
    assert suite.load("lookup")["test"][0]["answer"] == recs["lookup"][0]["answer"]
    assert (suite.data_dir() / "lookup.jsonl").is_file()


def test_lm_eval_generation_and_multiple_choice_offline(loaded):
    model, tokenizer = loaded
    out = evaluate(lm(loaded), ["clover_arithmetic", "clover_arithmetic_mc"])
    res = out["results"]
    assert 0 <= res["clover_arithmetic"]["exact_match,strip"] <= 1
    assert 0 <= res["clover_arithmetic_mc"]["acc,none"] <= 1 and "acc_norm,none" in res["clover_arithmetic_mc"]
    # generation: the engine's greedy output for each prompt, cut at the stop string
    for s in out["samples"]["clover_arithmetic"]:
        ref = clover.generate(model, tokenizer, s["doc"]["prompt"] + "\n", max_new_tokens=16, block_size=BLOCK,
                              threshold=0.9).text.split("\n")[0]
        assert s["resps"][0][0] == ref
        assert s["exact_match"] == float(ref.strip() == s["doc"]["answer"])
    # multiple choice: log p(choice | prompt) of the causal read-out, the argmax choice is the prediction
    for s in out["samples"]["clover_arithmetic_mc"]:
        ctx = tokenizer(s["doc"]["prompt"]).input_ids  # lm-eval moves the context's trailing "\n" to the choice
        scores = []
        for choice in s["doc"]["choices"]:
            ids = torch.tensor([ctx + tokenizer("\n" + choice).input_ids])
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            scores.append(float(lp[len(ctx) - 1:].gather(-1, ids[0, len(ctx):, None]).sum()))
        got = [r[0][0] for r in s["resps"]]
        assert got == pytest.approx(scores, abs=1e-4)
        assert s["acc"] == float(max(range(4), key=scores.__getitem__) == s["doc"]["gold"])


def test_likelihoods_ar_batched_and_elbo_is_the_training_objective(loaded):
    from clover.training.objectives import block_diffusion_loss

    model, tokenizer = loaded
    reqs = [Req("What is 9+4?\n", "13"), Req("Copy: ab cd\n", "ab cd"), Req("x", "yz")]
    batched = lm(loaded, max_batch=8).loglikelihood(reqs, disable_tqdm=True)
    single = lm(loaded, max_batch=1).loglikelihood(reqs, disable_tqdm=True)
    assert [s for s, _ in batched] == pytest.approx([s for s, _ in single], abs=1e-4)  # right padding is invisible
    assert all(s < 0 for s, _ in batched)
    # ELBO: two draws (one + its complement) = the training objective with the same seed and noise range
    elbo_lm = lm(loaded, likelihood="elbo", elbo_samples=2, elbo_seed=7, likelihood_block_size=BLOCK)
    (elbo, _), = elbo_lm.loglikelihood([reqs[1]], disable_tqdm=True)
    ctx, cont = tokenizer("Copy: ab cd").input_ids, tokenizer("\nab cd").input_ids  # lm-eval's split
    ids = torch.tensor([ctx + cont])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, len(ctx):] = True
    with torch.no_grad():
        loss, n = block_diffusion_loss(model, ids, mask, BLOCK, t_min=1e-3, t_max=1 - 1e-3,
                                       generator=torch.Generator().manual_seed(7), complementary=True)
    assert n == 2 * len(cont) and elbo == pytest.approx(-float(loss) * len(cont), rel=1e-4)
    again = lm(loaded, likelihood="elbo", elbo_samples=2, elbo_seed=7, likelihood_block_size=BLOCK)
    assert again.loglikelihood([reqs[1]], disable_tqdm=True)[0][0] == elbo  # fixed seed: deterministic
    # at block size 1 the ELBO is the exact AR likelihood
    one = lm(loaded, likelihood="elbo", likelihood_block_size=1).loglikelihood(reqs, disable_tqdm=True)
    assert [s for s, _ in one] == pytest.approx([s for s, _ in batched], abs=1e-4)
    # rolling: the sum over the text's tokens after the EOS prefix
    (roll,) = lm(loaded).loglikelihood_rolling([Req("abc de")], disable_tqdm=True)
    ids = torch.tensor([[tokenizer.eos_token_id] + tokenizer("abc de").input_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).sum()
    assert roll == pytest.approx(float(lp), abs=1e-4)
    with pytest.raises(ValueError, match="likelihood must be"):
        lm(loaded, likelihood="exact")


def test_local_completions_against_a_test_server(loaded, model_dir):
    pytest.importorskip("clover.server", reason="the server (clover/server) is not in this checkout")
    from clover.api import eos_ids
    from clover.server import Settings, create_app
    from server_utils import RunningServer

    model, tokenizer = loaded
    app = create_app(model, tokenizer, Settings(model_id="tiny", block_size=BLOCK, threshold=0.9, max_batch=8),
                     eos_ids(model, tokenizer))
    with RunningServer(app) as server:
        out = evaluate("local-completions", ["clover_lookup"], model_args=dict(
            model="tiny", base_url=server.url + "/v1/completions", tokenizer_backend="huggingface",
            tokenizer=model_dir, tokenized_requests=False, num_concurrent=1, max_retries=1))
        chat = evaluate("local-chat-completions", ["clover_lookup"], apply_chat_template=True, model_args=dict(
            model="tiny", base_url=server.url + "/v1/chat/completions", tokenizer_backend="none",
            num_concurrent=1, max_retries=1))
    assert len(chat["samples"]["clover_lookup"]) == LIMIT and "exact_match,strip" in chat["results"]["clover_lookup"]
    ours = evaluate(lm(loaded), ["clover_lookup"])
    assert "exact_match,strip" in out["results"]["clover_lookup"]
    remote = [s["resps"][0][0] for s in out["samples"]["clover_lookup"]]
    local = [s["resps"][0][0] for s in ours["samples"]["clover_lookup"]]
    assert len(remote) == LIMIT and remote == local  # the server's greedy text = the lm-eval model's


def test_clover_eval_cli(model_dir, capsys, tmp_path):
    code = main(["eval", "--threads", "1", "--tasks", "clover_lookup", "--model_args",
                 f"pretrained={model_dir},block_size={BLOCK},threshold=0.9", "--limit", "2", "--verbosity", "ERROR"])
    out, err = capsys.readouterr()
    assert code == 0 and "clover_lookup" in out and "exact_match" in out and "tokens per forward" in out
    # hub tasks: one line, skipped, the rest still runs (here nothing is left)
    assert main(["eval", "--tasks", "clover_gsm8k,clover_math500"]) == 0
    err = capsys.readouterr().err
    assert "skipping clover_gsm8k, clover_math500" in err and "HF_HUB_OFFLINE" in err
    for argv, msg in ((["eval"], "name tasks with --tasks"),
                      (["eval", "--tasks", "clover_lookup", "--model_args", f"pretrained={model_dir},mode=nope"],
                       "unknown mode")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err
    assert main(["eval", "--build-suite", str(tmp_path / "s")]) == 0
    assert sorted(p.stem for p in (tmp_path / "s").glob("*.jsonl")) == sorted(suite.FILES)
    assert main(["eval", "--list-tasks"]) == 0
    listed = capsys.readouterr().out
    assert "clover_suite" in listed and "clover_gsm8k  (Hugging Face hub)" in listed


def test_hub_task_yamls_index_offline_and_math_scoring():
    from lm_eval.tasks import TaskManager

    from clover.cli.eval import hub_offline
    from clover.eval.scoring import last_boxed, math500_process_results

    names = TaskManager(include_path=str(TASKS_DIR), include_defaults=False).all_tasks
    for t in ("clover_gsm8k", "clover_math500", "clover_suite", "clover_word_problems"):
        assert t in names
    assert hub_offline() == "HF_HUB_OFFLINE=1"
    assert last_boxed(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert math500_process_results({"answer": r"\frac{1}{2}"}, [r"x = \boxed{\dfrac{1}{2}}"]) == {"exact_match": 1}
    assert math500_process_results({"answer": "3"}, ["The answer is 4"]) == {"exact_match": 0}


def test_bench_pareto_writes_plot_and_table(model_dir, capsys, tmp_path):
    png, js = tmp_path / "p.png", tmp_path / "p.json"
    code = main(["bench", "pareto", "--model", model_dir, "--thresholds", "0.5,0.9", "--block-sizes", "4",
                 "--per-task", "1", "--threads", "1", "--plot", str(png), "--json", str(js)])
    out = capsys.readouterr().out
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(js.read_text())["results"]
    assert [(r["mode"], r["block_size"], r["threshold"]) for r in rows] == [
        ("low_confidence", 4, 0.5), ("low_confidence", 4, 0.9), ("self_spec", 4, None), ("ar", 1, None)]
    assert rows[-1]["tpf"] == 1.0 and rows[0]["tpf"] >= rows[1]["tpf"] >= 1.0  # lower threshold, more per step
    assert rows[2]["per_task"] == rows[3]["per_task"]  # self_spec answers what ar answers
    assert "| low_confidence | 4 | 0.5 |" in out and f"]({png})" in out and "AUP" in out and "Pareto front" in out
    assert main(["bench", "pareto", "--model", model_dir, "--block-sizes", "99"]) == 2


def test_bench_pareto_draws_nothing_unless_asked(model_dir, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "pareto", "--model", model_dir, "--modes", "ar", "--block-sizes", "4",
                 "--per-task", "1", "--threads", "1"]) == 0
    assert "| ar | 1 |" in capsys.readouterr().out and not list(tmp_path.rglob("*.png"))
