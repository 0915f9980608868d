#!/usr/bin/env python3
"""Which plans a change moves: every product of the model shape files and a fixed draw of random
ones, planned on simulated devices by two trees, and the plans that differ listed. No GPU needed.

    python benchmarks/probes/plan_diff.py --old /tmp/old          # a checkout of the tree before the
                                                                 # change (git worktree add /tmp/old HEAD
                                                                 # before committing it, HEAD~1 after)
    python benchmarks/probes/plan_diff.py --dump plans.json       # this tree's plans only

Products: the ``model`` rows of benchmarks/bench_shapes.json, model_dims_fresh.json,
model_dims_extra.json and model_dims_holdout.json (their layouts: x @ W.t(), A^T, batched B^T),
plus 400 random products (seeded: the same draw every run) of model-like dims, a batch of 8 on a
quarter of them, B K-contiguous on 60%, A transposed on 20%. Each in ieee, tf32 and tf32x3, with
and without a bias along n (batch 1), on a simulated H200, H100 and A100. A plan is compared by
its GEMM kernel's family, macros and grid only: a change to a plan's second pass (split-K reduce,
stream-K fixup), staging copies, operand swap or fallback alone does not show. Each tree plans in
a process of its own (its own ``fastmm``); the products come from this tree's shape files.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FILES = ("bench_shapes", "model_dims_fresh", "model_dims_extra", "model_dims_holdout")


def products() -> list[tuple[int, int, int, int, bool, bool]]:
    """(M, N, K, batch, B K-contiguous, A transposed) of the shape files' model rows (their layout
    read as bench.py reads it: ``fastmm.benchmark.layout_of``) and the draw."""
    from fastmm.benchmark import layout_of

    out = []
    for name in FILES:
        for r in json.loads((REPO / "benchmarks" / f"{name}.json").read_text())["model"]:
            layout = layout_of(r)
            out.append((r["M"], r["N"], r["K"], r.get("batch", 1), layout in ("linear", "bmm_bt"), layout == "a_t"))
    rng = random.Random(4)
    for _ in range(400):
        out.append((rng.choice([1, 8, 64, 77, 300, 512, 788, 1000, 1024, 2048, 4096, 4728, 8192]),
                    rng.choice([256, 768, 1000, 1024, 2304, 3072, 4096, 11008, 14336, 32000]),
                    rng.choice([64, 128, 512, 768, 1024, 2048, 3584, 4096]), rng.choice([1, 1, 1, 8]),
                    rng.random() < 0.6, rng.random() < 0.2))
    return out


def dump(repo: str, path: str) -> None:
    """Plan every product with the fastmm of ``repo`` and write {key: plan text} to ``path``."""
    sys.path.insert(0, repo)
    import dataclasses

    from fastmm.plan import select
    from fastmm.problem import EPILOGUE_BIAS_N, DeviceFacts, Problem

    devices = {"h200": DeviceFacts.simulated_device("sm_90"), "h100": DeviceFacts.simulated_h100(),
               "a100": DeviceFacts.simulated_device("sm_80")}
    plans = {}
    for dev_name, dev in devices.items():
        for precision in ("ieee", "tf32", "tf32x3"):
            for M, N, K, batch, b_t, a_t in products():
                for bias in (False, True):
                    if bias and batch != 1:
                        continue
                    p = Problem.dense(M, N, K, precision, batch=batch, b_t=b_t, a_t=a_t)
                    if bias:
                        p = dataclasses.replace(p, epilogue=EPILOGUE_BIAS_N)
                    k = select(p, dev).kernel
                    key = f"{dev_name} {precision} {M}x{N}x{K} batch {batch}{' W^T' if b_t else ''}" \
                          f"{' A^T' if a_t else ''}{' +bias' if bias else ''}"
                    plans[key] = None if k is None else f"{k.family} {sorted(k.macros)} grid {k.grid}"
    Path(path).write_text(json.dumps(plans))


def plans_of(repo: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "plans.json")
        subprocess.run([sys.executable, __file__, "--tree", repo, "--dump", path], check=True, cwd=tmp)
        return json.loads(Path(path).read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", help="a checkout of the tree to compare this one with")
    ap.add_argument("--tree", default=str(REPO), help=argparse.SUPPRESS)
    ap.add_argument("--dump", help="write this tree's plans to this JSON file and stop")
    o = ap.parse_args()
    if o.dump:
        dump(o.tree, o.dump)
        return 0
    if not o.old:
        ap.error("--old or --dump is needed")
    old, new = plans_of(o.old), plans_of(str(REPO))
    moved = [k for k in new if old.get(k) != new[k]]
    print(f"{len(moved)} of {len(new)} plans differ")
    print("by device and precision:", dict(collections.Counter(" ".join(k.split()[:2]) for k in moved)))
    for k in moved:
        print(f"{k}\n    before {old.get(k)}\n    now    {new[k]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
