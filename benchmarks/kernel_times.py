"""Per-kernel GPU time of fastmm.matmul and torch.matmul, from the profiler's activity trace
(CUPTI timestamps: no cache flush, no clock control, the kernels back to back as in a real run).

    python benchmarks/kernel_times.py [M N K ...] [--calls N] [--tf32]

For each problem and library: every kernel of one call with its median duration over the calls,
the median gap between the end of one kernel of the call and the start of the next, and the
median span of a whole call (first kernel's start to last kernel's end). Calls are queued behind
a sleep kernel, so the host's launch time does not show up as gaps.
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
import fastmm  # noqa: E402


def trace(fn, calls):
    """Kernel events (name, start us, duration us) of ``calls`` calls of fn, in start order."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        torch.cuda._sleep(50_000_000)
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
           and "Memset" not in e.name and "Memcpy" not in e.name]
    evs.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.start, e.time_range.end - e.time_range.start) for e in evs[1:]]  # [0]: the sleep


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def report(label, evs, calls):
    per = len(evs) // calls
    if per * calls != len(evs) or per == 0:
        print(f"  {label}: {len(evs)} kernels over {calls} calls (not a whole number per call)")
        return
    groups = [evs[i * per:(i + 1) * per] for i in range(calls)]
    spans = [g[-1][1] + g[-1][2] - g[0][1] for g in groups]
    print(f"  {label}: span per call {med(spans):.2f} us ({per} kernel{'s' if per > 1 else ''})")
    for j in range(per):
        name = groups[0][j][0]
        print(f"    {med([g[j][2] for g in groups]):8.2f} us  {name[:110]}")
        if j + 1 < per:
            print(f"    {med([g[j + 1][1] - (g[j][1] + g[j][2]) for g in groups]):8.2f} us  gap")
    between = [groups[i + 1][0][1] - (groups[i][-1][1] + groups[i][-1][2]) for i in range(calls - 1)]
    print(f"    {med(between):8.2f} us  gap to the next call")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dims", nargs="*", type=int)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--tf32", action="store_true")
    o = ap.parse_args()
    dims = o.dims or [256, 256, 65536, 16, 4096, 4096]
    torch.backends.cuda.matmul.allow_tf32 = o.tf32
    prec = "tf32" if o.tf32 else "ieee"
    for i in range(0, len(dims) - 2, 3):
        M, N, K = dims[i:i + 3]
        a, b = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
        c = torch.empty(M, N, device="cuda")
        print(f"\n{M}x{N}x{K} ({prec})")
        for label, fn in (("fastmm", lambda: fastmm.matmul(a, b, out=c, precision=prec)),
                          ("torch", lambda: torch.matmul(a, b, out=c))):
            report(label, trace(fn, o.calls), o.calls)


if __name__ == "__main__":
    main()
