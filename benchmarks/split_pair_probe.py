"""Split-K in cluster pairs against unpaired split rows, for a few stage counts, on the GPU:
    python benchmarks/split_pair_probe.py [M N K] [--rounds R]      (NOTES.md run 14)

The planner's split plan of the 128x256 SIMT tile for M x N x K (default largeK, 256x256x65536),
rebuilt with SPLIT_PAIR 0 / 1 and STAGES 8 / 12: the GEMM alone and the whole plan (GEMM +
splitk_reduce over split or split / 2 slices), each checked against float64 first, against
torch.matmul, median of R alternating rounds of 10 calls queued behind a sleep kernel."""
import argparse
import dataclasses
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from fastmm import api  # noqa: E402
from fastmm.families import splitk_reduce_config  # noqa: E402
from fastmm.runtime import launcher, runners  # noqa: E402
from fastmm.runtime.device import device_facts  # noqa: E402
from split_anatomy import gemm_launch, time_us  # noqa: E402
from variants import rel_err  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int)
    ap.add_argument("--rounds", type=int, default=5)
    o = ap.parse_args()
    M, N, K = o.shape or (256, 256, 65536)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = device_facts(torch.cuda.current_device())
    a, b = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
    c = torch.empty(M, N, device="cuda")
    p, _ = api.build_problem(api.analyse(a, b), c, "ieee")
    cfg = api.plan_for(p, dev.index).kernel
    if dev.cc < (9, 0):
        print(f"{dev.name} ({dev.arch}): cluster pairs need sm_90")
        return 1
    if cfg.family != "simt_cp_async" or cfg.split_k < 2 or cfg.split_k % 2 or cfg.tile[:2] != (128, 256):
        print(f"{M}x{N}x{K}: the plan ({cfg.family} {cfg.tile}, grid {cfg.grid}) is no even split of the 128x256 tile")
        return 1
    stream = api._current_stream(dev.index)
    work = torch.empty(cfg.split_k * M * N, device="cuda")
    per_stage = cfg.smem - (65536 if cfg.split_pair else 0)
    per_stage //= dict(cfg.macros)["STAGES"]
    fns = {}
    for pair in (0, 1):
        for stages in (8, 12):
            m = {k: v for k, v in cfg.macros if k != "SPLIT_PAIR"}
            m["STAGES"] = stages
            if pair:
                m["SPLIT_PAIR"] = 1
            v = dataclasses.replace(cfg, macros=tuple(m.items()), smem=per_stage * stages + 65536 * pair,
                                    split_pair=bool(pair))
            loaded = launcher.load(dev, v)
            run = runners.split_runner(loaded, launcher.load(dev, splitk_reduce_config(p, dev, v.split_slices)),
                                       v.split_slices, p, a.device)
            c.fill_(float("nan"))
            run(a.data_ptr(), b.data_ptr(), c.data_ptr(), stream)
            err = rel_err(c, a, b)
            assert err < 1e-5, (pair, stages, err)
            name = f"{'paired' if pair else 'unpaired'}, {stages} stages"
            fns[name + ": GEMM"] = gemm_launch(loaded, v, a, b, work, stream)
            fns[name + ": plan"] = (lambda r: lambda: r(a.data_ptr(), b.data_ptr(), c.data_ptr(), stream))(run)
    fns["torch.matmul"] = lambda: torch.matmul(a, b, out=c)
    times = {k: [] for k in fns}
    for _ in range(o.rounds):
        for k, f in fns.items():
            times[k].append(time_us(f))
    print(f"{M}x{N}x{K}: grid {cfg.grid} (split {cfg.split_k}); us per call, median of {o.rounds} rounds")
    for k, t in times.items():
        t.sort()
        print(f"  {k:<28} {t[len(t) // 2]:8.2f}  (min {t[0]:.2f}, max {t[-1]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
