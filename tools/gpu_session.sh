#!/usr/bin/env bash
# One prepared GPU session: audit every backend, then the sweep, to run through the
# device tool on a lent H200 as ONE command, within its 10-minute limit:
#
#   here, once:  echo /.whl/ >> .git/info/exclude
#                python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                    --implementation cp --platform manylinux2014_x86_64 -d .whl beartype
#   device run:  command "bash tools/gpu_session.sh", carry [".whl"], timeout_s 590
#
# The GPU image has torch, jaxtyping, hypothesis, tqdm, pytest and matplotlib but not
# beartype, hence the wheel. attnref itself runs from src/ (nothing to install).
#
# The phases, and the most each may take (at most about 560 s in all):
#   0. the sandbox on this machine (100 s at most): tools/sandbox_probe.py initialises
#      the GPU and compiles FlexAttention in sandboxed interpreters, with each part of
#      the sandbox switched off in turn where the whole one fails; the rest of the
#      session runs with ATTNREF_NO_SANDBOX set to the parts it names, and the log says
#      so: a finding for attnref._sandbox, not a reason to lose the session.
#   1. everything whose verdict does not depend on time, at once (200 s): every backend's
#      audit (tools/gpu_audit.py --jobs), a backend that works on a side stream and one
#      that tries every escape (both must fail), torch's own context parallelism, and the
#      sandbox's tests;
#   2. the sweep against torch's SDPA kernels (150 s), alone on the machine;
#   3. decode tokens/s against cache length and page size (flash-kvcache; 40 s);
#   4. the bench's games on a GPU: a backend that rewrites its worker's clock and one
#      wrong on one call in ten, beside torch's SDPA (40 s): both must be flagged.
#
# Everything comes back as one archive, $OUT/gpu-results.tgz (the tool returns at most 8
# files), plus the two summary tables and the log; unpack the archive into docs/ and
# commit.
#
# Dry run on a CPU (the tests do this):
#   DEVICE=cpu AUDIT_ARGS="--backend torch-sdpa-math --property forward" \
#   BENCH_ARGS="--tiny --backend reference" SERVING_ARGS="--seq 8 --batch 2 --heads 2" \
#   GAMES_ARGS="--seq 16 --batch 1 --heads 2" SKIP="smoke sandbox-tests" \
#   OUT=/tmp/x bash tools/gpu_session.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}  # on the GPU image, python3 is the one with torch
if ! "$PY" -c "import beartype" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-session}
DEVICE=${DEVICE:-cuda}
SKIP=${SKIP:-}
work=$(mktemp -d)
mkdir -p "$OUT" "$work/logs"
t0=$(date +%s)
stamp() { echo "== $1 at $(($(date +%s) - t0)) s"; }
{
    stamp "start"
    "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
    uname -r; nproc
    "$PY" -c 'from attnref._sandbox import landlock_abi; print("Landlock ABI:", landlock_abi())' 2>&1 | tail -1
    ls -la /dev/nvidia* /dev/shm 2>&1 | head -12

    # 0. the sandbox on this machine: which parts the driver and the compilers put up with
    stamp "phase 0: the sandbox"
    if [[ " $SKIP " == *" smoke "* ]]; then
        echo "skipped"
    else
        parts=$(timeout 100 "$PY" tools/sandbox_probe.py --device "$DEVICE" --flex --timeout 80)
        echo "sandbox probe exit: $?"
        if [ -n "$parts" ]; then
            export ATTNREF_NO_SANDBOX=$parts
            echo "SANDBOX: ATTNREF_NO_SANDBOX=$parts for the rest of this session"
        fi
    fi

    # 1. the verdicts, at once
    stamp "phase 1: audits"
    # shellcheck disable=SC2086
    timeout 200 "$PY" tools/gpu_audit.py --device "$DEVICE" --out "$work/gpu-audit" \
        --jobs 16 --deadline 140 --timeout 90 ${AUDIT_ARGS:-} >"$work/logs/gpu-audit.log" 2>&1 &
    p_audit=$!
    # a backend that works on a side stream (class 31): the audit must fail it (exit 1)
    timeout 120 "$PY" -m attnref audit --backend tests.hostile:side_stream --device "$DEVICE" \
        --dtype float32 --property forward --property settled_output --no-progress \
        >"$work/logs/side-stream.log" 2>&1 &
    p_side=$!
    # a backend that tries every escape (issue 29): confined, and failed (exit 1)
    timeout 120 "$PY" -m attnref audit --backend tests.hostile.escapes:everything \
        --device "$DEVICE" --dtype float32 --property forward --no-progress \
        --json "$work/escapes.json" >"$work/logs/escapes.log" 2>&1 &
    p_escape=$!
    # torch's own context parallelism (its ring, through DTensor) on one NCCL rank: one
    # GPU cannot hold a group of several (NCCL refuses two ranks on one device)
    timeout 120 "$PY" -m attnref audit --api context-parallel --world-size 1 \
        --backend torch-context-parallel --device "$DEVICE" --dtype bfloat16 \
        --property forward --property cp_agreement --no-progress --verbose \
        >"$work/logs/context-parallel.log" 2>&1 &
    p_cp=$!
    p_tests=""
    if [[ " $SKIP " != *" sandbox-tests "* ]]; then
        timeout 150 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m "" \
            tests/test_sandbox.py >"$work/logs/sandbox-tests.log" 2>&1 &
        p_tests=$!
    fi
    wait $p_audit; echo "gpu_audit exit: $?"
    cat "$work/gpu-audit/README.md" 2>/dev/null
    wait $p_side; echo "side-stream audit exit: $? (1 expected)"
    tail -3 "$work/logs/side-stream.log"
    wait $p_escape; echo "escapes audit exit: $? (1 expected)"
    head -2 "$work/logs/escapes.log"; tail -3 "$work/logs/escapes.log"
    wait $p_cp; echo "torch context_parallel audit exit: $?"
    tail -5 "$work/logs/context-parallel.log"
    if [ -n "$p_tests" ]; then
        wait $p_tests; echo "sandbox tests exit: $?"
        tail -15 "$work/logs/sandbox-tests.log"
    fi

    # 2. the sweep, alone
    stamp "phase 2: the sweep"
    # shellcheck disable=SC2086
    timeout 150 "$PY" tools/gpu_bench.py --device "$DEVICE" --out "$work/gpu-bench" \
        --budget-s 110 ${BENCH_ARGS:---seq 1024 4096 16384 --dtype bfloat16 --head-dim 128}
    echo "gpu_bench exit: $?"

    # 3. decode tokens/s against cache length and page size (flash-kvcache)
    stamp "phase 3: serving"
    # shellcheck disable=SC2086
    timeout 40 "$PY" -m attnref.bench --api flash-kvcache --device "$DEVICE" --no-progress \
        --out "$work/gpu-serving" ${SERVING_ARGS:---seq 1024 8192 --page-size 0 256 \
        --batch 32 --heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 --runs 10}
    echo "serving bench exit: $?"
    # MLA decode (DeepSeek's 576/512 latent rows, 128 heads): GB/s of cache read
    # shellcheck disable=SC2086
    timeout 40 "$PY" -m attnref.bench --api mla --device "$DEVICE" --no-progress \
        --out "$work/gpu-mla" ${MLA_ARGS:---seq 1024 8192 --page-size 64 --batch 32 \
        --heads 128 --head-dim 576 --dtype bfloat16 --runs 10}
    echo "mla bench exit: $?"

    # 4. the bench's games, on a GPU: both must be flagged, torch's SDPA ok
    stamp "phase 4: the bench's games"
    # shellcheck disable=SC2086
    timeout 40 "$PY" -m attnref.bench --device "$DEVICE" --no-progress --no-plot \
        --out "$work/gpu-games" --backends torch-sdpa \
        tests.hostile.bench_games:rewrites_timing tests.hostile.bench_games:wrong_one_in_ten \
        ${GAMES_ARGS:---seq 4096 --batch 4 --heads 16 --head-dim 128 --dtype bfloat16}
    echo "bench games exit: $?"
    stamp "end"
} 2>&1 | tee "$OUT/session.log"
cp "$OUT/session.log" "$work/logs/"
tar -czf "$OUT/gpu-results.tgz" -C "$work" .
cp "$work/gpu-audit/README.md" "$OUT/gpu-audit.md" 2>/dev/null
cp "$work/gpu-bench/README.md" "$OUT/gpu-bench.md" 2>/dev/null
cp "$work/gpu-serving/serving.csv" "$OUT/gpu-serving.csv" 2>/dev/null
cp "$work/gpu-mla/serving.csv" "$OUT/gpu-mla.csv" 2>/dev/null
echo "results: $OUT/gpu-results.tgz"
