"""`clover serve` start-up: the C++ CPU kernels are built before the first request, never inside
one; `--runner compiled` answers while its graphs compile elsewhere and keeps them on disk."""

import os
import threading
import time

import pytest
import torch

import clover
from clover.api import eos_ids
from clover.compile import state_of, warm
from clover.engine.runner import CompiledRunner
from clover.ops.linear import tiled
from clover.server import Settings, create_app
from helpers import save_tiny_model, tiny_model
from server_utils import RunningServer, client, metric


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return clover.load(save_tiny_model(tmp_path_factory.mktemp("startup-model")))


def test_kernels_are_built_at_start_up_not_inside_a_request(loaded, monkeypatch):
    model, tokenizer = loaded
    builds = []
    monkeypatch.setattr(tiled, "_state", {"bf16_x": False})  # as in a new process: nothing built yet
    monkeypatch.setattr(tiled, "_load", lambda: builds.append(threading.current_thread().name) or False)
    monkeypatch.setattr(tiled, "needs_build", lambda: True)
    app = create_app(model, tokenizer, Settings(model_id="tiny", block_size=4), eos_ids(model, tokenizer))
    assert builds == [threading.current_thread().name]  # at start-up, in the thread that made the app
    with RunningServer(app) as server:
        reply = client(server).completions.create(model="tiny", prompt="hello", max_tokens=8)
    assert reply.choices[0].text is not None
    assert builds == [threading.current_thread().name]  # the request (greedy picks included) built nothing


def test_int4_layers_are_packed_at_start_up():
    from clover.quant import Int4Linear
    from clover.utils.startup import prepare

    model = torch.nn.Sequential(Int4Linear(64, 32, 32), torch.nn.ReLU(), Int4Linear(32, 64, 32))
    assert all(m._packed is None for m in model if isinstance(m, Int4Linear))
    prepare(model)
    assert all(m._packed is not None for m in model if isinstance(m, Int4Linear))


def test_prepare_says_when_it_compiles(monkeypatch):
    said = []
    monkeypatch.setattr(tiled, "_state", {"bf16_x": False})
    monkeypatch.setattr(tiled, "_load", lambda: True)
    monkeypatch.setattr(tiled, "_supported", lambda: True)
    monkeypatch.setattr(tiled, "needs_build", lambda: True)
    assert tiled.prepare(said.append) is True
    assert len(said) == 1 and "building the C++ CPU kernels" in said[0]
    tiled.prepare(said.append)  # decided: nothing more to say or build
    assert len(said) == 1


def test_needs_build_follows_the_library_and_sources(tmp_path, monkeypatch):
    monkeypatch.setattr(tiled, "_build_dir", lambda: tmp_path)
    assert tiled.needs_build()
    (tmp_path / "clover_cpu_ops.so").write_bytes(b"")
    assert not tiled.needs_build()


def test_the_extension_is_named_by_its_sources(tmp_path, monkeypatch):
    """Two checkouts with other kernel sources (a header included) build into folders of their own."""
    (tmp_path / "tiled.cpp").write_text("a")
    (tmp_path / "more.cpp").write_text("b")
    monkeypatch.setattr(tiled, "_SOURCE", tmp_path / "tiled.cpp")
    monkeypatch.setattr(tiled, "_MORE_SOURCES", (tmp_path / "more.cpp",))
    first = tiled._name()
    assert first.startswith("clover_cpu_ops_") and tiled._name() == first
    (tmp_path / "shared.h").write_text("c")
    assert tiled._name() != first


def test_the_extension_is_named_by_its_checkout(tmp_path, monkeypatch):
    """The same sources in another folder (a second checkout) build elsewhere: ninja would rebuild the one
    library under the other checkout's running processes, since its commands name the source paths."""
    first = tiled._name()
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        for path in (tiled._SOURCE, *tiled._MORE_SOURCES, *tiled._SOURCE.parent.glob("*.h")):
            (tmp_path / folder / path.name).write_bytes(path.read_bytes())
    names = []
    for folder in ("a", "b"):
        monkeypatch.setattr(tiled, "_SOURCE", tmp_path / folder / tiled._SOURCE.name)
        monkeypatch.setattr(tiled, "_MORE_SOURCES", tuple(tmp_path / folder / p.name for p in tiled._MORE_SOURCES))
        names.append(tiled._name())
    assert len({first, *names}) == 3


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next(tmp_path):
    """A builder killed midway leaves torch's `lock` file: the next load removes it (under clover's flock,
    which only a live process holds) and loads, where torch alone waited for ever."""
    import subprocess
    import sys
    import textwrap

    held = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from clover.ops.linear import tiled
        with tiled._one_builder(Path({str(tmp_path)!r})):
            print("holding", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "holding"
        (tmp_path / "lock").write_text("")  # a live builder's lock: kept while it holds the flock
        waiter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            from pathlib import Path
            from clover.ops.linear import tiled
            print("trying", flush=True)
            with tiled._one_builder(Path({str(tmp_path)!r})):
                print("built", flush=True)
            """)], stdout=subprocess.PIPE, text=True)
        assert waiter.stdout.readline().strip() == "trying"
        with pytest.raises(subprocess.TimeoutExpired):
            waiter.wait(timeout=2)
        assert (tmp_path / "lock").exists()
        held.kill()  # dies holding it, `lock` left behind
        assert waiter.communicate(timeout=60)[0].strip() == "built"
        assert not (tmp_path / "lock").exists()
    finally:
        held.kill()


def _never_done(model, c_shims, conn):
    """A compiling child whose compiles never end: it notes each shape it is sent, reports none."""
    while True:
        try:
            conn.recv()
        except (EOFError, OSError):
            return
        with open(os.environ["CLOVER_TEST_ASKED"], "a") as f:
            f.write("shape\n")


@pytest.mark.parametrize("mode", ["ar", "low_confidence"])  # low_confidence: fused step functions too
def test_a_compiled_server_answers_while_its_graphs_compile(loaded, tmp_path, monkeypatch, mode):
    """The compiles are the child's: requests are answered (eagerly, the same replies) while every
    shape and fused layout they met is still compiling there, and the server compiles nothing
    itself meanwhile."""
    model, tokenizer = loaded
    state_of(model).deferred.clear()
    state_of(model).fused_deferred.clear()
    asked = tmp_path / "asked"
    monkeypatch.setenv("CLOVER_TEST_ASKED", str(asked))
    monkeypatch.setattr(warm, "_child", _never_done)
    ref = clover.generate(model, tokenizer, "the cat", max_new_tokens=6, block_size=4, threshold=0.5, mode=mode).text
    settings = Settings(model_id="tiny", block_size=4, threshold=0.5, mode=mode, runner="compiled")
    with RunningServer(create_app(model, tokenizer, settings, eos_ids(model, tokenizer))) as server:
        for _ in range(2):
            reply = client(server, timeout=120).completions.create(model="tiny", prompt="the cat", max_tokens=6)
            assert reply.choices[0].text == ref
        time.sleep(0.5)  # idle: a server that compiles when idle would start now
        assert metric(server, "clover_graphs_deferred") > 0
        assert metric(server, "clover_graphs_compiled_total") == 0
    assert asked.read_text().count("shape") == state_of(model).waiting() > 0
    assert bool(state_of(model).fused_deferred) == (mode != "ar")


def _no_trace(*args, **kwargs):
    raise AssertionError("a graph was traced in the server")


def test_the_child_compiles_into_the_disk_cache_and_the_server_loads_it(tmp_path, monkeypatch):
    """`warm.cache_dir` is where graphs go: the child's compile of a deferred shape writes it there
    with the key that loads it, and the server loads the graph by that key, without tracing it, to
    the eager forward's logits; a restart loads the noted graph the same way at start-up."""
    from clover.compile.state import CompileState
    from clover.engine.runner import EagerRunner

    monkeypatch.setenv(warm.CACHE_ENV, str(tmp_path / "unused"))
    monkeypatch.setenv(warm.NICE_ENV, "0")  # this test waits for the child
    path = warm.cache_dir(tmp_path / "graphs")
    assert os.environ[warm.CACHE_ENV] == str(path)
    model = tiny_model(7, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    runner = CompiledRunner(model, defer=True)
    ids = torch.randint(0, 100, (1, 4))
    with torch.inference_mode():
        runner.forward(ids, runner.new_cache(1, 64), draft_len=4, block_size=4)
    assert runner.eager_calls == 1 and state_of(model).waiting() == 1
    background = warm.Background(model)
    try:
        background.sync()
        deadline = time.time() + 900
        while background.in_flight() and time.time() < deadline:
            time.sleep(0.2)
        assert not background.in_flight() and background.can_load() and not background.can_compile()
        assert any((path / "fxgraph").rglob("*"))
        monkeypatch.setattr(CompileState, "through_dynamo", _no_trace)
        with torch.inference_mode():
            assert background.load_one()
            got = runner.forward(ids, runner.new_cache(1, 64), draft_len=4, block_size=4)
            want = EagerRunner(model).forward(ids, runner.new_cache(1, 64), draft_len=4, block_size=4)
        assert background.waiting() == 0 and runner.replayed_calls == 1
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        background.close()
    # a restart: a model built the same way loads the noted graph at start-up, by its key
    (key,) = warm.Compiled.of(model).keys()
    again = tiny_model(7, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    restarted = warm.Background(again, child=False)
    assert restarted.noted == {key} and key in state_of(again).deferred and key not in state_of(again).replays
    with torch.inference_mode():
        assert restarted.load_noted() == 1
    assert key in state_of(again).replays and restarted.waiting() == 0
    other = tiny_model(7, num_hidden_layers=2, layer_types=["full_attention", "full_attention"])
    assert warm.Compiled.of(other).keys() == [] and not warm.Background(other, child=False).noted
    monkeypatch.undo()
    # a note without its load key (an older server's) is compiled by the server, a disk cache hit
    monkeypatch.setenv(warm.CACHE_ENV, str(path))
    for graph in warm.Compiled.of(model).folder.glob("*.graph"):
        graph.unlink()
    third = tiny_model(7, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    restarted = warm.Background(third, child=False)
    assert restarted.load_noted() == 0 and restarted.can_compile() and not restarted.can_load()
    hits = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
    with torch.inference_mode():
        assert restarted.compile_one()
    assert key in state_of(third).replays and restarted.waiting() == 0
    assert torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"] > hits


def test_the_noted_shapes_are_whole_files_under_the_model_fingerprint(tmp_path, monkeypatch):
    """A note (JSON, never a pickle) is found again by a model of the same build only; an unreadable
    note is skipped."""
    monkeypatch.setenv(warm.CACHE_ENV, str(tmp_path))
    model = tiny_model(7, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    noted = warm.Compiled.of(model)
    assert noted.keys() == []
    from clover.compile.shapes import ShapeKey

    key = ShapeKey((2, 5), torch.device("cpu"), 4, 1, 4, False, True, 256, 2, torch.bfloat16, 5, False, True, 64)
    noted.add(key)
    noted.add(key)  # the same shape: one note
    (noted.folder / "broken.key").write_bytes(b"not json")
    (noted.folder / "other.key").write_text('{"dtype": "nn"}')  # not a note of this version
    assert noted.keys() == [key] and isinstance(noted.keys()[0].device, torch.device)
    assert all(oct(p.stat().st_mode & 0o777) == "0o644" for p in noted.folder.glob("*.key") if p.name != "broken.key")
    assert not list(noted.folder.glob("*.tmp"))
    same = tiny_model(7, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    assert warm.Compiled.of(same).keys() == [key]
    for other in (tiny_model(9, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
                  tiny_model(7, num_hidden_layers=1, layer_types=["full_attention"])):  # other weights, layers
        assert warm.Compiled.of(other).keys() == []
    monkeypatch.delenv(warm.CACHE_ENV)
    assert warm.Compiled.of(model) is None


def test_the_warm_up_queues_the_default_shapes_for_the_child_before_any_request(loaded, tmp_path, monkeypatch):
    from clover.server.app import warm_up

    model, tokenizer = loaded
    state_of(model).deferred.clear()
    asked = tmp_path / "asked"
    monkeypatch.setenv("CLOVER_TEST_ASKED", str(asked))
    monkeypatch.setattr(warm, "_child", _never_done)
    settings = Settings(model_id="tiny", block_size=4, threshold=0.5, mode="ar", runner="compiled")
    app = create_app(model, tokenizer, settings, eos_ids(model, tokenizer))
    warm_up(app, tokenizer)
    queued = state_of(model).waiting()
    assert queued > 0
    with RunningServer(app):
        deadline = time.time() + 60
        while not (asked.exists() and asked.read_text().count("shape") == queued) and time.time() < deadline:
            time.sleep(0.05)
    assert asked.read_text().count("shape") == queued


def test_the_child_ends_when_the_server_end_of_its_pipe_closes(loaded, monkeypatch):
    """As when the server dies: the child must not live on holding the server's listening socket."""
    model, _ = loaded
    monkeypatch.setattr(warm, "_child", _never_done)
    warmer = warm.Warmer(state_of(model))
    warmer.conn.close()
    warmer.proc.join(timeout=30)
    assert not warmer.proc.is_alive()


def test_a_restarted_server_answers_before_it_loads_the_noted_graphs(loaded, tmp_path, monkeypatch):
    """The graphs an earlier server noted load in the background, one at a time while the server is
    idle, never before it answers nor while a request runs: here a load that blocks until the test
    lets it go, and a request answered (eagerly, the same reply) before it and after it."""
    from clover.compile.shapes import ShapeKey
    from clover.compile.state import CompileState
    from clover.server import scheduler as sched

    model, tokenizer = loaded
    state_of(model).deferred.clear()
    monkeypatch.setenv(warm.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CLOVER_TEST_ASKED", str(tmp_path / "asked"))
    monkeypatch.setattr(warm, "_child", _never_done)
    monkeypatch.setattr(sched, "IDLE_BEFORE_COMPILE_S", 1.0)
    keys = [ShapeKey((1, r), torch.device("cpu"), 4, 1, 4, False, True, 64, 0, torch.float32, r, False, True, 0)
            for r in (3, 5)]
    for key in keys:
        warm.Compiled.of(model).add(key)
    started, release, loads = threading.Event(), threading.Event(), []

    def blocking_load(self, key):
        loads.append(key)
        started.set()
        assert release.wait(60)

    monkeypatch.setattr(CompileState, "compile_shape", blocking_load)
    ref = clover.generate(model, tokenizer, "the cat", max_new_tokens=6, block_size=4, mode="ar").text
    settings = Settings(model_id="tiny", block_size=4, mode="ar", runner="compiled")
    try:
        with RunningServer(create_app(model, tokenizer, settings, eos_ids(model, tokenizer))) as server:
            reply = client(server, timeout=120).completions.create(model="tiny", prompt="the cat", max_tokens=6)
            assert reply.choices[0].text == ref and loads == []  # answered before any load began
            assert metric(server, "clover_graphs_deferred") >= len(keys)
            assert started.wait(60)  # idle: the first load begins, in the background
            assert metric(server, "clover_graphs_compiled_total") == 0
            release.set()
            deadline = time.time() + 60
            while metric(server, "clover_graphs_compiled_total") < len(keys) and time.time() < deadline:
                time.sleep(0.05)
            assert sorted(loads) == sorted(keys)  # one at a time, none sent to the compiling child
            reply = client(server, timeout=120).completions.create(model="tiny", prompt="the cat", max_tokens=6)
            assert reply.choices[0].text == ref
    finally:
        release.set()
    assert not any(k in keys for k in state_of(model).deferred)


def test_a_note_is_never_half_written(tmp_path, monkeypatch):
    """A crash mid-write leaves the notes as they were: no partial note, no temporary file (written
    whole, then renamed); a temporary file a killed process left behind is not read as a note."""
    from clover.compile.shapes import ShapeKey

    monkeypatch.setenv(warm.CACHE_ENV, str(tmp_path))
    model = tiny_model(7, num_hidden_layers=1, layer_types=["full_attention"])
    noted = warm.Compiled.of(model)
    first, second = (ShapeKey((1, r), torch.device("cpu"), 4, 1, 4, False, True, 64, 0, torch.float32, r, False,
                              True, 0) for r in (3, 5))
    noted.add(first)
    before = {p.name: p.read_bytes() for p in noted.folder.iterdir()}

    def crash(*args):
        raise KeyboardInterrupt  # the process stopped between the write and the rename

    monkeypatch.setattr(warm.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        noted.add(second)
    monkeypatch.undo()
    monkeypatch.setenv(warm.CACHE_ENV, str(tmp_path))
    assert {p.name: p.read_bytes() for p in noted.folder.iterdir()} == before
    (noted.folder / "abcd.tmp").write_text('{"shape": [1, ')  # a killed writer's leftover
    assert noted.keys() == [first]


def test_the_first_requests_imports_are_made_at_start_up():
    """What a server's first request would import (anyio's backend, at its first disconnect check)
    is imported when the app is made, not beside that request's decode."""
    import subprocess
    import sys

    code = ("import sys; from clover.server import app; names = app.FIRST_REQUEST_IMPORTS; "
            "before = [n in sys.modules for n in names]; app.import_ahead(); "
            "print(before, [n in sys.modules for n in names])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["[False]", "[True]"]


def test_a_loaded_graph_that_does_not_fit_a_call_runs_eagerly_never_traced_in_a_request(monkeypatch):
    """A graph loaded by its cache key has no dynamo graph behind it: where its Replay refuses a call
    (another layout), a deferring runner runs that call eagerly and queues the shape again, instead
    of tracing and compiling it inside the request."""
    from clover.compile.shapes import ShapeKey
    from clover.compile.state import CompileState

    state = CompileState(tiny_model(7, num_hidden_layers=1, layer_types=["full_attention"]))
    key = ShapeKey((1, 4), torch.device("cpu"), 4, 1, 4, True, False, 256, 1, torch.float32, 0, False, True, 0)
    class Refusing:
        def current(self):
            return True

        def __call__(self, *args):
            return None  # another layout than the call's

    state.replays[key] = Refusing()
    state.untraced.add(key)
    monkeypatch.setattr(CompileState, "through_dynamo", _no_trace)
    assert state.call(key, None, None, None, defer=True) == (None, False)
    assert key in state.deferred and key not in state.replays and key not in state.untraced


class _Pauses:
    def __init__(self):
        self.paused = []

    def pause(self, paused):
        self.paused.append(paused)


def test_the_child_runs_while_idle_and_only_its_share_while_the_server_decodes(loaded, monkeypatch):
    """`pace`: idle, the child runs; decoding, it is stopped for the first (1 - share) of every
    period (the first replies never share the CPU with it) and runs the rest."""
    model, _ = loaded
    monkeypatch.setenv(warm.SHARE_ENV, "0.25")
    background = warm.Background(model, child=False)
    background.warmer = _Pauses()
    period = warm.SHARE_PERIOD_S
    for now, decoding in ((0.0, False), (10.0, True), (10.0 + 0.7 * period, True), (10.0 + 0.8 * period, True),
                          (10.0 + 1.1 * period, True), (10.0 + 1.9 * period, True), (20.0, False)):
        background.pace(decoding, now=now)
    assert background.warmer.paused == [False, True, True, False, True, False, False]
    monkeypatch.setenv(warm.SHARE_ENV, "not a number")
    assert warm.compile_share() == 0.2


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_state(pid, wanted):
    deadline = time.time() + 30
    while _state(pid) not in wanted and time.time() < deadline:
        time.sleep(0.02)
    return _state(pid)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_pausing_stops_the_child_and_close_ends_a_stopped_one(loaded, monkeypatch):
    model, _ = loaded
    monkeypatch.setattr(warm, "_child", _never_done)
    warmer = warm.Warmer(state_of(model))
    try:
        deadline = time.time() + 30
        while os.getpgid(warmer.proc.pid) != warmer.proc.pid and time.time() < deadline:
            time.sleep(0.02)  # the child makes its own process group first thing
        warmer.pause(True)
        assert warmer.paused and _wait_state(warmer.proc.pid, "T") == "T"
        warmer.pause(False)
        assert not warmer.paused and _wait_state(warmer.proc.pid, "SR") in "SR"
        warmer.pause(True)
    finally:
        warmer.close()
    assert not warmer.proc.is_alive()


def _reports_keys(model, c_shims, conn):
    """A compiling child that reports every shape at once with a load key (compiles nothing)."""
    while True:
        try:
            key, _ = conn.recv()
        except (EOFError, OSError):
            return
        conn.send((key, {"aot": "test-key"}))


def test_graphs_with_a_key_load_on_the_scheduler_thread_without_waiting_for_idle(loaded, monkeypatch):
    """A graph the child reports with its cache key is loaded by the scheduler between turns (no
    idle wait: here the idle wait is never over), never compiled in the server; requests are
    answered as before."""
    from clover.compile.state import CompileState
    from clover.server import scheduler as sched

    model, tokenizer = loaded
    state_of(model).deferred.clear()
    state_of(model).fused_deferred.clear()
    monkeypatch.setattr(warm, "_child", _reports_keys)
    monkeypatch.setattr(sched, "IDLE_BEFORE_COMPILE_S", 1e6)
    loads, compiles = [], []

    def load(self, key, graph):
        loads.append((threading.current_thread().name, graph["aot"]))
        self.deferred.pop(key, None)
        self.fused_deferred.pop(key, None)
        return True

    monkeypatch.setattr(CompileState, "load", load)
    monkeypatch.setattr(CompileState, "compile_shape", lambda self, key: compiles.append(key))
    ref = clover.generate(model, tokenizer, "the cat", max_new_tokens=6, block_size=4, mode="ar").text
    settings = Settings(model_id="tiny", block_size=4, mode="ar", runner="compiled")
    with RunningServer(create_app(model, tokenizer, settings, eos_ids(model, tokenizer))) as server:
        for _ in range(2):
            reply = client(server, timeout=120).completions.create(model="tiny", prompt="the cat", max_tokens=6)
            assert reply.choices[0].text == ref
        deadline = time.time() + 60
        while metric(server, "clover_graphs_compiled_total") < 1 and time.time() < deadline:
            time.sleep(0.05)
        assert metric(server, "clover_graphs_compiled_total") >= 1
    assert loads and all(t == "clover-scheduler" and k == "test-key" for t, k in loads)
    assert compiles == []


class _Paced:
    """Stands in for the compiling child's `Background`: `queued` shapes wait; records `pace` calls."""

    def __init__(self, queued):
        self.queued, self.paces = queued, []

    def pace(self, decoding):
        self.paces.append(decoding)

    def waiting(self):
        return self.queued

    def sync(self):
        pass

    def can_load(self) -> bool:
        return False

    def can_compile(self) -> bool:
        return False

    def in_flight(self) -> bool:
        return bool(self.queued)

    def close(self):
        pass


def test_the_decoding_loop_paces_the_child_only_while_shapes_are_queued(loaded):
    """With nothing queued the child has nothing to do: the decoding turns do not stop it (no signal
    per request); with shapes queued every turn paces it."""
    from clover.engine import DecodeConfig
    from clover.server.scheduler import RowJob, Scheduler

    from clover.engine import Engine

    model, tokenizer = loaded
    key, ids = DecodeConfig(mode="ar", block_size=1).engine_key(), tokenizer("hello")["input_ids"]
    with torch.inference_mode():  # what a first decode builds (kernels) is built before the timed wait
        Engine(model, Scheduler(model, ()).config(key, 2)).generate([ids])
    for queued in (0, 2):
        sched = Scheduler(model, (), max_batch=4)
        sched.compiles = _Paced(queued)
        done = threading.Event()

        class Box:
            def post(self, item):
                if item.kind != "tokens" or item.finish_reason:
                    done.set()

        sched.start()
        try:
            sched.submit([RowJob(Box(), 0, ids, 6, key)])
            assert done.wait(120)
        finally:
            sched.stop()
        decoding = sum(sched.compiles.paces)
        assert decoding == 0 if queued == 0 else decoding >= 6
