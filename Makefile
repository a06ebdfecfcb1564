# The README's two commands: `make run` (main job on the bundled pair) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that returns the n-th Fibonacci number.

.PHONY: run test install

$(BIN)/dflash-mac: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(BIN)/dflash-mac

install: $(BIN)/dflash-mac

# Runs offline on the bundled pair (models/bundled); prints the text and the statistics.
run: install
	HF_HUB_OFFLINE=1 $(BIN)/dflash-mac generate "$(PROMPT)" --max-tokens 200 --verbose

test: install
	$(BIN)/python -m pytest -q
