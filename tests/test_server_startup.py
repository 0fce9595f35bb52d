"""`clover serve` start-up: the C++ CPU kernels are built before the first request, never inside
one; `--runner compiled` answers while its graphs compile elsewhere and keeps them on disk."""

import threading

import pytest

import clover
from clover.api import eos_ids
from clover.ops.linear import tiled
from clover.server import Settings, create_app
from helpers import save_tiny_model
from server_utils import RunningServer, client


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
