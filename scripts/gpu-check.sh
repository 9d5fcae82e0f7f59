#!/usr/bin/env bash
# The first thing to run whenever a GPU is available (README, "On a GPU"): set-up without network,
# the GPU tier (scripts/test-gpu.sh: the tests marked `cuda`, then benchmarks/overhead.py --device
# cuda), all output to one file, and a short summary at the end. Under 8 minutes on one GPU.
#
#   scripts/gpu-check.sh                    on the GPU machine (exit status: the tier's)
#   scripts/gpu-check.sh --dry-run          anywhere: the same without CUDA (every cuda test skipped
#                                           with its reason, the benchmark skipped), exit 0
#   scripts/gpu-check.sh -k syncs           pytest arguments after the options
#
# Variables:
#   PYTHON=python3        the interpreter, used as it is: no virtualenv, nothing downloaded. The
#                         package runs from src/ (PYTHONPATH); wheels in .whl/ (packages that
#                         interpreter lacks, e.g. transitions and structlog: README, "On a GPU")
#                         are installed into a folder of their own with pip --no-index --no-deps.
#   GPU_CHECK_LOG         the log file (default: $OUT/gpu-check.log where OUT is set, else
#                         ./gpu-check.log)
#   GPU_CHECK_SECONDS=450 the tier's time limit; what it printed and the summary still come after.
#
# The summary's lines (docs/guides/gpu.md, "The summary"): result, tests, failed (one line per
# failed test), benchmark, python, torch, gpu, nvidia-smi, log.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

dry=0
if [ "${1:-}" = "--dry-run" ]; then
  dry=1
  shift
fi
PYTHON=${PYTHON:-python3}
LOG=${GPU_CHECK_LOG:-${OUT:+$OUT/}gpu-check.log}
LIMIT=${GPU_CHECK_SECONDS:-450}
SITE=${TMPDIR:-/tmp}/trainfsm-gpu-check-site
started=$(date +%s)

say() { echo "gpu-check: $*"; }

# ---------------------------------------------------------------- set-up, versions, the tier
check() {
  if ! command -v "$PYTHON" >/dev/null; then
    say "no interpreter $PYTHON (set PYTHON=...)"
    return 2
  fi
  say "python: $("$PYTHON" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
  local wheels=(.whl/*.whl)
  if [ -e "${wheels[0]}" ]; then
    say "installing ${#wheels[@]} wheel(s) from .whl/ into $SITE (no index, no dependencies)"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "${wheels[@]}" || return 2
  fi
  export PYTHONPATH="$ROOT/src:$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  # What the tier imports, named when missing, with the way to bring it (no network there).
  local missing
  missing=$("$PYTHON" - <<'EOF'
import importlib.util
needed = {"torch": "torch", "transitions": "transitions", "structlog": "structlog", "xxhash": "xxhash",
          "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
print(" ".join(pip for module, pip in needed.items() if importlib.util.find_spec(module) is None))
EOF
  )
  if [ -n "$missing" ]; then
    say "missing for $PYTHON: $missing. Bring them as wheels, on a machine with network, in this repository:"
    say "  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp" \
      "--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64" \
      "-d .whl $missing   (pure-Python ones need only --no-deps -d .whl NAME)"
    return 2
  fi
  "$PYTHON" - <<'EOF' || return 2
import torch
import trainfsm  # from src/: fails here, not in every test, if a dependency is missing

cuda = torch.cuda.is_available()
print(f"gpu-check: torch: {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
if cuda:
    p = torch.cuda.get_device_properties(0)
    print(f"gpu-check: gpu: {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
          f"{p.total_memory / 2**30:.1f} GiB), {torch.cuda.device_count()} visible")
else:
    print("gpu-check: gpu: none (torch.cuda.is_available() is False)")
EOF
  if command -v nvidia-smi >/dev/null; then
    say "nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu,utilization.gpu \
      --format=csv,noheader 2>&1 | head -1)"
  else
    say "nvidia-smi: not found"
  fi
  if [ "$dry" = 0 ]; then
    if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
      say "CUDA is not available to $PYTHON: nothing to check here (scripts/gpu-check.sh --dry-run tries the script)"
      return 2
    fi
    export TRAINFSM_REQUIRE_CUDA=1  # a cuda test that would skip fails instead
  fi
  export PYTHONUNBUFFERED=1
  say "the tier: scripts/test-gpu.sh (at most $LIMIT s)"
  timeout -k 10 "$LIMIT" env PYTHON="$PYTHON" bash scripts/test-gpu.sh "$@"
  local status=$?
  [ "$status" = 124 ] && say "the tier ran past $LIMIT s and was stopped"
  return "$status"
}

# ---------------------------------------------------------------- the summary, from the log
field() { grep -m1 "^gpu-check: $1: " "$LOG" | sed "s/^gpu-check: $1: //"; }

summary() {
  local status=$1 result tests counts line
  case $status in
    0) result=PASSED ;;
    124) result="TIMED OUT (the tier ran past $LIMIT s)" ;;
    *) result="FAILED (exit $status)" ;;
  esac
  [ "$dry" = 1 ] && result="$result, dry run: no CUDA required"
  line=$(grep -E '^[=]* ?[0-9]+ (passed|failed|skipped|deselected|errors?|xfailed|xpassed)' "$LOG" | tail -1)
  counts=""
  for kind in passed failed skipped error; do
    n=$(echo "$line" | grep -oE "[0-9]+ ${kind}s?" | grep -oE '^[0-9]+')
    counts="$counts${counts:+, }${n:-0} $kind$([ "$kind" = error ] && echo s)"
  done
  tests="$counts ($(echo "$line" | grep -oE 'in [0-9.]+s.*' | tr -d '=' | sed 's/ *$//'))"
  [ -z "$line" ] && tests="no pytest result in the log"
  echo "== gpu-check summary =="
  echo "result:     $result"
  echo "tests:      $tests"
  grep -E '^(FAILED|ERROR) ' "$LOG" | head -20 | sed 's/^/failed:     /'
  line=$(grep -E '^gpu ratio|^overhead.py --device cuda: skipped' "$LOG" | tail -1)
  echo "benchmark:  ${line:-not run}"
  echo "python:     $(field python)"
  echo "torch:      $(field torch)"
  echo "gpu:        $(field gpu)"
  echo "nvidia-smi: $(field nvidia-smi)"
  echo "log:        $LOG ($(wc -l <"$LOG") lines), $(($(date +%s) - started)) s in all"
}

mkdir -p "$(dirname "$LOG")"
say "log: $LOG" | tee "$LOG"
check "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
summary "$status" | tee -a "$LOG"
exit "$status"
