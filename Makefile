# `make demo`, `make test` and `make test-all` each do all set-up first (scripts/setup.sh): create ./.venv if
# missing, install torch==$(TORCH) first, then this package editable with its extras. Safe to re-run:
# set-up is skipped when nothing changed.
#
#   make demo                  train the demo (trainfsm demo), print accuracy and where the files are
#   make demo ARGS="--steps 600"
#   make test                  the fast tier, under 5 minutes on 2 cores: every feature, one trial of each
#                              kind of fault (pytest -m "not slow and not cuda", 3 processes, 300 s a test at most)
#   make test-all              the full suite, about 21-24 minutes on 2 cores: every test, every trial (what CI runs;
#                              the cuda tests are skipped there, with their reason)
#   make test-gpu              the GPU tier: the tests marked cuda (one process) and benchmarks/overhead.py with a
#                              GPU-sized step (scripts/test-gpu.sh); without CUDA all skipped with their reasons, exit 0.
#                              On a GPU machine without network: scripts/gpu-check.sh (README, "On a GPU")
#   make test PYTEST_ARGS="-k diagram -x"
#   make test-all PYTEST_ARGS="-m faults"    one kind of test (markers: pyproject.toml, tests/tiers.py)
#   make test TEST_WORKERS=0   in this process, no xdist (a debugger, -s)
#   make lint                  ruff check + ruff format --check
#   make diagrams              regenerate diagrams/ from the machine's table
#   make docs                  build the docs site into site/ (mkdocs build --strict; CI runs it)
#   TORCH=2.5.1 make test      another torch version

SHELL := /bin/bash
VENV ?= .venv
TORCH ?= 2.13.0
export VENV TORCH

BIN := $(VENV)/bin
LINTED := src tests benchmarks examples
# pytest-xdist: a module's tests run on one worker (tests/conftest.py, pytest_xdist_make_scheduler). Three
# workers on 2 cores: the tests wait on other processes (torchrun agents, SLURM, timeouts) a good part of
# their time. Measured here, the same tests on one tree: the fast tier 280 s with 3 against 360 s with 2
# (CPU idle 5% against 12%). On fresh clones with 3: the fast tier 273-277 s, the full suite 1066 s
# (1206 s with 2, before the fast tier was trimmed). With 4 the fast tier took as long as with 3 (333 s
# both, 2026-11-28): the 2 cores are busy, so only less work makes it shorter.
TEST_WORKERS ?= 3
XDIST := -n $(TEST_WORKERS) --dist loadfile

.PHONY: setup demo test test-all test-gpu lint format diagrams docs clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(BIN)/trainfsm demo $(ARGS)

test: setup
	$(BIN)/python -m pytest -q -m "not slow and not cuda" --timeout 300 --durations=15 $(XDIST) $(PYTEST_ARGS)

test-all: setup
	$(BIN)/python -m pytest -q --durations=40 $(XDIST) $(PYTEST_ARGS)

test-gpu: setup
	PYTHON=$(BIN)/python bash scripts/test-gpu.sh $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

format: setup
	$(BIN)/ruff format $(LINTED)
	$(BIN)/ruff check --fix $(LINTED)

diagrams: setup
	$(BIN)/trainfsm diagram --format mermaid -o diagrams/machine.mmd
	$(BIN)/trainfsm diagram --format dot -o diagrams/machine.dot

docs:
	@bash scripts/setup.sh
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf runs build dist site .pytest_cache .mypy_cache .ruff_cache src/*.egg-info
