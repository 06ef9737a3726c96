#!/usr/bin/env bash
# One-step set-up and run. Usage:
#   bash scripts/quickstart.sh serve [dsctl serve flags...]   # set up, then serve the built-in tiny-py model
#   bash scripts/quickstart.sh test  [pytest args...]         # set up, then run the whole test suite
# Set-up: a virtual environment in .venv that can see the system's packages (so a machine that already
# has torch, e.g. a GPU image, keeps its torch); torch==2.13.0 is installed only when none is importable.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: bash scripts/quickstart.sh serve|test [args...]}
shift

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    "$VPY" -m pip install --quiet "torch==2.13.0"
fi
"$VPY" -m pip install --quiet --disable-pip-version-check -e ".[test]"

case "$mode" in
    serve) exec "$VPY" -m dsctl serve "$@" ;;
    test)  "$VPY" -m ruff check . && exec "$VPY" -m pytest tests -q -rs "$@" ;;
    *) echo "unknown mode '$mode' (use serve or test)" >&2; exit 2 ;;
esac
