"""GPU time (CUDA graphs of 10 calls, so no host time) of the wgmma TF32 forms next to torch:
B row-major (C^T = B^T A^T, B fed from registers) vs B K-major (both operands from shared
memory), for each tile option. `python benchmarks/wgmma_forms.py`; table printed last."""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
import fastmm  # noqa: E402
from fastmm import api  # noqa: E402
from fastmm.families import FAMILIES  # noqa: E402

WG = FAMILIES["wgmma_tf32"]
CALLS = 10


def graph_us(fn) -> float:
    """Median over 15 replays of a graph of CALLS calls, per call, in microseconds."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    for _ in range(2):
        g.replay()
    times = []
    for _ in range(15):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1000 / CALLS)
    return sorted(times)[len(times) // 2]


def main():
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    cases = [("batched 32x512^3", (32, 512, 512), (32, 512, 512)), ("1000^3", (1000, 1000), (1000, 1000)),
             ("2048^3", (2048, 2048), (2048, 2048)), ("decode128", (128, 4096), (4096, 11008)),
             ("leetgpu", (8192, 6144), (6144, 4096))]
    for name, sa, sb in cases:
        a, b = torch.randn(*sa, device="cuda"), torch.randn(*sb, device="cuda")
        bk = b.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, K-major
        flop = 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
        ref = torch.matmul(a.double(), b.double())
        t = graph_us(lambda: torch.matmul(a, b))
        rows.append((name, "torch tf32", t, flop / t / 1e6, ""))
        for opt in ((256, 4), (128, 6)):
            WG.tile_options = staticmethod(lambda x3, opt=opt: ((128, 3),) if x3 else (opt,))
            for form, bb in (("B row-major (swap)", b), ("B K-major", bk)):
                api.forget_plans()
                c = fastmm.matmul(a, bb, precision="tf32")
                err = ((c.double() - ref).norm() / ref.norm()).item()
                t = graph_us(lambda: fastmm.matmul(a, bb, precision="tf32"))
                rows.append((name, f"{form} BN{opt[0]} S{opt[1]} ({fastmm.explain(a, bb, precision='tf32').kernel})",
                             t, flop / t / 1e6, f"{err:.1e}"))
        vars(WG).pop("tile_options", None)  # the class's own again
        api.forget_plans()
    print(f"\n{'case':<18} {'variant':<52} {'us/call':>9} {'TFLOP/s':>8}  err")
    for r in rows:
        print(f"{r[0]:<18} {r[1]:<52} {r[2]:9.1f} {r[3]:8.1f}  {r[4]}")


if __name__ == "__main__":
    main()
