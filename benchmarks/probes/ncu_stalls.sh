#!/usr/bin/env bash
# Where a kernel's cycles go: launch shape, issue rate and the stall reasons per issued
# instruction, for fastmm's kernel and torch's (cuBLAS) on the same problem, one launch each.
#   bash benchmarks/probes/ncu_stalls.sh M N K [precision] [family] [profile_one.py options...]
# (e.g. --b-t --option 2,2,8,0 --macro FMA_ZIGZAG=0: see profile_one.py; torch's side takes --b-t)
# Needs ncu with hardware counters (Firecracker machines; H200.md). Clocks are left alone;
# caches are flushed before each profiled launch unless NCU_CACHE=none (then L2 is as the
# launches ahead left it: warm, as in back-to-back calls).
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
if [ $# -lt 3 ]; then echo "usage: bash benchmarks/probes/ncu_stalls.sh M N K [precision] [family]" >&2; exit 2; fi
M=$1 N=$2 K=$3 PREC=${4:-ieee} FAM=${5:-}
[ "$FAM" = "-" ] && FAM=""  # (a placeholder, to pass profile_one.py options with no family)
shift $(( $# < 5 ? $# : 5 ))
BT=0; for x in "$@"; do [ "$x" = "--b-t" ] && BT=1; done
METRICS="launch__registers_per_thread,launch__block_size,launch__grid_size,launch__shared_mem_per_block_dynamic,launch__shared_mem_per_block_static,launch__occupancy_limit_registers,sm__warps_active.avg.per_cycle_active,smsp__issue_active.avg.per_cycle_active,smsp__inst_executed.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_fmaheavy.sum,smsp__inst_executed_pipe_lsu.sum,sm__inst_executed_pipe_tensor_op_hmma.sum,gpu__time_duration.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
NCU="ncu --clock-control none --cache-control ${NCU_CACHE:-all} --metrics $METRICS --launch-skip 2 --launch-count 1"
echo "== fastmm $M x $N x $K $PREC ${FAM:-planner choice}"
$NCU -k regex:fastmm "$PY" "$HERE/profile_one.py" "$M" "$N" "$K" "$PREC" $FAM "$@" 2>&1 | grep -v "^==PROF==" | grep -E "fastmm_|launch__|sm__|smsp__|gpu__" | grep -vE " 0(\.00)?\$"
[ -n "${SKIP_TORCH:-}" ] && exit 0  # (SKIP_TORCH=1: fastmm's kernel only)
echo "== torch.matmul"
$NCU -k regex:'gemm|GEMM|cutlass|xmma' "$PY" - "$M" "$N" "$K" "$PREC" "$BT" <<'PY' 2>&1 | grep -v "^==PROF==" | grep -E "gemm|GEMM|cutlass|xmma|launch__|sm__|smsp__|gpu__" | grep -vE " 0(\.00)?\$"
import sys, torch
M, N, K = (int(x) for x in sys.argv[1:4])
torch.backends.cuda.matmul.allow_tf32 = sys.argv[4] == "tf32"
a = torch.randn(M, K, device="cuda")
b = torch.randn(N, K, device="cuda").t() if sys.argv[5] == "1" else torch.randn(K, N, device="cuda")
for _ in range(5):
    c = a @ b
torch.cuda.synchronize()
PY
