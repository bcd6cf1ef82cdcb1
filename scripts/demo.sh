#!/usr/bin/env bash
# Run the paged-KV generation demo with output checking; extra arguments go to `hf-pagedkv generate`.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
VENV="${VENV:-.venv}"
exec "$VENV/bin/hf-pagedkv" generate --check "$@"
