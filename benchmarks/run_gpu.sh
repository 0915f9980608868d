#!/usr/bin/env bash
# The one script to run on the GPU machine, from the repo root, in one call:
#   bash benchmarks/run_gpu.sh                      # logs and JSON under $OUT (default /tmp)
#   BENCH_ARGS="--only square4k,unaligned" bash benchmarks/run_gpu.sh
#   STEPS="tests,bench" MODELS_ARGS="--models llama" bash benchmarks/run_gpu.sh
# 1. versions (GPU, driver, torch, cuda.core, cuda.bindings, NVRTC)
# 2. tests: the test suite, GPU tests included (junit XML + log)
# 3. selfcheck: python -m fastmm, the self-check of every kernel path
# 4. bench: the benchmark suite vs torch.matmul (JSON)
# 5. accuracy: accuracy against float64 as K grows
# 6. models: real models on fastmm vs torch (benchmarks/models.py; needs transformers, else skipped)
# 7. soak: SOAK_MINUTES of mixed calls (benchmarks/soak.py; only when SOAK_MINUTES is set)
# 8. nvrtc: the benchmark again under another NVRTC 13.x (only when NVRTC_WHEEL names a carried
#    nvidia-cuda-nvrtc wheel, e.g. torch 2.15's 13.2.86): the wheel is installed over the
#    machine's NVRTC (a device machine is discarded after the session; run it last), fastmm's
#    kernels recompile (its disk cache keys on the NVRTC version), both tables are printed.
#    NVRTC_BENCH_ARGS (default "--section model --precisions ieee,tf32,tf32x3") picks the rows.
# STEPS (comma list, default all of 2-6, plus soak when SOAK_MINUTES is set, plus nvrtc when
# NVRTC_WHEEL is set) picks steps; the
# tables of bench and models are printed last. Runs every step even when an earlier one fails;
# exits non-zero if any step failed.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The GPU machine has no package registry: tell pip at once instead of letting it wait on the
# network (tests that need to fetch a build backend then skip, saying so).
export PIP_NO_INDEX=${PIP_NO_INDEX:-1}
OUT=${OUT:-/tmp}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
failed=()
start=$SECONDS
STEPS=${STEPS:-tests,selfcheck,bench,accuracy,models${SOAK_MINUTES:+,soak}${NVRTC_WHEEL:+,nvrtc}}
want() { [[ ",$STEPS," == *",$1,"* ]]; }

step() { echo; echo "=================== $* ($((SECONDS - start)) s)"; }

step "versions"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "nvidia-smi failed"
"$PY" - <<'PY' 2>&1 | tee "$OUT/versions.txt"
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| torch CUDA", torch.version.cuda)
for mod in ("cuda.core", "cuda.bindings"):
    try:
        print(mod, __import__(mod, fromlist=["__version__"]).__version__)
    except Exception as exc:
        print(mod, "unavailable:", exc)
try:
    from cuda.bindings import nvrtc
    err, major, minor = nvrtc.nvrtcVersion()
    print("NVRTC", f"{major}.{minor}")
except Exception as exc:
    print("NVRTC unavailable:", exc)
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i}", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs")
else:
    print("torch sees no CUDA device")
PY
git log -1 --format='commit %h %s' 2>/dev/null || true
git status --short 2>/dev/null | head -20 || true

# PYTEST_ARGS: e.g. "tests --ignore=tests/test_compile.py --ignore=tests/test_packaging.py" (the
# CPU-side compile and packaging tests take minutes and need no GPU)
if want soak; then  # in the background: the tests run beside it (a soak under load); timed steps wait
    step "soak: $PY benchmarks/soak.py --minutes $SOAK_MINUTES (background)"
    "$PY" benchmarks/soak.py --minutes "$SOAK_MINUTES" --json "$OUT/soak.json" > "$OUT/soak.log" 2>&1 &
    soak_pid=$!
fi
wait_soak() {
    if [ -n "${soak_pid:-}" ]; then
        wait "$soak_pid"; rc=$?; soak_pid=
        tail -25 "$OUT/soak.log"
        [ "$rc" -eq 0 ] || failed+=("benchmarks/soak.py (exit $rc)")
    fi
}

if want tests; then
    step "tests: $PY -m pytest ${PYTEST_ARGS:-tests} -q -rfEs"
    # shellcheck disable=SC2086
    "$PY" -m pytest ${PYTEST_ARGS:-tests} -q -rfEs -p no:cacheprovider --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log"
    rc=$?; [ "$rc" -eq 0 ] || failed+=("pytest (exit $rc)")
fi

if want selfcheck; then
    step "self-check: $PY -m fastmm"
    "$PY" -m fastmm 2>&1 | tee "$OUT/selfcheck.log"
    rc=$?; [ "$rc" -eq 0 ] || failed+=("python -m fastmm (exit $rc)")
fi

wait_soak  # before anything timed

if want bench; then
    step "benchmark: $PY benchmarks/bench.py --json $OUT/bench.json ${BENCH_ARGS:-}"
    # shellcheck disable=SC2086
    "$PY" benchmarks/bench.py --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
    rc=$?; [ "$rc" -eq 0 ] || failed+=("benchmarks/bench.py (exit $rc)")
fi

if want accuracy; then
    step "accuracy against float64 as K grows: $PY benchmarks/accuracy_vs_k.py"
    "$PY" benchmarks/accuracy_vs_k.py 2>&1 | tee "$OUT/accuracy.md"
    rc=$?; [ "$rc" -eq 0 ] || failed+=("benchmarks/accuracy_vs_k.py (exit $rc)")
fi

if want models; then
    if "$PY" -c "import transformers" 2>/dev/null; then
        step "models: $PY benchmarks/models.py --json $OUT/models.json ${MODELS_ARGS:-}"
        # shellcheck disable=SC2086
        "$PY" benchmarks/models.py --json "$OUT/models.json" ${MODELS_ARGS:-} 2>&1 | tee "$OUT/models.log"
        rc=$?; [ "$rc" -eq 0 ] || failed+=("benchmarks/models.py (exit $rc)")
    else
        step "models: skipped (transformers is not installed: pip install 'fastmm[models]', or a wheelhouse)"
    fi
fi

nvrtc_of() {
    "$PY" -c "from cuda.bindings import nvrtc; e, a, b = nvrtc.nvrtcVersion(); print(f'{a}.{b}')"
}
if want nvrtc; then
    if [ -z "${NVRTC_WHEEL:-}" ] || [ ! -f "${NVRTC_WHEEL:-}" ]; then
        step "nvrtc: skipped (NVRTC_WHEEL must name a carried nvidia-cuda-nvrtc wheel)"
        failed+=("nvrtc (no NVRTC_WHEEL)")
    else
        args=${NVRTC_BENCH_ARGS:---section model --precisions ieee,tf32,tf32x3}
        before=$(nvrtc_of)
        step "nvrtc: $PY benchmarks/bench.py $args under NVRTC $before, then under $NVRTC_WHEEL"
        # shellcheck disable=SC2086
        "$PY" benchmarks/bench.py --json "$OUT/bench_nvrtc_$before.json" $args > "$OUT/bench_nvrtc_$before.log" 2>&1
        rc=$?; [ "$rc" -eq 0 ] || failed+=("bench.py under NVRTC $before (exit $rc)")
        "$PY" -m pip install --quiet --no-deps --no-index --force-reinstall "$NVRTC_WHEEL"
        after=$(nvrtc_of)
        if [ "$after" = "$before" ]; then
            failed+=("nvrtc (still $before after installing $NVRTC_WHEEL)")
        else
            # shellcheck disable=SC2086
            "$PY" benchmarks/bench.py --json "$OUT/bench_nvrtc_$after.json" $args > "$OUT/bench_nvrtc_$after.log" 2>&1
            rc=$?; [ "$rc" -eq 0 ] || failed+=("bench.py under NVRTC $after (exit $rc)")
        fi
    fi
fi

step "summary"
grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/pytest.log" 2>/dev/null | tail -25 || true
grep -E "^  FAIL|self-check (passed|FAILED)" "$OUT/selfcheck.log" 2>/dev/null || true
if want bench && [ -f "$OUT/bench.json" ]; then
    echo
    "$PY" benchmarks/bench.py --table-from "$OUT/bench.json"
fi
if want nvrtc; then
    for f in "$OUT"/bench_nvrtc_*.json; do
        [ -f "$f" ] || continue
        echo; echo "NVRTC ${f##*bench_nvrtc_}:" | sed 's/\.json:$/:/'
        "$PY" benchmarks/bench.py --table-from "$f"
    done
fi
if want models && [ -f "$OUT/models.log" ]; then
    echo
    sed -n '/^model | prec/,$p' "$OUT/models.log"
fi
echo
echo "logs: $OUT/versions.txt $OUT/pytest.log $OUT/junit.xml $OUT/selfcheck.log $OUT/bench.log $OUT/bench.json $OUT/accuracy.md"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED steps: ${failed[*]} (total $((SECONDS - start)) s)"
    exit 1
fi
echo "all steps passed (total $((SECONDS - start)) s)"
