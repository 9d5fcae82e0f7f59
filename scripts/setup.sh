#!/usr/bin/env bash
# Set up the project's virtualenv: create it, install torch (pinned) FIRST, then the package, editable,
# with its extras. `make demo` and `make test` call this; it is idempotent and fast once done.
#
# Why torch first and pinned: with no torch installed, `pip install -e .` resolves `torch>=2.4` to the
# newest release, a build that pulls several GB of CUDA packages. With the pinned torch already in
# place, that requirement is satisfied and pip installs nothing more for it.
#
# Variables (environment or `make VAR=...`):
#   TORCH=2.13.0       the torch version to install (TORCH=2.5.1 make test)
#   TORCH_PIP_ARGS=    extra pip arguments for the torch install only (e.g. an --index-url of CPU wheels)
#   PYTHON=python3     the interpreter that creates the virtualenv
#   VENV=.venv         where the virtualenv lives
#   EXTRAS=dev,demo,docs   the package extras to install (docs: the tests build the site too)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH=${TORCH:-2.13.0}
TORCH_PIP_ARGS=${TORCH_PIP_ARGS:-}
EXTRAS=${EXTRAS:-dev,demo,docs}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating the virtualenv $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
py="$VENV/bin/python"

have=$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
if [ "$have" != "$TORCH" ] && [ "${have%%+*}" != "$TORCH" ]; then  # 2.13.0+cpu counts as 2.13.0
  echo "setup: installing torch==$TORCH first (found: ${have:-none})"
  # shellcheck disable=SC2086  # TORCH_PIP_ARGS is a list of arguments
  "$py" -m pip install $TORCH_PIP_ARGS "torch==$TORCH"
fi

# The package: reinstalled only when pyproject.toml, the extras or torch changed, or when the
# virtualenv's trainfsm is not this checkout's src/ (a moved or copied .venv).
want="$("$py" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())') $EXTRAS torch==$TORCH"
stamp="$VENV/.trainfsm-setup"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ] \
  || ! "$py" -c 'import importlib.util as u, sys; s = u.find_spec("trainfsm"); sys.exit(not (s and s.origin or "").startswith(sys.argv[1]))' "$PWD/src/" 2>/dev/null; then
  echo "setup: installing trainfsm (editable) with extras [$EXTRAS]"
  "$py" -m pip install -e ".[$EXTRAS]"
  echo "$want" >"$stamp"
fi
