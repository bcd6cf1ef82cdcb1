#!/usr/bin/env bash
# Run the test suite in the project virtualenv; extra arguments go to pytest (first lane only): options are added to
# the whole suite (`-m "not model"`), and paths (`tests/test_smoke.py`, `path::test`) run instead of it.
#
# `bash scripts/test.sh --fast` runs only the bookkeeping lane: the pure-Python tests of hf_pagedkv/blocks
# (tests/blocks, marker `bookkeeping`) with torch blocked, in a few seconds (scripts/bookkeeping_lane.py); further
# arguments go to pytest.
#
# One lane per supported transformers version (pyproject.toml allows transformers>=5.23,<5.26):
#   1. the whole suite on the pinned, newest version (scripts/constraints.txt: 5.25.0), in $VENV (default .venv);
#   2. and 3. the contract, equivalence, layer-group, hybrid-retention and real-model tests (tests/test_compat.py,
#      tests/adapter/test_equivalence.py, tests/adapter/test_layer_groups.py, tests/retention/test_hybrid.py,
#      `-m model`) on each older supported version (OLDER_LANES below: 5.24.0 in .venv-tf524, 5.23.0 in
#      .venv-tf523), each set up by scripts/setup.sh with TRANSFORMERS_SPEC. An older lane adds a few minutes of
#      setup the first time, then ~3-4 minutes of tests on 2 cores.
#
# Environment:
#   OLDER_LANES  1: run lanes 2 and 3 as well; 0: lane 1 only; default: 1 when CI=true, else 0.
#   VENV         lane 1's virtualenv (default: .venv).
#   OMP_NUM_THREADS  torch's intra-op threads (default here: 1). The suite passes with any value (run it with the
#                    default thread count too); on a 2-core machine shared with other jobs one thread was 4x faster.
set -euo pipefail
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
if [[ "${1:-}" == "--fast" ]]; then
    shift
    [[ -x "$VENV/bin/python" ]] || VENV="$VENV" bash scripts/setup.sh
    exec "$VENV/bin/python" scripts/bookkeeping_lane.py -q "$@"
fi
# NOTE: keep in step with the transformers range in pyproject.toml: every supported version but the pin, newest first,
# as "<requirement> <virtualenv>".
OLDER_VERSIONS=(
    "transformers==5.24.0 .venv-tf524"
    "transformers==5.23.0 .venv-tf523"
)
# the tests an older lane runs: everything that touches transformers internals or compares against DynamicCache
OLDER_LANE_TESTS=(tests/test_compat.py tests/adapter/test_equivalence.py tests/adapter/test_layer_groups.py
                  tests/retention/test_hybrid.py)
OLDER_LANES="${OLDER_LANES:-}"
if [[ "${CI:-}" == "true" ]]; then
    OLDER_LANES="${OLDER_LANES:-1}"
    # the opt-in compiled read's tests (torch.compile with inductor: ~95 s cold on 2 cores); skipped locally
    export HF_PAGEDKV_COMPILE_TESTS="${HF_PAGEDKV_COMPILE_TESTS:-1}"
else
    OLDER_LANES="${OLDER_LANES:-0}"
fi
if [[ "$OLDER_LANES" != "0" && "$OLDER_LANES" != "1" ]]; then
    echo "test.sh: OLDER_LANES must be 0 or 1, got '$OLDER_LANES'" >&2
    exit 2
fi

# pytest's exit status, with its "no tests collected" (5) made a failure that says so
run_pytest() {
    local venv="$1" label="$2" status=0
    shift 2
    "$venv/bin/python" -m pytest -q "$@" || status=$?
    if [[ $status -eq 5 ]]; then
        echo "test.sh: FAILED: $label: pytest collected no tests" >&2
    fi
    return "$status"
}

lane_time() {
    echo $(( $(date +%s) - $1 ))
}

status=0
start=$(date +%s)
VENV="$VENV" bash scripts/setup.sh
lib=$("$VENV/bin/python" -c 'import transformers; print(transformers.__version__)')
echo "test.sh: lane 1: the whole suite on transformers $lib ($VENV)" >&2
# the whole of tests/, unless the arguments name tests themselves (a path, or path::test)
targets=(tests)
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        targets=()
        break
    fi
done
run_pytest "$VENV" "lane 1" "${targets[@]}" "$@" || status=$?
echo "test.sh: lane 1 (transformers $lib) exit status $status, $(lane_time "$start") s" >&2

lane=1
for entry in "${OLDER_VERSIONS[@]}"; do
    lane=$((lane + 1))
    read -r spec venv <<<"$entry"
    if [[ "$OLDER_LANES" != "1" ]]; then
        echo "test.sh: lane $lane ($spec) skipped: OLDER_LANES=1 (or CI=true) runs it" >&2
        continue
    fi
    start=$(date +%s)
    lane_status=0
    VENV="$venv" TRANSFORMERS_SPEC="$spec" bash scripts/setup.sh
    lib=$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')
    echo "test.sh: lane $lane: contract, equivalence, layer-group, hybrid retention and real-model tests on" \
        "transformers $lib ($venv)" >&2
    # NOTE: two pytest runs: a run selects by path or by marker, not "these files or that marker"; the first leaves
    # out the model-marked tests of these files, which the second runs.
    run_pytest "$venv" "lane $lane" "${OLDER_LANE_TESTS[@]}" -m "not model" || lane_status=$?
    run_pytest "$venv" "lane $lane (model)" tests -m model || lane_status=$?
    echo "test.sh: lane $lane (transformers $lib) exit status $lane_status, $(lane_time "$start") s" >&2
    [[ $status -ne 0 ]] || status=$lane_status
done
exit "$status"
