#!/usr/bin/env bash
# Every fastmm kernel under compute-sanitizer: memcheck, racecheck, synccheck, initcheck.
#
#   bash benchmarks/sanitize.sh                    # all four tools; logs under $OUT (default /tmp)
#   bash benchmarks/sanitize.sh --quick            # the small shape set for every tool
#   TOOLS="memcheck racecheck" bash benchmarks/sanitize.sh
#
# The workload is benchmarks/sanitize.py (every family x precision over edge shapes, split-K
# included; see its docstring). Steps:
#   1. one plain run (no tool): compiles every kernel the run needs into the disk cache, so no
#      NVRTC time is spent under a tool, and shows the shapes are computed correctly;
#   2. each tool in turn, with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (the caching allocator hands out
#      slices of big blocks, which hides out-of-bounds accesses from memcheck) and
#      --error-exitcode 1; log in $OUT/sanitize-<tool>.log;
#   3. a table: tool, errors found, exit code, the driver's own verdict, seconds.
# Exits non-zero if any tool found an error, failed or timed out, or a result was wrong.
#
# Shape sets: memcheck and initcheck run the full set; racecheck and synccheck (which track every
# shared-memory access and barrier, 10-100x slower than memcheck) run --quick. Each tool gets at
# most its time limit (memcheck and initcheck 100 s, racecheck 70 s, synccheck 50 s; TOOL_TIMEOUT
# sets one limit for all), so the whole script stays within about 6 minutes on an H200; a tool
# that runs out of time shows "timeout" in the table (sanitize.py prints its progress every 50
# cases, so the log shows how far it got).
#
# Environment: TOOLS, OUT, PYTHON (default python3), COMPUTE_SANITIZER (path to the binary),
# TOOL_TIMEOUT, LEAK_CHECK (1/0), SANITIZER_ARGS (extra arguments for every tool), CASE_ARGS (extra
# arguments for sanitize.py, e.g. "--family wgmma_tf32" for one family's cases).
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
TOOLS=${TOOLS:-memcheck racecheck synccheck initcheck}
OUT=${OUT:-/tmp}
PY=${PYTHON:-python3}
TOOL_TIMEOUT=${TOOL_TIMEOUT:-}
# Leak check is off by default: on the H200 (2026-11-29) memcheck with --leak-check full reported
# only tensors still alive when the interpreter exited (Python does not free every object at exit)
# - none of them fastmm's: fastmm allocates no device memory of its own (split-K workspaces and
# staging buffers are torch tensors freed when the call returns). LEAK_CHECK=1 turns it on.
# API errors are not reported either: the same run showed 34 CUDA_ERROR_INVALID_VALUE returns of
# cuGetProcAddress, which is cuda-python and torch probing for optional driver entry points.
# What remains counted is what the kernels do: invalid accesses, races, barrier misuse, reads of
# uninitialised memory.
LEAK_CHECK=${LEAK_CHECK:-0}
QUICK_ALL=0
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK_ALL=1 ;;
        *) echo "unknown argument: $arg (usage: [TOOLS=...] bash benchmarks/sanitize.sh [--quick])" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"

SAN=${COMPUTE_SANITIZER:-}
if [ -z "$SAN" ]; then
    SAN=$(command -v compute-sanitizer 2>/dev/null || true)
fi
if [ -z "$SAN" ]; then
    for cand in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
                /usr/local/cuda-*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer/compute-sanitizer; do
        if [ -x "$cand" ]; then SAN=$cand; break; fi
    done
fi
if [ -z "$SAN" ] || [ ! -x "$SAN" ]; then
    echo "compute-sanitizer not found (not in PATH nor under /usr/local/cuda*); set COMPUTE_SANITIZER=/path/to/it" >&2
    exit 2
fi
echo "compute-sanitizer: $SAN ($("$SAN" --version 2>/dev/null | grep -i version | head -1))"

start=$SECONDS
echo
echo "=== warm-up: plain run, kernels compiled into the disk cache (${FASTMM_CACHE_DIR:-default cache folder})"
t0=$SECONDS
plain_args=()
[ "$QUICK_ALL" = 1 ] && plain_args=(--quick)
# shellcheck disable=SC2206
case_args=(${CASE_ARGS:-})
plain_args+=(${case_args[@]+"${case_args[@]}"})
"$PY" benchmarks/sanitize.py ${plain_args[@]+"${plain_args[@]}"} 2>&1 | tee "$OUT/sanitize-plain.log"
plain_rc=$?
plain_s=$((SECONDS - t0))
if [ "$plain_rc" -ne 0 ]; then
    echo "the plain run failed (exit $plain_rc): fix that first; the tools would only repeat it" >&2
fi

rows=()
failed=0
for tool in $TOOLS; do
    case "$tool" in
        memcheck) extra=(); [ "$LEAK_CHECK" = 1 ] && extra=(--leak-check full); quick=$QUICK_ALL; limit=100 ;;
        initcheck) extra=(); quick=$QUICK_ALL; limit=100 ;;
        racecheck) extra=(); quick=1; limit=70 ;;
        synccheck) extra=(); quick=1; limit=50 ;;
        *) echo "unknown tool $tool" >&2; exit 2 ;;
    esac
    limit=${TOOL_TIMEOUT:-$limit}
    args=(${case_args[@]+"${case_args[@]}"})
    [ "$quick" = 1 ] && args+=(--quick)
    log="$OUT/sanitize-$tool.log"
    echo
    echo "=== $tool (at most ${limit} s): $SAN --tool $tool --error-exitcode 1 ${extra[*]+${extra[*]}} ${SANITIZER_ARGS:-}" \
        "$PY benchmarks/sanitize.py ${args[*]+${args[*]}}"
    t0=$SECONDS
    # shellcheck disable=SC2086
    timeout --signal=INT --kill-after=15 "$limit" \
        "$SAN" --tool "$tool" --error-exitcode 1 --report-api-errors no ${extra[@]+"${extra[@]}"} ${SANITIZER_ARGS:-} \
        "$PY" benchmarks/sanitize.py ${args[@]+"${args[@]}"} >"$log" 2>&1
    rc=$?
    secs=$((SECONDS - t0))
    tail -n 5 "$log"
    # "========= ERROR SUMMARY: 3 errors" (racecheck adds a RACECHECK SUMMARY of hazards)
    errors=$(grep -Eo "ERROR SUMMARY: [0-9]+" "$log" | tail -1 | grep -Eo "[0-9]+$")
    # racecheck may print only "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
    [ -z "$errors" ] && errors=$(grep -Eo "RACECHECK SUMMARY: [0-9]+ hazards displayed \([0-9]+ errors" "$log" | tail -1 \
                                 | grep -Eo "[0-9]+ errors" | grep -Eo "[0-9]+")
    [ -z "$errors" ] && errors="?"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 130 ] || [ "$rc" -eq 137 ]; then
        errors="$errors (timeout)"
    fi
    kernels=$(grep -Eo "fastmm_[a-z0-9_]+" "$log" | sort -u | tr '\n' ' ')
    verdict=$(grep -E "^sanitize: " "$log" | tail -1 | sed -E 's/^sanitize: ([0-9]+ cases)[^:]*: ([0-9]+ correct, [0-9]+ WRONG).*/\1, \2/')
    [ -z "$verdict" ] && verdict="(no summary: the run did not finish)"
    rows+=("$(printf '%-10s %-16s %-5s %-44s %5ss' "$tool" "$errors" "$rc" "$verdict" "$secs")")
    if [ "$errors" != "0" ] && [ -n "$kernels" ]; then
        rows+=("$(printf '%-10s kernels named in the log: %s' "" "$kernels")")
    fi
    [ "$rc" -eq 0 ] && [ "$errors" = "0" ] || failed=1
done

echo
echo "=== compute-sanitizer summary (logs: $OUT/sanitize-<tool>.log; total $((SECONDS - start)) s)"
printf '%-10s %-16s %-5s %-44s %6s\n' "tool" "errors found" "exit" "driver (sanitize.py)" "time"
printf '%-10s %-16s %-5s %-44s %5ss\n' "(plain)" "-" "$plain_rc" \
    "$(grep -E '^sanitize: ' "$OUT/sanitize-plain.log" | tail -1 | sed -E 's/^sanitize: ([0-9]+ cases)[^:]*: ([0-9]+ correct, [0-9]+ WRONG).*/\1, \2/')" "$plain_s"
for row in "${rows[@]}"; do
    echo "$row"
done
if [ "$failed" -ne 0 ] || [ "$plain_rc" -ne 0 ]; then
    exit 1
fi
