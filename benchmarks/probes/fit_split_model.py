#!/usr/bin/env python3
"""Refit ``fastmm.families.simt_split_model`` from swept timings (CPU only): least squares on log
time over every (tile, split) plan of the fit file's products, then the held-out file's error
and, per product, the plan the fitted model picks against the fastest swept one and the rules'.

    PYTHONPATH=. python benchmarks/probes/fit_split_model.py [--fit FILE] [--holdout FILE] [--steps 1500]
    PYTHONPATH=. python benchmarks/probes/fit_split_model.py --check   # the package's constants, no fit

Inputs: ``simt_split_probe.py --tiles all --json`` output (``probes/data/split_sweep_*_h100.json``
hold the H100 sweeps of NOTES run 54). Each plan is rebuilt on a simulated H100 from its row's
problem, its tile option and the split asked for, and modelled by the same formula as
``simt_split_model.plan_us`` (``--check`` asserts the two agree with the package's constants).
Prints the fitted constants, to be copied into simt_split_model.py by hand.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

import candidates  # noqa: E402
from fastmm.families import SimtCpAsync  # noqa: E402
from fastmm.families import simt_split_model as model  # noqa: E402
from fastmm.problem import DeviceFacts  # noqa: E402

DEV = DeviceFacts.simulated_h100()
TILES = list(model.TILE_RATES)
ROWS = {"split_sweep_fit_h100.json": HERE / "midsize_wt_rows.json",
        "split_sweep_holdout_h100.json": HERE / "midsize_wt_holdout.json",
        "split_sweep_llama1k_h100.json": HERE / "llama1k_rows.json"}


def load(paths: str):
    """[(record, [(swept entry, plan features)])] of comma-separated sweep files (each named in
    ROWS with its rows file), their plans rebuilt."""
    return [x for path in paths.split(",") for x in load_one(Path(path), ROWS[Path(path).name])]


def load_one(path: Path, rows_file: Path):
    records = json.loads(path.read_text())["records"]
    rows = {r["name"]: r for r in candidates.model_rows(None, str(rows_file))[0]}
    fam = SimtCpAsync(split_model=False)
    out = []
    for rec in records:
        row = rows[rec["name"].split()[0]]
        a, b, c = candidates.operands(row, torch.device("cpu"))
        p = candidates.problem_of(a, b, c, "ieee")
        items = []
        for s in rec["swept"]:
            v = dataclasses.replace(fam, split=s["asked"], stream_k=False)
            cfg = v.configure(p, DEV, tuple(s["option"]) + (1,))
            items.append((s, features(cfg, p, SimtCpAsync().staged_b_floats(p, cfg)), (cfg, p)))
        out.append((rec, items))
    return out


def features(cfg, p, staged: int) -> dict:
    bm, bn, bk = cfg.tile
    split = cfg.split_k
    blocks = cfg.grid[0] * cfg.grid[1] * cfg.grid[2]
    return {"tile": TILES.index(tuple(cfg.tile[:2])), "per_sm": -(-blocks // DEV.sm_count),
            "resident": model.simt_resident_blocks(cfg, DEV),
            "mflop": 2.0 * bm * bn * (-(-(-(-p.K // split)) // bk) * bk) / 1e6, "split": split > 1,
            "fused": cfg.split_fused, "odd": p.N % 4 != 0,
            "slice_mb": 2 * 4 * p.M * p.N * cfg.split_slices / 1e6, "staged_mb": 8 * staged / 1e6}


def constants() -> dict:
    """The package's constants, as the fit's parameters (logs)."""
    r = [model.TILE_RATES[t] for t in TILES]
    t = lambda xs: torch.tensor([math.log(x) for x in xs], dtype=torch.float64)  # noqa: E731
    return {"alone": t([x.alone for x in r]), "full": t([x.full for x in r]), "round_us": t([x.round_us for x in r]),
            "fused": t([x.fused for x in r]), "slice": t([model.SLICE_MB_PER_US]),
            "single": t([model.SINGLE_FLOAT_SLICE_MB_PER_US]), "fused_slice": t([model.FUSED_SLICE_COST]),
            "base": t([model.BASE_US]), "launch": t([model.EXTRA_LAUNCH_US])}


def predict(f: dict, P: dict) -> torch.Tensor:
    """simt_split_model.plan_us as a function of the (log) constants."""
    i = f["tile"]
    alone, full, rnd, fused = (P[k][i].exp() for k in ("alone", "full", "round_us", "fused"))

    def round_us(c):
        return torch.maximum(f["mflop"] / alone, c * f["mflop"] / full) + rnd

    rounds, rest = divmod(f["per_sm"], f["resident"])
    us = rounds * round_us(f["resident"]) + (round_us(rest) if rest else 0.0)
    us = P["base"].exp()[0] + us * (fused if f["fused"] else 1.0)
    if f["split"]:
        traffic = f["slice_mb"] / (P["single"] if f["odd"] else P["slice"]).exp()[0]
        us = us + (traffic * P["fused_slice"].exp()[0] if f["fused"] else traffic + P["launch"].exp()[0])
    if f["staged_mb"]:
        us = us + f["staged_mb"] / (model.COPY_SHARE_OF_DRAM * DEV.dram_tbps) + P["launch"].exp()[0]
    return us


def rms(data, P) -> float:
    errs = [(torch.log(predict(f, P)) - math.log(s["us"])) ** 2 for _, items in data for s, f, _ in items]
    return float(torch.stack(errs).mean().sqrt())


def picks(name: str, data, P) -> None:
    """Per product: the rules' plan, the model's pick among the swept plans, the fastest swept."""
    ratios = []
    for rec, items in data:
        best = min(s["us"] for s, _, _ in items)
        pick = min(items, key=lambda it: float(predict(it[1], P)))[0]
        ratios.append((rec["planned"]["us"] / best, pick["us"] / best))
        print(f"  {rec['name'].split()[0]:24s} rules {rec['planned']['us']:7.1f}  pick {pick['us']:7.1f} "
              f"({'x'.join(map(str, pick['tile'][:2]))} asked S{pick['asked']})  fastest {best:7.1f}")
    gm = [math.exp(sum(math.log(r[k]) for r in ratios) / len(ratios)) for k in (0, 1)]
    print(f"{name}: rms log error {rms(data, P):.3f}; rules / fastest {gm[0]:.3f}, pick / fastest {gm[1]:.3f} (geomean)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fit_split_model.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", default=",".join(str(HERE / "data" / f) for f in ("split_sweep_fit_h100.json",
                                                                             "split_sweep_llama1k_h100.json")))
    ap.add_argument("--holdout", default=str(HERE / "data" / "split_sweep_holdout_h100.json"))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--check", action="store_true")
    o = ap.parse_args(argv)
    fit, hold = load(o.fit), load(o.holdout)
    P = constants()
    if o.check:  # the formula here is the package's
        for _, items in fit + hold:
            for _, f, (cfg, p) in items:
                ours = float(predict(f, P))
                theirs = model.plan_us(cfg, p, DEV, SimtCpAsync().staged_b_floats(p, cfg))
                assert abs(ours - theirs) < 1e-6 * theirs, (cfg.tile, cfg.grid, ours, theirs)
        print("the formula agrees with simt_split_model.plan_us on every plan")
    else:
        for v in P.values():
            v.requires_grad_(True)
        opt = torch.optim.Adam(P.values(), lr=0.03)
        for _ in range(o.steps):
            opt.zero_grad()
            loss = torch.stack([(torch.log(predict(f, P)) - math.log(s["us"])) ** 2
                                for _, items in fit for s, f, _ in items]).mean()
            loss.backward()
            opt.step()
        with torch.no_grad():
            for k, v in P.items():
                print(f"{k}: {[round(x, 3) for x in v.exp().tolist()]}  (tiles {TILES})" if v.numel() > 1
                      else f"{k}: {v.exp().item():.3f}")
    with torch.no_grad():
        picks("fit", fit, P)
        picks("holdout", hold, P)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
