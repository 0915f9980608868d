"""Run one fastmm matmul a few times (for ncu / compute-sanitizer): 
python benchmarks/profile_one.py M N K [precision] [family]"""
import sys

import torch

sys.path.insert(0, ".")
from fastmm import api  # noqa: E402

M, N, K = (int(x) for x in sys.argv[1:4])
precision = sys.argv[4] if len(sys.argv) > 4 else "ieee"
family = sys.argv[5] if len(sys.argv) > 5 else None
a = torch.randn(M, K, device="cuda")
b = torch.randn(K, N, device="cuda")
c = torch.full((M, N), float("nan"), device="cuda")
for _ in range(5):
    api.matmul_fastmm(a, b, c, precision, force=family)
torch.cuda.synchronize()
ref = a.double() @ b.double()
print("rel err", ((c.double() - ref).norm() / ref.norm()).item())
