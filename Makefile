# The README's two commands: `make run` (main job on the bundled pair) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that returns the n-th Fibonacci number.

.PHONY: run test test-fast lint install bundle bundle-v2

$(BIN)/dflash-mac: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(BIN)/dflash-mac

install: $(BIN)/dflash-mac

# Runs offline on the bundled pair (models/bundled); prints the text and the statistics.
run: install
	HF_HUB_OFFLINE=1 $(BIN)/dflash-mac generate "$(PROMPT)" --max-tokens 200 --verbose

# Everything (what CI runs): lint, then the whole suite.
test: install lint
	$(BIN)/python -m pytest -q

# The quick loop while editing (< 90 s): no chi-square, long greedy or subprocess tests.
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Rebuilds the bundled pair from scratch (stdlib corpus -> tokenizer -> target -> drafter).
OPENBLAS := $(firstword $(wildcard /usr/lib/*-linux-gnu/libopenblas.so.0))
bundle: install
	LD_PRELOAD=$(OPENBLAS) $(BIN)/python -m dflash_mac.bundle.build --out models/bundled \
		--stage all --minutes 40

# The v2 pair (issue 15; not committed, see models/bundled/MODEL_CARD.md): the stages of `bundle`,
# then the extended corpus, the long-context continued pretraining (512 -> 1024 -> 2048) and both
# drafters distilled on it (KL to p_T). Every long stage resumes from .cache/bundle.
bundle-v2: install
	OPENBLAS_NUM_THREADS=1 LD_PRELOAD=$(OPENBLAS) $(BIN)/python -m dflash_mac.bundle.build \
		--out models/bundled --stage all2 --minutes 40
