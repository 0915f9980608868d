"""simt_cp_async plan variants over rows of a shapes file, each checked against float64 and timed
back to back (L2 warm, as bench.py times) beside torch.matmul and the dispatcher's own plan:

    PYTHONPATH=. python benchmarks/probes/variant_rows.py --shapes FILE [--rows a,b] \\
        --variant NAME=OPTION[|MACRO=V,...][|warps_sm=N][|small_tile_slots=0] ... [--plans]

OPTION is ``-`` (the family's own tile choice) or WARPS_M,WARPS_N,THREAD_M,SPLIT_ALLOWED as a
tuned choice gives it; the macros are added to or replace the plan's (FRAG_DEPTH=3,
CP_MIN_BLOCKS=1, ...); ``warps_sm=N`` plans the split-K wave model of the 8 x 8 tiles for N warps
an SM (a split plan planned for more blocks than the tile's default is built for that many:
CP_MIN_BLOCKS), ``small_tile_slots=0`` counts them 2 blocks an SM, as before NOTES run 33; any
other lower-case name sets that field of the family (``split=8``: K in 8 slices).
``--plans`` prints the plans on a simulated H200 and stops (no GPU needed). One line per row:
torch us, the dispatcher's us, each variant's us (its tile and split in the legend above the
table), the best. Add ``--precision`` for tf32 or tf32x3 rows (default ieee).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

import candidates  # noqa: E402
from fastmm import dispatch  # noqa: E402
from fastmm.plan import select  # noqa: E402
from fastmm.problem import DeviceFacts  # noqa: E402
from probe_util import SimtOption, need_gpu, rel_err, time_us  # noqa: E402


#: SimtOption's fields with their defaults (lower case; macros are upper case)
FIELDS = {f.name: getattr(SimtOption(), f.name) for f in dataclasses.fields(SimtOption)}


def parse_variant(spec: str) -> tuple[str, SimtOption]:
    name, _, rest = spec.partition("=")
    parts = rest.split("|")
    option = None if parts[0] in ("", "-") else tuple(int(x) for x in parts[0].split(","))
    extra, fields = [], {}
    for part in parts[1:]:
        for item in filter(None, part.split(",")):
            k, v = item.split("=")
            if k in FIELDS:  # a field of the family (warps_sm, split, small_tile_slots, ...)
                fields[k] = type(FIELDS[k])(int(v)) if FIELDS[k] is not None else int(v)
            else:  # a macro
                extra.append((k, int(v)))
    return name, SimtOption(option=option, extra=tuple(extra), **fields)


def plan_label(plan) -> str:
    cfg = plan.kernel
    if cfg is None:
        return f"no plan ({plan.fallback})"
    m = dict(cfg.macros)
    split = cfg.split_slices if cfg.split_k > 1 else 1
    extra = ",".join(f"{k}={m[k]}" for k in ("FRAG_DEPTH", "CP_MIN_BLOCKS") if k in m)
    return f"{cfg.tile[0]}x{cfg.tile[1]}/{cfg.block} split {split}" + (f" {extra}" if extra else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="variant_rows.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", required=True)
    ap.add_argument("--rows", default=None)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=OPTION[|MACRO=V,...][|field=V,...] (fields: warps_sm, split, small_tile_slots, ...)")
    ap.add_argument("--precision", default="ieee")
    ap.add_argument("--plans", action="store_true", help="print the plans on a simulated H200 and stop")
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--samples", type=int, default=15)
    o = ap.parse_args(argv)
    rows, _ = candidates.model_rows(o.rows, o.shapes)
    variants = [parse_variant(v) for v in o.variant]
    if o.plans:
        dev = DeviceFacts.simulated_device("sm_90")
        for s in rows:
            a, b, c = candidates.operands(s, torch.device("meta"))
            p = candidates.problem_of(a, b, c, o.precision)
            print(s["name"], "| heuristic:", plan_label(select(p, dev)), "| " + " | ".join(
                f"{n}: {plan_label(select(p, dev, 'simt_cp_async', None, (v,)))}" for n, v in variants))
        return 0
    if not need_gpu(ap.prog):
        return 2
    torch.backends.cuda.matmul.allow_tf32 = o.precision == "tf32"
    print("row | torch us | fastmm us | " + " | ".join(n for n, _ in variants) + " | best")
    for s in rows:
        a, b, c = candidates.operands(s, torch.device("cuda"))
        us = {"torch": time_us(lambda: torch.matmul(a, b), o.inner, o.samples)}
        us["fastmm"] = time_us(lambda: dispatch.matmul_fastmm(a, b, c, o.precision), o.inner, o.samples)
        labels = []
        for name, v in variants:
            c.fill_(float("nan"))
            _, plan, reason = dispatch.matmul_fastmm(a, b, c, o.precision, force="simt_cp_async", variants=(v,))
            torch.cuda.synchronize()
            rows_checked = slice(0, min(c.shape[-2], 512))
            err = rel_err(c[..., rows_checked, :], a[..., rows_checked, :], b)
            labels.append(f"{name}: {plan_label(plan) if plan else reason} err {err:.1e}")
            if err > 1e-5:
                us[name] = float("nan")
                continue
            us[name] = time_us(lambda: dispatch.matmul_fastmm(a, b, c, o.precision, force="simt_cp_async",
                                                              variants=(v,)), o.inner, o.samples)
        best = min((k for k in us if k != "torch" and us[k] == us[k]), key=us.get)
        print(f"# {s['name']} {s['M']}x{s['N']}x{s['K']} {s.get('layout')} batch {s.get('batch', 1)}: "
              + "; ".join(labels))
        print(f"{s['name']} | " + " | ".join(f"{v:.1f}" for v in us.values())
              + f" | {best} {us['torch'] / us[best]:.3f}x torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
