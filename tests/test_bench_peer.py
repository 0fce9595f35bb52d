"""bench/serve_peer.py (clover serve vs llama-server) and bench/llamacpp.py's ratio: the pieces that
need no server, no llama.cpp build and no timing."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


peer = _load("serve_peer")


def test_versus_is_the_ratio_of_medians_with_the_spread():
    lcpp = _load("llamacpp")
    m = lcpp.versus([800.0, 843.0, 900.0], [600.0, 642.0, 700.0])
    assert m["median"] == 843.0 and (m["lo"], m["hi"]) == (800.0, 900.0)
    assert m["ratio"] == pytest.approx(843.0 / 642.0)
    # rounds where the per-round ratios' median differs from the ratio of medians: the latter is printed
    m = lcpp.versus([10.0, 20.0, 30.0], [30.0, 10.0, 20.0])
    assert m["ratio"] == pytest.approx(1.0)


def test_median_run_takes_the_median_round_and_the_spread():
    runs = [dict(tps=t, p99=t / 10, load=l) for t, l in ((30.0, 1.0), (10.0, 2.0), (20.0, 3.0))]
    m = peer.median_run(runs)
    assert (m["tps"], m["lo"], m["hi"], m["p99"], m["load"]) == (20.0, 10.0, 30.0, 2.0, 2.0)


def test_summarise_aggregates_tokens_over_the_wall_time():
    s = peer.summarise([(1.0, 0.1, 64), (2.0, 0.3, 64), (3.0, 0.2, 64)], wall=4.0, load=1.5)
    assert s["tps"] == 48.0 and s["tokens"] == 192 and s["ttft"] == pytest.approx(0.2) and s["p50"] == 2.0
    assert 2.9 < s["p99"] <= 3.0


def test_servers_pair_by_precision():
    servers = peer.pick_servers(None, have_llama=True)
    assert {s.name for s in servers} >= {"clover compiled int4", "llama-server q4_0", "llama-server f32"}
    for s in servers:
        s.runs = {1: [dict(tps=1.0, p99=1.0, load=0.0)]}
    by = {s.name: s for s in servers}
    assert peer.peer(by["clover eager fp32"], servers, 1).name == "llama-server f32"
    assert peer.peer(by["clover compiled int4"], servers, 1).name == "llama-server q4_0"
    assert peer.peer(by["clover compiled int4"], servers, 4) is None  # llama-server did not run that level
    assert all(s.kind == "clover" for s in peer.pick_servers(None, have_llama=False))
    assert [s.name for s in peer.pick_servers("llama-server q8_0,clover eager int4", True)] == [
        "clover eager int4", "llama-server q8_0"]
    with pytest.raises(ValueError, match="unknown server"):
        peer.pick_servers("clover eager fp16", True)


def test_llama_server_gets_a_slot_per_client_and_their_context():
    cmd = peer.llama_command(Path("m.gguf"), threads=4, slots=32, slot_ctx=512)
    assert cmd[cmd.index("--parallel") + 1] == "32" and cmd[cmd.index("-c") + 1] == str(32 * 512)
    assert cmd[cmd.index("-t") + 1] == "4" and "-cb" in cmd


def test_flag_mistakes_are_one_line_and_exit_2(capsys):
    for argv in (["--servers", "nope"], ["--sizes", "huge"], ["--clients", "0"]):
        with pytest.raises(SystemExit) as e:
            peer.main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.count("\n") == 1
    assert peer.main(["--dry-run"]) == 0
    assert "llama-server q4_0" in capsys.readouterr().out


def test_a_failing_server_leaves_the_comparison_with_its_reason(monkeypatch):
    s = peer.Server("clover", "compiled", "int4", url="http://127.0.0.1:9")  # no server: no counters either

    async def boom(*a):
        raise RuntimeError("500 Internal Server Error\ntraceback")

    monkeypatch.setattr(peer, "level", boom)
    assert peer.attempt(s, 4, ["p"], 1, 8) is None
    assert s.error == "4 clients: RuntimeError: 500 Internal Server Error"
    assert peer.attempt(s, 16, ["p"], 1, 8) is None and s.error.startswith("4 clients")


def test_the_large_size_has_its_own_plan_and_servers():
    _, args = peer.parse(["--rounds", "3", "--requests", "2", "--large-rounds", "1", "--large-max-tokens", "32",
                          "--threads", "2"])
    assert vars(peer.size_plan(args, "default")) == dict(rounds=3, requests=2, max_tokens=64, threads=1)
    assert vars(peer.size_plan(args, "large")) == dict(rounds=1, requests=1, max_tokens=32, threads=2)
    names = [s.name for s in peer.pick_servers(args.large_servers, True)]
    assert names == ["clover compiled fp32", "clover compiled int4", "llama-server f32", "llama-server q4_0"]
    assert peer.size_config("large").num_hidden_layers > peer.size_config("default").num_hidden_layers


def test_clover_forwards_say_their_share_of_the_wall_and_eager_ones():
    text = ("clover_step_seconds_sum 1.5\nclover_model_forwards_total 300\nclover_graph_forwards_total 290\n"
            "clover_eager_forwards_total 10\nclover_step_seconds_count 300\n")
    c = peer.parse_counters(text)
    assert c["clover_step_seconds_sum"] == 1.5 and c["clover_eager_forwards_total"] == 10
    run = dict(wall=3.0, server=c)
    assert peer.forwards(run, "compiled") == "50%, 5.00 ms, 10/300 eager"
    assert peer.forwards(run, "eager") == "50%, 5.00 ms"
    assert peer.forwards(dict(wall=1.0), "compiled") == "-"  # a llama-server round


def test_a_missed_point_names_both_figures_and_what_clover_forwards_took(capsys):
    args = peer.parse([])[1]
    plan = peer.size_plan(args, "default")
    fwd = dict(clover_step_seconds_sum=1.0, clover_model_forwards_total=100.0, clover_graph_forwards_total=100.0,
               clover_eager_forwards_total=0.0)
    clover = peer.Server("clover", "compiled", "fp32", runs={1: [dict(tps=500.0, p99=0.3, p50=0.2, ttft=0.01, load=1.0,
                                                                     wall=4.0, server=fwd)]})
    llama = peer.Server("llama-server", "-", "f32", runs={1: [dict(tps=1000.0, p99=0.1, p50=0.1, ttft=0.01, load=1.0,
                                                                   wall=2.0)]})
    verdict = peer.print_row("default", 1, clover, [clover, llama], plan)
    assert len(verdict) == 1 and "tokens/s 500 vs 1000 (0.50x)" in verdict[0] and "p99 0.30 s vs 0.10 s" in verdict[0]
    assert "25%, 10.00 ms, 0/100 eager" in verdict[0]
    llama.runs[1][0]["tps"] = 400.0
    llama.runs[1][0]["p99"] = 0.25
    assert peer.print_row("default", 1, clover, [clover, llama], plan) == []  # faster, p99 within 1.5x


def test_a_server_gone_while_its_graphs_are_awaited_leaves_the_comparison(monkeypatch):
    s = peer.Server("clover", "compiled", "fp32", url="http://127.0.0.1:9")

    def reset(*a):
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(peer, "settle", reset)
    peer.ready(s, 1.0)  # no exception: the run goes on with the other servers
    assert s.error.startswith("waiting for its graphs: ConnectionResetError")
    assert peer.attempt(s, 4, ["p"], 1, 8) is None


def test_before_a_timed_run_every_compiled_clover_server_has_its_graphs(monkeypatch):
    """A shape first met in a timed round is compiled by that server's child: `quiet` waits for it
    before the next timed run, so no compile runs beside another server's run."""
    servers = [peer.Server("clover", "compiled", "fp32"), peer.Server("clover", "eager", "fp32"),
               peer.Server("llama-server", "-", "f32"), peer.Server("clover", "compiled", "int4", error="gone")]
    waited = []
    monkeypatch.setattr(peer, "ready", lambda s, timeout: waited.append((s.name, timeout)))
    peer.quiet(servers, 5.0)
    assert waited == [("clover compiled fp32", 5.0)]


def test_server_cpu_per_token_names_the_busiest_thread_and_all_threads():
    before = {"1": (1_000_000, 10), "2": (0, 0)}
    after = {"1": (5_000_000, 30), "2": (2_000_000, 1), "3": (1_000_000, 2)}  # thread 3 new in the round
    c = peer.thread_costs(before, after, 100)
    assert c == dict(busiest_us=40.0, all_us=70.0, preempted=0.2)
    assert peer.cpu_text(dict(cpu=c)) == "40 us (0.2), 70 us"
    assert peer.thread_costs({}, {}, 100) is None and peer.cpu_text({}) == "-"
    import os
    import sys

    now = peer.thread_clock(os.getpid())
    if sys.platform.startswith("linux"):
        assert str(os.getpid()) in now and all(cpu >= 0 and inv >= 0 for cpu, inv in now.values())
    assert peer.thread_clock(-1) == {}


def test_trace_writes_each_timed_request_with_its_server_and_level(tmp_path):
    """--trace: one JSON line per request of a run (latency, TTFT, client, start, longest chunk gap),
    appended; summarise reads the first three fields of the longer records."""
    import json

    out = [(0.5, 0.1, 64, 0, 0, 0.0, 0.02, 40, 10.0), (0.7, 0.2, 64, 1, 0, 0.01, 0.05, 38, 10.01)]
    run = peer.summarise(out, wall=1.0, load=0.5) | {"requests": out}
    assert run["tps"] == 128.0 and run["p50"] == pytest.approx(0.6)
    server = peer.pick_servers("clover compiled int4", True)[0]
    peer.trace(tmp_path / "t.jsonl", server, 16, run)
    peer.trace(tmp_path / "t.jsonl", server, 16, run)
    peer.trace(None, server, 16, run)  # no --trace: nothing written
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and lines[1]["server"] == "clover compiled int4" and lines[1]["clients"] == 16
    assert (lines[1]["latency"], lines[1]["client"], lines[1]["gap"], lines[1]["clock"]) == (0.7, 1, 0.05, 10.01)
