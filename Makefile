# `make demo` and `make test` each do all set-up first (scripts/setup.sh): create ./.venv if missing,
# install torch==$(TORCH) first, then this package editable with its extras. Safe to re-run: set-up
# is skipped when nothing changed.
#
#   make demo                  train the demo (trainfsm demo), print accuracy and where the files are
#   make demo ARGS="--steps 600"
#   make test                  the test suite (python -m pytest -q)
#   make test PYTEST_ARGS="-k diagram -x"
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

.PHONY: setup demo test lint format diagrams docs clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(BIN)/trainfsm demo $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

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
