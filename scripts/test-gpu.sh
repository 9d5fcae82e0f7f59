#!/usr/bin/env bash
# The GPU tier (`make test-gpu`; scripts/gpu-check.sh runs it too): the tests marked `cuda`, then the
# overhead benchmark with a GPU-sized step against a hand-written loop.
#
#   PYTHON=python3 bash scripts/test-gpu.sh [pytest arguments]
#
# The tests run in one process (no xdist): one GPU, and tests that time a save or count host syncs
# must not share it. Without CUDA every cuda test is skipped with its reason and the benchmark says in
# one line why it did not run: exit 0. The exit status is pytest's when it failed, else 1 when the
# benchmark failed, else 0 (pytest's 5, "no tests collected", would mean the tier went missing: it
# fails too).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# cuBLAS picks its reduction order per workspace: with a fixed workspace the same product gives the
# same bits in every run (the tests compare resumed runs bit for bit). Read at cuBLAS's first use.
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
# Only the modules that hold cuda tests are collected: the GPU machine's python lacks packages that
# other modules import at their top (wandb, trainloop, torchdata, ...), and a module that fails to
# import fails the whole run. A cuda test is marked `pytest.mark.cuda` or parametrized with
# `DEVICES` (tests/tiers.py); tests/test_gpu_check.py checks that this finds every one.
mapfile -t modules < <(grep -lE 'pytest\.mark\.cuda|\bDEVICES\b' -r tests --include='test_*.py' | sort)
status=0
echo "test-gpu: $PYTHON -m pytest -m cuda (${#modules[@]} modules)"
"$PYTHON" -m pytest -q -m cuda -p no:xdist --timeout 300 --durations=20 "${modules[@]}" "$@" || status=$?
echo "test-gpu: $PYTHON benchmarks/overhead.py --device cuda"
"$PYTHON" benchmarks/overhead.py --device cuda || { [ "$status" -ne 0 ] || status=1; }
exit "$status"
