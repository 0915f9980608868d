"""Stream-K on and off for the SIMT ieee kernel, against torch.matmul, in alternating rounds
(NOTES.md run 13):

    python benchmarks/probes/stream_k_probe.py [rounds] [--model] [--head]

Per shape: the planner's simt_cp_async plan (stream-K where the last wave of tiles is partial),
the plan of the variant SimtCpAsync(stream_k=False) handed to the planner (the same tile, split-K
or one launch), and torch.matmul; each plan launched as fastmm launches it, each result checked
against float64 first. Shapes whose tiles make whole waves (8448x4096: 1056 = 8 x 132 tiles of
128x256 on an H200) show what the partial last wave costs: with no stream-K plan there, both
fastmm columns run the same kernel. ``--model``: products of a model's training step in the
layouts it hands them over (x @ W^T, grad_x with a row-major W, grad_W's A^T) instead, where
stream-K's own kernel may cost more per k-tile than the plain one (grad_W's build: ~4.5%, NOTES
run 35). ``--head``: also the variant SimtCpAsync(stream_k_head=False), where the planner took
a stream-K plan's head form (its whole waves in the plain kernel's own launch first; run 36),
the same plan in one launch.
"""
import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families import SimtCpAsync  # noqa: E402
from fastmm.runtime import launcher  # noqa: E402
from fastmm.shapes import analyse, build_problem  # noqa: E402
from probe_util import need_gpu, rel_err, time_ms  # noqa: E402
from variants import layout_operands  # noqa: E402

SHAPES = [(8192, 4096, 6144), (8448, 4096, 6144), (8192, 8192, 4096), (4096, 4096, 4096), (4224, 4096, 4096),
          (4096, 11008, 4096), (3000, 3000, 3000)]
# (M, N, K, layout as variants.layout_operands names it): "nn" row-major, "nt" B = W^T (W stored
# [N, K]), "tn" A = G^T (G stored [K, M])
MODEL_SHAPES = [(8192, 1024, 32000, "nn"), (8192, 1024, 30522, "nn"), (8192, 2816, 4096, "nt"),
                (8192, 4096, 6144, "nt"), (4096, 4100, 1000, "tn"), (32000, 1024, 8192, "tn"),
                (8192, 2816, 1024, "nt"), (8192, 2816, 1024, "nn"), (30522, 1024, 8192, "tn"),
                (8192, 2816, 4096, "nn"), (14336, 4096, 2048, "tn")]


#: the variants timed: the registry's family, stream-K's one-launch form only, no stream-K
VARIANTS = {"sk": (), "one": (SimtCpAsync(stream_k_head=False),), "plain": (SimtCpAsync(stream_k=False),)}


def planned(a, b, c, variants):
    """(run(), plan) of fastmm's simt_cp_async plan of a @ b -> c, planned with ``variants``
    handed to the planner, queued as fastmm.dispatch.run queues a prepared plan."""
    s = analyse(a, b)
    problem, offsets = build_problem(s, c, "ieee")
    index = torch.cuda.current_device()
    plan = dispatch.plan_for(problem, index, "simt_cp_async", variants)
    second = launcher.load(plan.device, plan.reduce) if plan.reduce is not None else None
    hit = dispatch.Prepared(plan, launcher.load(plan.device, plan.kernel), second)
    return (lambda: dispatch.launch_plan(hit, s, c, problem, offsets, index)), plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="stream_k_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", nargs="?", type=int, default=3)
    ap.add_argument("--model", action="store_true", help="model products in their own layouts")
    ap.add_argument("--head", action="store_true", help="also the stream-K plan in one launch where the planner "
                    "took the head form")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    rounds = o.rounds
    torch.backends.cuda.matmul.allow_tf32 = False
    res: dict = {}
    for r in range(rounds):
        for M, N, K, layout in MODEL_SHAPES if o.model else [shape + ("nn",) for shape in SHAPES]:
            a, b = layout_operands(M, N, K, layout)
            c = torch.full((M, N), float("nan"), device="cuda")
            row = res.setdefault((M, N, K, layout), {"sk": [], "plain": [], "torch": [], "one": []})
            for name in ("sk", "one", "plain") if o.head else ("sk", "plain"):
                run, plan = planned(a, b, c, VARIANTS[name])
                if name == "one" and not (row["sk_cfg"].stream_k and row["sk_cfg"].stream_k.head_rows):
                    continue  # (the same plan as "sk")
                if r == 0:
                    c.fill_(float("nan"))
                    run()
                    err = rel_err(c, a, b)
                    assert err < 1e-5, (M, N, K, name, err)
                    row[name + "_cfg"] = plan.kernel
                row[name].append(time_ms(run, reps=15))
            row["torch"].append(time_ms(lambda: torch.matmul(a, b, out=c), reps=15))
    print("| shape | layout | tiles | stream-K plan | fastmm stream-K | fastmm plain | torch | stream-K / torch | "
          "plain / torch | one launch / torch | us: stream-K / one launch / plain / torch |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (M, N, K, layout), row in res.items():
        f = 2 * M * N * K / 1e9
        med = {k: sorted(v)[len(v) // 2] for k, v in row.items() if isinstance(v, list) and v}
        sk = row["sk_cfg"].stream_k
        plan = "none"
        if sk and sk.head_rows:
            plan = f"{sk.head_tiles} in a plain launch, then {sk.blocks} x {sk.iters} k-tiles"
        elif sk:
            plan = f"{sk.whole_tiles} whole + {sk.blocks} x {sk.iters} k-tiles"
        pcfg = row["plain_cfg"]
        tiles = pcfg.grid[0] if pcfg.split_k == 1 else f"{pcfg.grid[0]} (split {pcfg.split_k})"
        one = f"{med['torch'] / med['one']:.3f}" if "one" in med else "-"
        print(f"| {M}x{N}x{K} | {layout} | {tiles} | {plan} | {f / med['sk']:.2f} | {f / med['plain']:.2f} | "
              f"{f / med['torch']:.2f} | {med['torch'] / med['sk']:.3f} | {med['torch'] / med['plain']:.3f} | {one} | "
              + " / ".join(f"{1000 * med[k]:.1f}" for k in ("sk", "one", "plain", "torch") if k in med) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
