#!/usr/bin/env python3
"""fastmm's host path per call on a machine without a GPU: CPU tensors stand in for CUDA ones, the
steady-state entries are made by hand and the launches are stubbed, so what is timed is fastmm's
Python around the launch (the checks, the keys, the allocation, the autograd Function), beside
torch's own call on the same small CPU tensors (which includes torch's CPU arithmetic: a few us).
On the GPU the launch itself adds ~5 us a call to fastmm (cuda.core) and cuBLAS's to torch.

    python benchmarks/probes/host_stubbed.py                 # this tree, one table
    python benchmarks/probes/host_stubbed.py --ab OLD_TREE   # this tree and OLD_TREE (a checkout,
                                                             # e.g. `git worktree add /tmp/old HEAD`)
                                                             # in alternating processes, min per row

Rows: fastmm.matmul with out= (bench's decode rows: host-paced on the H200), without out=, a
``fastmm.nn.Linear`` forward without grad, with grad, and forward + backward (models.py's host
table), an [in, out] layer (GPT-2's Conv1D form, registered with register_linear_like) without
grad and forward + backward, the registered ops as compiled graphs call them (grad mode off) and
a compiled (aot_eager) Linear step, each with torch's beside it. Times are the best of 5 repeats of back-to-back calls.
"""
from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import timeit
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(repo: str) -> dict[str, float]:
    sys.path.insert(0, repo)
    import torch

    import fastmm
    from fastmm import dispatch, fast_path
    from fastmm.runtime import launcher
    from fastmm.shapes import analyse, extent

    torch.set_num_threads(1)  # (torch's CPU arithmetic, one thread: no pool to wake per call)
    launcher.launch = lambda loaded, stream, args: None
    fast_path._cuda_device = lambda: 0
    dispatch.current_stream = lambda index: 0

    def entry(a, b, out, epi_tail=None):
        s = analyse(a, b)
        ext = (extent(a), extent(b), extent(out)) if out is not None else None
        return s, fast_path.FastEntry(s.out_shape, object(), tuple(range(17)), a.device, 0, ext, None, epi_tail)

    def full(key, a, b, out, precision):  # the full path's part: remember a one-launch entry
        s, fast_path.ENTRIES[key] = entry(a, b, out)
        return out if out is not None else torch.empty(s.out_shape)

    def fused_full(key, a, b, d, alpha, beta, precision):
        s, fast_path.ENTRIES[key] = entry(a, b, None, (1, 2, 3, 4))
        return torch.empty(s.out_shape)

    fast_path._compute_full, fast_path._fused_full = full, fused_full

    def t(f, n):
        for _ in range(300):
            f()
        return min(timeit.repeat(f, number=n, repeat=5)) / n * 1e6

    a, w, c = torch.randn(1, 64), torch.randn(64, 64), torch.empty(1, 64)
    ref = torch.nn.Linear(16, 32)
    fm = fastmm.nn.Linear.from_linear(ref)
    x, g = torch.randn(4, 16), torch.randn(4, 32)
    xg = x.clone().requires_grad_()
    class InOut(torch.nn.Module):  # GPT-2's Conv1D form: x @ W + b, W stored [in, out]
        def __init__(self, w, b):
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(w), torch.nn.Parameter(b)

        def forward(self, x):
            return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(x.shape[:-1] + (-1,))

    conv = InOut(ref.weight.detach().t().contiguous(), ref.bias.detach())
    fastmm.register_linear_like(InOut, layout="in_out")
    fm_conv = fastmm.patch(torch.nn.Sequential(InOut(conv.weight.detach(), conv.bias.detach())))[0]
    res = {}
    with torch.no_grad():
        res["[in, out] layer, no grad"] = (t(lambda: fm_conv(x), 30000), t(lambda: conv(x), 30000))
        res["matmul(a, W.t(), out=c)"] = (t(lambda: fastmm.matmul(a, w.t(), out=c, precision="ieee"), 50000),
                                          t(lambda: torch.matmul(a, w.t(), out=c), 50000))
        res["matmul(a, W.t())"] = (t(lambda: fastmm.matmul(a, w.t(), precision="ieee"), 50000),
                                   t(lambda: torch.matmul(a, w.t()), 50000))
        res["Linear, no grad"] = (t(lambda: fm(x), 50000), t(lambda: ref(x), 50000))
        # what compiled graphs call at every step (grad mode off, the weight a Parameter)
        wp, bp = ref.weight, ref.bias
        res["op linear, no grad"] = (t(lambda: torch.ops.fastmm.linear.default(x, wp, bp, "ieee"), 30000),
                                     t(lambda: torch.nn.functional.linear(x, wp, bp), 30000))
        res["op matmul, no grad"] = (t(lambda: torch.ops.fastmm.matmul.default(x, wp.t(), "ieee"), 30000),
                                     t(lambda: torch.matmul(x, wp.t()), 30000))
    res["Linear, with grad"] = (t(lambda: fm(xg), 30000), t(lambda: ref(xg), 30000))
    res["Linear, forward + backward"] = (t(lambda: fm(xg).backward(g), 5000), t(lambda: ref(xg).backward(g), 5000))
    res["[in, out] layer, forward + backward"] = (t(lambda: fm_conv(xg).backward(g), 5000),
                                                  t(lambda: conv(xg).backward(g), 5000))
    # a compiled step (aot_eager: the graphs' calls without Inductor's code), forward + backward
    step_fm = torch.compile(lambda x: fm(x).square().sum(), backend="aot_eager")
    step_ref = torch.compile(lambda x: ref(x).square().sum(), backend="aot_eager")
    res["compiled Linear step (aot_eager)"] = (t(lambda: step_fm(xg).backward(), 3000),
                                               t(lambda: step_ref(xg).backward(), 3000))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=str(HERE.parents[1]), help="the tree to time (default: this one)")
    ap.add_argument("--ab", metavar="OLD_TREE", help="time OLD_TREE too, in alternating processes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)  # (one process's dict)
    o = ap.parse_args()
    if o.raw:
        print(repr(measure(o.repo)))
        return 0
    trees = {"this": o.repo} | ({"old": o.ab} if o.ab else {})
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(o.rounds if o.ab else 1):
        for name, repo in trees.items():
            out = subprocess.run([sys.executable, __file__, "--raw", "--repo", repo], capture_output=True, text=True,
                                 check=True).stdout
            runs[name].append(ast.literal_eval(out.strip().splitlines()[-1]))
    best = {name: {row: tuple(min(r[row][i] for r in rs) for i in (0, 1)) for row in rs[0]} for name, rs in runs.items()}
    head = f"{'us a call (launches stubbed)':<30}" + "".join(f"{'fastmm ' + n:>14}" for n in trees) + f"{'torch':>10}"
    print(head)
    for row in best["this"]:
        print(f"{row:<30}" + "".join(f"{best[n][row][0]:14.2f}" for n in trees) + f"{best['this'][row][1]:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
