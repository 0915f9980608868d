"""Accuracy against float64 as K grows: tf32x3 on each tensor-core family next to
torch.matmul in fp32 and TF32 and fastmm's ieee, on randn inputs (M = N = 1024, fresh inputs
per K). Prints a markdown table: `python benchmarks/accuracy_vs_k.py` (about 10 s on an H200)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, ahead of any installed fastmm
import fastmm  # noqa: E402
from fastmm import dispatch  # noqa: E402

KS = (64, 256, 288, 512, 1024, 2048, 4096, 16384, 65536)


def rel(c, ref):
    return ((c.double() - ref).norm() / ref.norm()).item()


def forced(a, b, family, precision):
    try:
        c, plan, reason = dispatch.matmul_fastmm(a, b, None, precision, force=family)
    except ValueError:  # the family cannot run here (e.g. wgmma off sm_90)
        return None
    return c if reason is None else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/accuracy_vs_k.py", description=__doc__.split("Prints")[0].strip())
    ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("accuracy_vs_k: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    cols = ("tf32x3 wgmma", "tf32x3 mma.sync", "torch fp32", "fastmm ieee", "torch tf32")
    print("| K | " + " | ".join(cols) + " |")
    print("| ---: |" + " ---: |" * len(cols))
    for K in KS:
        a, b = torch.randn(1024, K, device="cuda"), torch.randn(K, 1024, device="cuda")
        ref = a.double() @ b.double()
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32 = rel(torch.matmul(a, b), ref)
        torch.backends.cuda.matmul.allow_tf32 = False
        fp32 = rel(torch.matmul(a, b), ref)
        row = []
        for family in ("wgmma_tf32", "tf32_mma"):
            c = forced(a, b, family, "tf32x3")
            row.append("n/a" if c is None else f"{rel(c, ref):.2e}")
        row += [f"{fp32:.2e}", f"{rel(fastmm.matmul(a, b, precision='ieee'), ref):.2e}", f"{tf32:.2e}"]
        print(f"| {K} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
