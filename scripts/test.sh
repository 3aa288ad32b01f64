#!/usr/bin/env bash
# The test command (README): install the project with its test extras into .venv, make sure
# PostgreSQL and Redis answer, lint and type-check, then run every test layer. The end-to-end
# tests provision a real vLLM CPU engine themselves (first run: a few minutes; then cached in
# ~/.cache/backfill). pytest's exit code is kept, so "no tests ran" (5) fails too.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/venv.sh test

bash scripts/services.sh

# The dashboard tests drive Debian's headless Chromium; a fresh machine does not have it.
if ! command -v chromium >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# The slowest 15 tests close the log, so a slow machine shows where its time went.
exec .venv/bin/python -m pytest --durations=15 "$@"
