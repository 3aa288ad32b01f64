#!/usr/bin/env bash
# The project installed into .venv (made with $PYTHON, default python3, when missing), with
# the extras named by the first argument: `bash scripts/venv.sh test`. Run by demo.sh and
# test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[$1]"
