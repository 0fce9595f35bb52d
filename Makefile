# Two entry points a new user needs: `make demo` and `make test`. Both build .venv from scratch.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned first: pip then takes the local CPU wheel instead of a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: install demo test bench clean model

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/clover info --preset clover-35b-a3b
	$(BIN)/clover generate --prompt "Shall I compare thee" --max-new-tokens 48

test: install
	$(BIN)/python -m pytest -q -x

bench: install
	$(BIN)/python bench/forward.py

clean:
	rm -rf $(VENV) build *.egg-info

# Rebuild the shipped default model end to end (data, tokenizer, AR stage, block-diffusion stage,
# export to clover/assets/default, eval): about an hour on 2 CPU cores. RESUME=1 keeps finished steps.
model: install
	$(BIN)/pip install -q -e ".[train]"
	$(BIN)/python recipes/default/make_model.py $(if $(RESUME),--resume,)
