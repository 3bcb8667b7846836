#!/usr/bin/env bash
# One prepared GPU session (issue 4's audit and issue 5's sweep), to run through the
# device tool on a lent H200 as ONE command, within its 10-minute limit:
#
#   here, once:  echo /.whl/ >> .git/info/exclude
#                python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                    --implementation cp --platform manylinux2014_x86_64 -d .whl beartype
#   device run:  command "bash tools/gpu_session.sh", carry [".whl"], timeout_s 600
#
# The GPU image has torch, jaxtyping, hypothesis, tqdm and matplotlib but not beartype,
# hence the wheel. attnref itself runs from src/ (nothing to install). Everything comes
# back as one archive, $OUT/gpu-results.tgz (the tool returns at most 8 files), plus the
# two summary tables and the log; unpack the archive into docs/ and commit.
#
# Dry run on a CPU (the tests do this):
#   DEVICE=cpu AUDIT_ARGS="--backend torch-sdpa-math --property forward" \
#   BENCH_ARGS="--tiny --backend reference" SERVING_ARGS="--seq 8 --batch 2 --heads 2" \
#   OUT=/tmp/x bash tools/gpu_session.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}  # on the GPU image, python3 is the one with torch
if ! "$PY" -c "import beartype" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-session}
DEVICE=${DEVICE:-cuda}
work=$(mktemp -d)
mkdir -p "$OUT"
{
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
    # the audit first (about 4 minutes on a GPU), then the sweep within what is left
    # shellcheck disable=SC2086
    timeout 250 "$PY" tools/gpu_audit.py --device "$DEVICE" --out "$work/gpu-audit" ${AUDIT_ARGS:-}
    echo "gpu_audit exit: $?"
    # shellcheck disable=SC2086
    timeout 240 "$PY" tools/gpu_bench.py --device "$DEVICE" --out "$work/gpu-bench" \
        --budget-s 180 ${BENCH_ARGS:-}
    echo "gpu_bench exit: $?"
    # decode tokens/s against cache length and page size (flash-kvcache), in what is left
    # shellcheck disable=SC2086
    timeout 45 "$PY" -m attnref.bench --api flash-kvcache --device "$DEVICE" --no-progress \
        --out "$work/gpu-serving" ${SERVING_ARGS:---seq 1024 8192 --page-size 0 256 \
        --batch 32 --heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 --runs 10}
    echo "serving bench exit: $?"
    # a backend that works on a side stream (class 31): the audit must fail it (exit 1)
    timeout 60 "$PY" -m attnref audit --backend tests.hostile:side_stream --device "$DEVICE" \
        --dtype float32 --property forward --property settled_output --no-progress
    echo "side-stream audit exit: $? (1 expected)"
    # torch's own context parallelism (its ring, through DTensor) on one NCCL rank: one
    # GPU cannot hold a group of several (NCCL refuses two ranks on one device)
    timeout 60 "$PY" -m attnref audit --api context-parallel --world-size 1 \
        --backend torch-context-parallel --device "$DEVICE" --dtype bfloat16 \
        --property forward --property cp_agreement --no-progress --verbose
    echo "torch context_parallel audit exit: $?"
} 2>&1 | tee "$OUT/session.log"
tar -czf "$OUT/gpu-results.tgz" -C "$work" .
cp "$work/gpu-audit/README.md" "$OUT/gpu-audit.md" 2>/dev/null
cp "$work/gpu-bench/README.md" "$OUT/gpu-bench.md" 2>/dev/null
cp "$work/gpu-serving/serving.csv" "$OUT/gpu-serving.csv" 2>/dev/null
echo "results: $OUT/gpu-results.tgz"
