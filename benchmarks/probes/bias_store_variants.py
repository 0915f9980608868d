#!/usr/bin/env python3
"""How the 128 x 256 SIMT tile should store a product with a bias over C's columns: the planned
kernel of x @ W + b (row-major W, 8192 rows) built several ways and timed back to back (GPU us,
probe_util.time_us), each checked against float64:

    python benchmarks/probes/bias_store_variants.py

- none: the same kernel without the epilogue (C = x @ W, float4 stores from the registers);
- staged none: that product stored through shared memory (C_STAGED; not timed in run 34: staged
  with a bias beat none at K = 4096, so it may pay without one too);
- form0: the epilogue in the float4 stores, D read per output (the kernel before NOTES run 34);
- staged+form0 / staged+form1: C through shared memory (C_STAGED), D read per output / each
  thread reading its column's bias once (EPILOGUE_FORM 1: the planner's choice since NOTES run 34).

(NOTES run 34 also timed a build that read the thread's 8 bias values before the float4 stores: slower
than form0, 4.8-5.8% over none; it is not in the source any more.)
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm.plan import select  # noqa: E402
from fastmm.problem import EPILOGUE_BIAS_N, Problem  # noqa: E402
from fastmm.runtime import launcher, runners  # noqa: E402
from fastmm.runtime.device import device_facts  # noqa: E402
from probe_util import need_gpu, time_us  # noqa: E402

#: name -> (macros added to the plan's, without EPILOGUE / EPILOGUE_FORM / C_STAGED; with a bias?)
VARIANTS = {"none": ((), False), "staged none": ((("C_STAGED", 1),), False),
            "form0": ((("EPILOGUE", 1),), True), "staged+form0": ((("EPILOGUE", 1), ("C_STAGED", 1)), True),
            "staged+form1": ((("EPILOGUE", 1), ("C_STAGED", 1), ("EPILOGUE_FORM", 1)), True)}
SHAPES = ((8192, 1024, 1024), (8192, 3072, 1024), (8192, 1024, 4096))


def main() -> int:
    if not need_gpu("bias_store_variants.py"):
        return 2
    dev = device_facts(0)
    stream = torch.cuda.current_stream().cuda_stream
    for M, N, K in SHAPES:
        a, b = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
        bias, c = torch.randn(N, device="cuda"), torch.empty(M, N, device="cuda")
        prod = a.double() @ b.double()
        p = Problem(M, N, K, (K, 1), (N, 1), (N, 1), precision="ieee", epilogue=EPILOGUE_BIAS_N)
        base = select(p, dev).kernel
        assert base.stream_k is None and base.split_k == 1, base.describe()  # (one plain launch)
        plain = tuple(m for m in base.macros if m[0] not in ("EPILOGUE", "EPILOGUE_FORM", "C_STAGED"))
        line = [f"{M}x{N}x{K}"]
        for name, (extra, biased) in VARIANTS.items():
            loaded = launcher.load(dev, dataclasses.replace(base, macros=plain + extra))
            args = (a.data_ptr(), b.data_ptr(), c.data_ptr()) + runners.gemm_args(p)
            if biased:  # D = bias over the columns (strides 0, 1), alpha = beta = 1
                args += (bias.data_ptr(), 0, 1, runners.float_bits(1.0), runners.float_bits(1.0))

            def fn(loaded=loaded, args=args):
                launcher.launch(loaded, stream, args)
            c.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            want = prod + bias.double() if biased else prod
            err = ((c.double() - want).norm() / want.norm()).item()
            line.append(f"{name} {time_us(fn):.1f} ({err:.0e})")
        print(" | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
