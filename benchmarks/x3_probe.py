"""tf32x3 on wgmma with staging: GPU time (CUDA graph of 10 calls) vs wall time per eager call,
next to torch fp32. `python benchmarks/x3_probe.py`."""
from __future__ import annotations

import sys
import time

import torch

sys.path.insert(0, ".")
import fastmm  # noqa: E402
from wgmma_forms import graph_us  # noqa: E402  (beside this script)


def wall_us(fn, n=50) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    for name, sa, sb in (("square1000", (1000, 1000), (1000, 1000)), ("batched", (32, 512, 512), (32, 512, 512)),
                         ("decode128", (128, 4096), (4096, 11008)), ("square4k", (4096, 4096), (4096, 4096))):
        a, b = torch.randn(*sa, device="cuda"), torch.randn(*sb, device="cuda")
        flop = 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
        for label, fn in (("fastmm tf32x3", lambda: fastmm.matmul(a, b, precision="tf32x3")),
                          ("torch fp32", lambda: torch.matmul(a, b))):
            g, w = graph_us(fn), wall_us(fn)
            print(f"{name:<11} {label:<14} GPU {g:8.1f} us ({flop / g / 1e6:6.1f} TF/s)  wall {w:8.1f} us "
                  f"({flop / w / 1e6:6.1f} TF/s)  {fastmm.explain(a, b, precision='tf32x3').kernel if 'fastmm' in label else ''}")


if __name__ == "__main__":
    main()
