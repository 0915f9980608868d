"""Per-kernel GPU time of fastmm.matmul and torch.matmul, from the profiler's activity trace
(CUPTI timestamps: no cache flush, no clock control, the kernels back to back as in a real run),
and the wall time per eager call beside it:

    python benchmarks/probes/kernel_times.py [M N K ...] [--calls N] [--precision ieee|tf32|tf32x3] [--batch B]
        [--a-transposed] [--b-transposed]

For each problem and library: every kernel of one call with its median duration over the calls,
the median gap between the end of one kernel of the call and the start of the next, the median
span of a whole call (first kernel's start to last kernel's end), and the wall-clock time per
call of back-to-back eager calls (synchronized at the end). Calls are queued behind a sleep
kernel for the trace, so the host's launch time does not show up as gaps; a wall time well above
the span means the call is host-bound. torch runs at the precision fastmm is asked for (TF32
only for tf32; tf32x3 against torch's fp32), as in bench.py.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import fastmm  # noqa: E402
from probe_util import need_gpu  # noqa: E402


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


def wall_us(fn, calls):
    """Wall-clock us per call of ``calls`` back-to-back calls, synchronized before and after."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def report(label, evs, calls, wall):
    per = len(evs) // calls
    if per * calls != len(evs) or per == 0:
        print(f"  {label}: {len(evs)} kernels over {calls} calls (not a whole number per call); "
              f"wall {wall:.2f} us per call")
        return
    groups = [evs[i * per:(i + 1) * per] for i in range(calls)]
    spans = [g[-1][1] + g[-1][2] - g[0][1] for g in groups]
    print(f"  {label}: span per call {med(spans):.2f} us ({per} kernel{'s' if per > 1 else ''}); "
          f"wall {wall:.2f} us per eager call")
    for j in range(per):
        name = groups[0][j][0]
        print(f"    {med([g[j][2] for g in groups]):8.2f} us  {name[:110]}")
        if j + 1 < per:
            print(f"    {med([g[j + 1][1] - (g[j][1] + g[j][2]) for g in groups]):8.2f} us  gap")
    between = [groups[i + 1][0][1] - (groups[i][-1][1] + groups[i][-1][2]) for i in range(calls - 1)]
    print(f"    {med(between):8.2f} us  gap to the next call")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kernel_times.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("dims", nargs="*", type=int, help="M N K triples (default: 256 256 65536  16 4096 4096)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--precision", choices=fastmm.PRECISIONS, default="ieee")
    ap.add_argument("--tf32", action="store_true", help="same as --precision tf32")
    ap.add_argument("--batch", type=int, default=0, help="a batch dim of this size on both operands")
    ap.add_argument("--b-transposed", action="store_true",
                    help="B as nn.Linear reads its weight: W.t() of a row-major W of shape (N, K)")
    ap.add_argument("--a-transposed", action="store_true",
                    help="A as a weight gradient reads g: g.t() of a row-major g of shape (K, M)")
    o = ap.parse_args(argv)
    dims = o.dims or [256, 256, 65536, 16, 4096, 4096]
    if len(dims) % 3:
        ap.error("dims come in M N K triples")
    if not need_gpu(ap.prog):
        return 2
    prec = "tf32" if o.tf32 else o.precision
    torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
    batch = (o.batch,) if o.batch else ()
    for i in range(0, len(dims), 3):
        M, N, K = dims[i:i + 3]
        a = (torch.randn(*batch, K, M, device="cuda").transpose(-1, -2) if o.a_transposed
             else torch.randn(*batch, M, K, device="cuda"))
        b = (torch.randn(*batch, N, K, device="cuda").transpose(-1, -2) if o.b_transposed
             else torch.randn(*batch, K, N, device="cuda"))
        c = torch.empty(*batch, M, N, device="cuda")
        print(f"\n{'x'.join(map(str, batch + (M, N, K)))}{' A^T' if o.a_transposed else ''}{' W^T' if o.b_transposed else ''} ({prec}): fastmm runs "
              f"{fastmm.explain(a, b, precision=prec, out=c).kernel or 'torch.matmul'}")
        for label, fn in (("fastmm", lambda: fastmm.matmul(a, b, out=c, precision=prec)),
                          ("torch", lambda: torch.matmul(a, b, out=c))):
            report(label, trace(fn, o.calls), o.calls, wall_us(fn, max(o.calls, 50)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
