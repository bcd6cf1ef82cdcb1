#!/usr/bin/env bash
# The GPU check, about 8 minutes on one H100 or H200: the `gpu` tests, the Triton read against the reference reads,
# and decode and serving ratios against DynamicCache and transformers' continuous batching, on CUDA.
#
#   bash scripts/gpu_check.sh              # on a machine whose python3 has a CUDA build of torch
#
# It uses the machine's python3 (PYTHON overrides) with this checkout on PYTHONPATH. transformers >= 5.23 and the
# test dependencies must be importable: where they are missing and nothing can be fetched, bring them as wheels in
# .whl/ (transformers, huggingface-hub, kernels, tokenizers, hypothesis, ...); the script installs .whl/*.whl into
# /tmp/site first. The bundled GGUF model is not needed: the benchmarks run a random model of SmolLM2-135M's shape
# (benchmarks/random_smollm2.py), so their times and KV bytes are the real model's shape, not its tokens.
# Logs and tables go to $OUT (default: gpu_check_out/).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c 'import torch, transformers; assert torch.cuda.is_available(), "no CUDA device";
print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")' \
    2>&1 | tee "$OUT/versions.txt" || exit 2

status=0
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, remember a failure
    local name="$1" limit="$2"
    shift 2
    echo "== $name" >&2
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit status $rc" >&2
    [[ $rc -eq 0 ]] || status=1
}

step gpu_tests 150 "$PY" -m pytest -q -m gpu -rs tests
step triton_read 90 "$PY" -m pytest -q tests/attention/test_triton_read.py tests/attention/test_paged_attention.py -x
model_dir="$(mktemp -d)"
step random_model 60 "$PY" benchmarks/random_smollm2.py "$model_dir"
step decode 120 "$PY" benchmarks/paged_attention.py --model "$model_dir" --device cuda --lengths 2048,8192 \
    --batches 1,8 --methods fp,k8v4,k4v4 --compiled --rounds 1 --steps 16
step serving 150 "$PY" benchmarks/serving.py --model "$model_dir" --device cuda --requests 32 --new 32
rm -rf "$model_dir"
echo "gpu_check: exit status $status; logs in $OUT" >&2
exit "$status"
