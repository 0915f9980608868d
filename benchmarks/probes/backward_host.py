#!/usr/bin/env python3
"""Where a Linear layer's forward + backward spends its host time, fastmm against torch: the
whole step, then the backward's pieces called directly (the two products, the bias sum, the
views), microseconds per call with the GPU kept busy (probe_util.enqueue_us).

    python benchmarks/probes/backward_host.py [--precisions ieee,tf32] [--calls 100]

The layer is models.py's host-table one: x [4, 256, 1024] @ W^T, W [2816, 1024], with a bias.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

import fastmm  # noqa: E402
from fastmm import ops  # noqa: E402
from fastmm.precision import torch_precision  # noqa: E402
from probe_util import enqueue_us, need_gpu  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="backward_host.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--precisions", default="ieee,tf32")
    ap.add_argument("--calls", type=int, default=100)
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    torch.manual_seed(0)
    ref = torch.nn.Linear(1024, 2816, device="cuda")
    fm = fastmm.nn.Linear.from_linear(ref)
    x = torch.randn(4, 256, 1024, device="cuda", requires_grad=True)
    g = torch.randn(4, 256, 2816, device="cuda")
    w = ref.weight.detach()
    g2, x2 = g.reshape(-1, 2816), x.detach().reshape(-1, 1024)
    n = o.calls
    for precision in o.precisions.split(","):
        fm.precision = precision
        mm = ops._EAGER_MM[precision]
        params_t, params_f = [x, ref.weight, ref.bias], [x, fm.weight, fm.bias]
        rows = [
            ("forward + backward (.backward)", lambda: ref(x).backward(g), lambda: fm(x).backward(g)),
            ("forward + autograd.grad", lambda: torch.autograd.grad(ref(x), params_t, g),
             lambda: torch.autograd.grad(fm(x), params_f, g)),
            ("forward with grad", lambda: ref(x), lambda: fm(x)),
            ("backward body (linear_grads)", None,
             lambda: ops.linear_grads(mm, x.detach(), w, g, True, True, True)),
            ("grad_x = g @ W", lambda: torch.matmul(g, w), lambda: mm(g, w)),
            ("grad_W = g2^T @ x2", lambda: torch.matmul(g2.t(), x2), lambda: mm(g2.t(), x2)),
            ("grad_b = g2.sum(0)", lambda: g2.sum(0), None),
            ("views (reshape x2, t)", lambda: (g.reshape(-1, 2816).transpose(0, 1), x.reshape(-1, 1024)), None),
        ]
        with torch_precision(precision):
            print(f"{precision}: us per call (host, GPU kept busy)        torch   fastmm")
            for name, t_fn, f_fn in rows:
                t = f"{enqueue_us(t_fn, n):7.1f}" if t_fn else "      -"
                f = f"{enqueue_us(f_fn, n):7.1f}" if f_fn else "      -"
                print(f"  {name:<44} {t} {f}")
            if fastmm.explain(g2.t(), x2, precision=precision).plan.staging:
                print("  (grad_W stages an operand: " + str(fastmm.explain(g2.t(), x2, precision=precision).kernel) + ")")
        x.grad = None
    engine_overhead(n)
    return 0


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def engine_overhead(n: int) -> None:
    """What the autograd engine costs around a Python Function's backward on this host: a
    backward through an identity Function against one through a C++ node (x * 1), and the time
    fastmm's Linear backward spends in its own Python body when the engine calls it."""
    import time

    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    g = torch.randn(1024, 1024, device="cuda")
    print("autograd engine, us per call                        C++ node  Python Function")
    t = enqueue_us(lambda: torch.autograd.grad(x.view_as(x), x, g), n)
    f = enqueue_us(lambda: torch.autograd.grad(_Identity.apply(x), x, g), n)
    print(f"  grad of a view (nothing computed)                 {t:7.1f}  {f:7.1f}")
    fm = fastmm.nn.Linear(1024, 2816, device="cuda", precision="tf32")
    xi = torch.randn(4, 256, 1024, device="cuda", requires_grad=True)
    gi = torch.randn(4, 256, 2816, device="cuda")
    inner = []
    real = ops._Linear.backward

    def timed(ctx, grad):
        t0 = time.perf_counter()
        out = real(ctx, grad)
        inner.append(time.perf_counter() - t0)
        return out
    ops._Linear.backward = staticmethod(timed)
    try:
        whole = enqueue_us(lambda: torch.autograd.grad(fm(xi), [xi, fm.weight, fm.bias], gi), n)
        fwd = enqueue_us(lambda: fm(xi), n)
    finally:
        ops._Linear.backward = staticmethod(real)
    body = 1e6 * sorted(inner)[len(inner) // 2]
    print(f"  fastmm Linear tf32: forward + grad {whole:.1f}, forward {fwd:.1f}, "
          f"backward body inside the engine {body:.1f} (median), the rest {whole - fwd - body:.1f}")
    profile_backward(fm, xi, gi)


def profile_backward(fm, xi, gi, calls: int = 100) -> None:
    """cProfile of fastmm's Linear backward body, run by the engine (its device thread) and
    called directly on the main thread: where the engine-thread run spends its extra time. Each
    side stays under ~600 launches behind its sleep kernel: past the ~1000 launches a stream
    queues, a launch waits for the GPU, which a first version of this probe took for host cost."""
    import cProfile
    import io
    import pstats

    real = ops._Linear.backward
    for where in ("engine thread", "main thread"):
        prof = cProfile.Profile()
        if where == "engine thread":
            def profiled(ctx, grad):
                prof.enable()
                try:
                    return real(ctx, grad)
                finally:
                    prof.disable()
            ops._Linear.backward = staticmethod(profiled)
            try:
                torch.cuda._sleep(400_000_000)
                for _ in range(calls):
                    torch.autograd.grad(fm(xi), [xi, fm.weight, fm.bias], gi)
            finally:
                ops._Linear.backward = staticmethod(real)
        else:
            mm = ops._EAGER_MM["tf32"]
            w, x = fm.weight.detach(), xi.detach()
            torch.cuda._sleep(400_000_000)
            prof.enable()
            for _ in range(calls):
                ops.linear_grads(mm, x, w, gi, True, True, True)
            prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
        print(f"--- backward body profiled on the {where} ({calls} calls)")
        print("\n".join(line[:150] for line in out.getvalue().splitlines()[:30]))


if __name__ == "__main__":
    raise SystemExit(main())
