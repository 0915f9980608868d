#!/usr/bin/env python3
"""The mid-size split model against the rules it replaced, on the GPU: for each row of the given
suite files (their model rows, laid out as bench.py lays them out), in ieee, the plan fastmm
makes now (``SimtCore.modelled_choice``: simt_split_model's tile and split) and the rules' plan
(``SimtCpAsync(split_model=False)``), each timed by CUDA graph replay and checked against float64,
beside torch.matmul. Rows whose two plans are the same kernel are timed once.

    python benchmarks/probes/split_model_probe.py --shapes FILE[,FILE...] [--rows a,b] [--json PATH]

A line a row (us: torch, now, rules; ratios torch / fastmm), then geometric means over the rows
whose plans differ and over all rows.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families import SimtCpAsync  # noqa: E402
from fastmm.plan import select  # noqa: E402
from probe_util import compile_plans, graph_us, need_gpu, rel_err  # noqa: E402

RULES = (SimtCpAsync(split_model=False),)


def label(plan) -> str:
    k = plan.kernel
    if k is None:
        return "torch"
    split = k.split_slices if k.split_k > 1 else 1
    how = "f" if k.split_fused else "p" if k.split_pair else ""
    return f"{k.family} {k.tile[0]}x{k.tile[1]} S{split}{how}{' +B^T copy' if plan.staging else ''}"


def gm(xs) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="split_model_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", required=True)
    ap.add_argument("--rows", default=None)
    ap.add_argument("--json", default=None)
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    import candidates
    dev = torch.device("cuda")
    facts = dispatch.device_facts(torch.cuda.current_device())
    items = []
    for path in o.shapes.split(","):
        rows, _ = candidates.model_rows(o.rows, path)
        for s in rows:
            a, b, out = candidates.operands(s, dev)
            p = candidates.problem_of(a, b, out, "ieee")
            items.append((s, a, b, out, select(p, facts), select(p, facts, variants=RULES)))
    print(f"compiled {compile_plans([x for it in items for x in it[4:]], facts.arch)} kernels", flush=True)
    records, differ, every = [], [], []
    print("row | shape | layout | torch us | now us (plan) | rules us (plan) | torch/now | torch/rules | rules/now")
    for s, a, b, out, now, rules in items:
        def run_now():
            return dispatch.matmul_fastmm(a, b, out, "ieee")

        def run_rules():
            return dispatch.matmul_fastmm(a, b, out, "ieee", variants=RULES)

        t_torch = graph_us(lambda: torch.matmul(a, b, out=out))
        times, errs = {}, {}
        same = all(getattr(now.kernel, f) == getattr(rules.kernel, f) for f in ("entry", "macros", "grid")) \
            and now.staging == rules.staging  # (the same launch: the details may differ)
        for key, fn in (("now", run_now), ("rules", run_rules)) if not same else (("now", run_now),):
            out.fill_(float("nan"))
            fn()
            errs[key] = rel_err(out, a, b)
            times[key] = graph_us(fn)
        if same:
            times["rules"], errs["rules"] = times["now"], errs["now"]
        flag = "" if max(errs.values()) < 1e-5 else f"  ERR {max(errs.values()):.1e}"
        shape = f"{s['M']}x{s['N']}x{s['K']}"
        print(f"{s['name']} | {shape} | {s.get('layout')} | {t_torch:.1f} | {times['now']:.1f} ({label(now)}) | "
              f"{times['rules']:.1f} ({label(rules)}) | {t_torch / times['now']:.3f} | {t_torch / times['rules']:.3f} | "
              f"{times['rules'] / times['now']:.3f}{flag}", flush=True)
        every.append((t_torch / times["now"], t_torch / times["rules"], times["rules"] / times["now"]))
        if not same:
            differ.append(every[-1])
        records.append({"name": s["name"], "shape": shape, "layout": s.get("layout"), "torch_us": t_torch,
                        "now_us": times["now"], "rules_us": times["rules"], "now": label(now),
                        "rules": label(rules), "errors": errs})
        if o.json:
            Path(o.json).write_text(json.dumps(records, indent=1))
    for what, xs in (("rows whose plans differ", differ), ("all rows", every)):
        print(f"{what} ({len(xs)}): geomean torch/now {gm([x[0] for x in xs]):.3f}, torch/rules "
              f"{gm([x[1] for x in xs]):.3f}, rules/now {gm([x[2] for x in xs]):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
