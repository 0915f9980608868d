#!/usr/bin/env bash
# Where a memory-heavy problem's time goes: per kernel launch of one fastmm call (the GEMM and
# any second pass), its duration, DRAM and L2 traffic, SM clock, issue rate and top stalls.
#   bash benchmarks/probes/ncu_memory.sh M N K [precision] [family] [launches per call]
# (launches per call: 2, the default, for a GEMM with a second pass (split-K, stream-K); 1 for
# one launch, a fused split included: explain says which)
# Needs ncu with hardware counters (Firecracker machines; H200.md). Clocks are left alone.
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
if [ $# -lt 3 ]; then echo "usage: bash benchmarks/probes/ncu_memory.sh M N K [precision] [family] [launches per call]" >&2; exit 2; fi
M=$1 N=$2 K=$3 PREC=${4:-ieee} FAM=${5:-} PER=${6:-2}
METRICS="gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,sm__cycles_elapsed.avg.per_second,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,smsp__issue_active.avg.per_cycle_active,smsp__inst_executed.sum,smsp__inst_executed_pipe_fma.sum,sm__warps_active.avg.per_cycle_active,regex:smsp__average_warps_issue_stalled_(long_scoreboard|short_scoreboard|barrier|wait|mio_throttle|lg_throttle|math_pipe_throttle|not_selected|selected|dispatch_stall|no_instruction|membar|drain|sleeping|branch_resolving|tex_throttle)_per_issue_active\.ratio"
echo "== fastmm $M x $N x $K $PREC ${FAM:-planner choice}: launches of call 2"
ncu --clock-control none --metrics "$METRICS" --launch-skip "$PER" --launch-count "$PER" -k regex:fastmm \
    "$PY" "$HERE/profile_one.py" "$M" "$N" "$K" "$PREC" $FAM 2>&1 | grep -v "^==PROF==" \
    | grep -E "fastmm_|launch__|sm__|smsp__|gpu__|dram__|lts__|rel err" | grep -vE " 0(\.00)?\$"
