"""The SIMT planner's "largest tile, split along K" rule (families._Simt._big_tile_split_fills) on
and off, on skinny-ish ieee shapes, against torch.matmul in the same process:
    python benchmarks/split_rule_probe.py [off]        (NOTES.md run 11)"""
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from fastmm import api  # noqa: E402
from fastmm.families import _Simt  # noqa: E402
from variants import rel_err, time_ms  # noqa: E402

SHAPES = [(128, 11008, 4096), (128, 4096, 4096), (256, 4096, 4096), (96, 4096, 8192), (1000, 1000, 1000)]

if sys.argv[1:] == ["off"]:
    _Simt.big_tile_min_k_per_split = 1 << 40
torch.backends.cuda.matmul.allow_tf32 = False
for M, N, K in SHAPES:
    a, b = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
    c = torch.full((M, N), float("nan"), device="cuda")
    _, plan, _ = api.matmul_fastmm(a, b, c, "ieee")
    err = rel_err(c, a, b)
    tf = time_ms(lambda: api.matmul_fastmm(a, b, c, "ieee"), reps=50)
    tt = time_ms(lambda: torch.matmul(a, b, out=c), reps=50)
    k = plan.kernel
    print(f"rule {'off' if sys.argv[1:] == ['off'] else 'on '} {M}x{N}x{K}: fastmm {tf * 1e3:8.1f} us  torch {tt * 1e3:8.1f} us"
          f"  ratio {tt / tf:5.3f}  err {err:.1e}  {k.family} {k.tile[:2]} grid {k.grid}")
