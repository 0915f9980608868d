#!/usr/bin/env python3
"""The cost model (fastmm/cost.py) against the GPU: for each shape and precision, the time the
model predicts for fastmm's plan beside the GPU time measured for it, per family; and, for each
tf32/tf32x3 request, the plan the planner weighed against its choice (the full-fp32 plan of a
tensor-core choice; the tensor-core plan the cost model turned down for fp32) predicted and
measured too, so that the model's choices between the two can be checked against the clock.

    PYTHONPATH=. python benchmarks/probes/cost_model.py [--section all|shapes|model|extra]
        [--precisions ieee,tf32,tf32x3] [--only NAME,...] [--json PATH]

GPU time per call: back-to-back calls queued behind a sleep kernel (probe_util.time_us), so host
time never shows as GPU time (the benchmark's wall time is host-bound for calls under ~25 us).
Inputs rotate among sets when one set fits in L2, as in bench.py. ``extra``: model dims that the
suite does not hold (other models' widths, odd token counts), to see the model away from the
rows it was fitted on.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

import fastmm  # noqa: E402
from fastmm import cost  # noqa: E402
from fastmm.benchmark import Inputs, TorchPrecision, input_sets, l2_size, load_suite, shape_label  # noqa: E402
from fastmm.dispatch import plan_for  # noqa: E402
from probe_util import need_gpu, time_us  # noqa: E402

#: Dims from models outside the suite: Mistral-7B / Qwen2-7B / Phi-3-mini widths, ViT-L, odd
#: token counts (a ragged last batch), and attention at head dim 128.
EXTRA = [
    {"name": "mistral_qo_333", "M": 333, "N": 4096, "K": 4096, "layout": "linear"},
    {"name": "qwen2_up_1000", "M": 1000, "N": 18944, "K": 3584, "layout": "linear"},
    {"name": "qwen2_down_gx_1000", "M": 1000, "N": 3584, "K": 18944, "layout": "rowmajor_b"},
    {"name": "phi3_qkv_77", "M": 77, "N": 9216, "K": 3072, "layout": "linear"},
    {"name": "phi3_gw_2047", "M": 3072, "N": 8192, "K": 2047, "layout": "a_t"},
    {"name": "vitl_mlp_3152", "M": 3152, "N": 4096, "K": 1024, "layout": "linear"},
    {"name": "attn128_qkT", "batch": 64, "M": 1024, "N": 1024, "K": 128, "layout": "bmm_bt"},
    {"name": "attn128_pv", "batch": 64, "M": 1024, "N": 128, "K": 1024, "layout": "bmm"},
    {"name": "decode4_mistral", "M": 4, "N": 14336, "K": 4096, "layout": "linear"},
    {"name": "decode32_qwen", "M": 32, "N": 3584, "K": 18944, "layout": "linear"},
    {"name": "gemv_4096", "M": 1, "N": 4096, "K": 4096, "layout": "linear"},  # issue 18's GEMV bar: <= 17.5 us
    {"name": "bmm64_short", "batch": 4096, "M": 64, "N": 64, "K": 64, "layout": "bmm"},
    {"name": "short_k64", "M": 1024, "N": 700, "K": 64, "layout": "rowmajor"},
]


def gpu_us(s: dict, x: Inputs, fn_of_set) -> float:
    state = {"i": 0}

    def call():
        j = state["i"] % x.sets
        state["i"] += 1
        fn_of_set(j)
    est = time_us(call, inner=2, samples=3)
    inner = int(max(2, min(50, 2000 / max(est, 1.0))))
    return time_us(call, inner=inner, samples=9)


def measure_row(s: dict, precision: str, device, l2: int) -> dict:
    x = Inputs(s, input_sets(s, l2, "auto"), device)
    plan = fastmm.explain(x.a[0], x.b[0], precision=precision, out=x.c[0]).plan
    row = {"name": s["name"], "shape": shape_label(s), "precision": precision}
    if plan is None or plan.kernel is None:
        row["kernel"] = "torch"
        return row
    pred = cost.predict(plan)
    row.update(kernel=plan.kernel.family, tile="x".join(map(str, plan.kernel.tile)), origin=plan.origin,
               predicted_us=pred.total_us, bound=pred.bound)
    row["measured_us"] = gpu_us(s, x, lambda j: fastmm.matmul(x.a[j], x.b[j], out=x.c[j], precision=precision))
    with TorchPrecision(precision):  # (TF32 for tf32 only, as bench.py)
        row["torch_us"] = gpu_us(s, x, lambda j: torch.matmul(x.a[j], x.b[j], out=x.c[j]))
    index = x.a[0].device.index or 0
    if precision != "ieee" and plan.precision_used != "ieee":
        # the full-fp32 plan of the same operands: what the planner weighed against this one
        alt = plan_for(replace(plan.problem, precision="ieee"), index)
        if alt.kernel is not None:
            row.update(other="fp32", other_kernel=alt.kernel.family, other_predicted_us=cost.predict(alt).total_us)
            row["other_measured_us"] = gpu_us(s, x, lambda j: fastmm.matmul(x.a[j], x.b[j], out=x.c[j], precision="ieee"))
    elif precision != "ieee" and "cost model: ran full fp32" in plan.origin:
        # the cost model moved this TF32 request to fp32: the tensor-core plan it turned down
        family = next(name for name, why in plan.rejected if "cost model predicts" in why)
        tc = plan_for(plan.problem, index, force=family)
        row.update(other="TF32", other_kernel=family, other_predicted_us=cost.predict(tc).total_us)
        with forced(family):
            row["other_measured_us"] = gpu_us(s, x, lambda j: fastmm.matmul(x.a[j], x.b[j], out=x.c[j],
                                                                             precision=precision))
    return row


class forced:
    """FASTMM_KERNEL set to ``family`` inside the block (the planner's forced family)."""

    def __init__(self, family: str):
        self.family = family

    def __enter__(self):
        self.old = os.environ.get("FASTMM_KERNEL")
        os.environ["FASTMM_KERNEL"] = self.family

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("FASTMM_KERNEL", None)
        else:
            os.environ["FASTMM_KERNEL"] = self.old


def report(rows: list[dict]) -> str:
    out = [f"{'shape':22s} {'name':20s} {'prec':6s} {'kernel':14s} {'tile':9s} {'pred us':>9s} {'meas us':>9s} "
           f"{'pred/meas':>9s} {'torch us':>9s}  the plan weighed against it: pred / meas"]
    per_family: dict[str, list[float]] = {}
    order_right = order_total = 0
    for r in rows:
        if "measured_us" not in r:
            out.append(f"{r['shape']:22s} {r['name']:20s} {r['precision']:6s} torch")
            continue
        q = r["predicted_us"] / r["measured_us"]
        per_family.setdefault(r["kernel"], []).append(q)
        alt = ""
        if "other_measured_us" in r:
            alt = f"  {r['other']}: {r['other_kernel']} {r['other_predicted_us']:.1f} / {r['other_measured_us']:.1f}"
            order_total += 1
            order_right += (r["other_predicted_us"] < r["predicted_us"]) == (r["other_measured_us"] < r["measured_us"])
        out.append(f"{r['shape']:22s} {r['name']:20s} {r['precision']:6s} {r['kernel']:14s} {r['tile']:9s} "
                   f"{r['predicted_us']:9.1f} {r['measured_us']:9.1f} {q:9.2f} {r['torch_us']:9.1f}{alt}")
    out.append("")
    out.append("per family: rows, geomean predicted/measured, median |error|, worst")
    for fam, qs in sorted(per_family.items()):
        geo = math.exp(sum(map(math.log, qs)) / len(qs))
        errs = sorted(abs(q - 1) for q in qs)
        out.append(f"  {fam:14s} {len(qs):3d}  {geo:.3f}  {100 * statistics.median(errs):.0f}%  {100 * errs[-1]:.0f}%")
    if order_total:
        out.append(f"TF32 plan against full-fp32 plan: the model orders {order_right} of {order_total} pairs as "
                   "the clock does")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="cost_model.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--section", default="all", choices=("all", "shapes", "model", "extra"))
    ap.add_argument("--precisions", default="ieee,tf32,tf32x3")
    ap.add_argument("--only", default="", help="shape names, comma-separated")
    ap.add_argument("--json", help="write the rows here")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    suite, _ = load_suite()
    shapes = []
    for section in ("shapes", "model"):
        if o.section in ("all", section):
            shapes += suite.get(section, [])
    if o.section in ("all", "extra"):
        shapes += EXTRA
    only = {n for n in o.only.split(",") if n}
    shapes = [s for s in shapes if not only or s["name"] in only]
    device = torch.device("cuda")
    l2 = l2_size(device)
    rows = []
    for s in shapes:
        for precision in o.precisions.split(","):
            try:
                rows.append(measure_row(s, precision, device, l2))
            except Exception as exc:  # one row must not sink the probe
                rows.append({"name": s["name"], "shape": shape_label(s), "precision": precision,
                             "error": f"{type(exc).__name__}: {exc}"})
                print(f"{s['name']} {precision}: {exc}", file=sys.stderr)
    if o.json:
        Path(o.json).write_text(json.dumps(rows, indent=1))
    print(report([r for r in rows if "error" not in r]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
