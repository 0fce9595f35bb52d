# Two entry points a new user needs: `make demo` and `make test`. Both build .venv from scratch.
# `make test` leaves out the tests that compile with inductor (marker `compiled`, tests/conftest.py)
# and those that start several processes (marker `slow`); `make test-compiled` and `make test-slow`
# run them; .ci/run runs all three.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned first: pip then takes the local CPU wheel instead of a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: install demo test test-compiled test-slow e2e bench clean model distill llamacpp llama-server

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/python -c "from clover.ops.linear import tiled; tiled.prepare(print)"  # the C++ CPU kernels, built once here
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/clover info --preset clover-35b-a3b
	$(BIN)/clover generate --prompt "Shall I compare thee" --max-new-tokens 48
	printf 'Sort: 41 7 93 28 65 12 80\n' | $(BIN)/clover generate --prompt-file - --max-new-tokens 32

test: install
	$(BIN)/python -m pytest -q -x -m "not compiled and not slow"

test-compiled: install
	$(BIN)/python -m pytest -q -x -m compiled

# the tests that start several processes or whole CLI commands (marker `slow`, tests/conftest.py)
test-slow: install
	$(BIN)/python -m pytest -q -x -m "slow and not compiled"

# The playground in headless Chromium against a real `clover serve` (screenshot: build/e2e/playground.png).
# Installs Debian's chromium when missing (needs root) and the e2e extra.
e2e: install
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  { echo "make e2e: needs chromium (as root: apt-get install -y chromium)"; exit 1; }
	$(BIN)/pip install -q -e ".[e2e]"
	CLOVER_E2E=1 $(BIN)/python -m pytest -q -x tests/test_server_playground.py

bench: install
	$(BIN)/python bench/forward.py

clean:
	rm -rf $(VENV) build *.egg-info

# Rebuild the shipped default model end to end (data, tokenizer, AR stage, block-diffusion stage,
# export to clover/assets/default, eval): about an hour on 2 CPU cores. RESUME=1 keeps finished steps.
model: install
	$(BIN)/pip install -q -e ".[train]"
	$(BIN)/python recipes/default/make_model.py $(if $(RESUME),--resume,)

# Self-distillation of the shipped model (issue 55; recipes/default/distill.toml, recipe.toml [distill]):
# its greedy answers to fresh task prompts, cached, then the distill objective; exports over
# clover/assets/default. Hours on 2 CPU cores (recipes/default/README.md). RESUME=1 keeps finished steps;
# STOP_AFTER=S checkpoints and exits after S seconds without exporting (a sitting shorter than the stage).
distill: install
	$(BIN)/pip install -q -e ".[train]"
	$(BIN)/python recipes/default/make_model.py --distill $(if $(RESUME),--resume,) $(if $(STOP_AFTER),--stop-after $(STOP_AFTER),)

# llama.cpp back end (docs/llamacpp.md): fetch the pinned llama-cpp-python sdist from PyPI, build its
# vendored llama.cpp (libllama + llama-simple) and a copy patched for block diffusion into build/llamacpp
# (~20 min on 2 cores), run their tests.
llamacpp: install
	$(BIN)/pip install -q -e ".[llamacpp]"
	PIP=$(abspath $(BIN))/pip clover/backends/llamacpp/build.sh build/llamacpp
	CLOVER_LLAMACPP=build/llamacpp $(BIN)/python -m pytest -q -x tests/test_gguf_export.py tests/test_llamacpp.py tests/test_llamacpp_diffusion.py

# Stock llama-server from the same pinned sdist, in the same build/llamacpp/stock tree (opt-in: only
# bench/serve_peer.py needs it), at the lowest CPU priority so a shared machine keeps its other work.
llama-server: install
	PIP=$(abspath $(BIN))/pip nice -n 19 clover/backends/llamacpp/build.sh build/llamacpp server
