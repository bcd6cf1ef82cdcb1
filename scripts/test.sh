#!/usr/bin/env bash
# Run the test suite in the project virtualenv; extra arguments go to pytest.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
VENV="${VENV:-.venv}"
status=0
"$VENV/bin/python" -m pytest -q tests "$@" || status=$?
if [[ $status -eq 5 ]]; then
    echo "test.sh: FAILED: pytest collected no tests" >&2
fi
exit "$status"
