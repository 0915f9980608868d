"""Is fastmm's TF32 gradient error in tests/test_nn's encoder a property or a draw?

For several seeds: the patched model (eager, patch) and the unpatched one, both TF32, each
gradient's relative error against a float64 copy; prints fastmm/torch error ratios per parameter
and their spread over seeds.   python3 benchmarks/probes/tf32_grad_seeds.py [seeds]
"""
import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parents[1] / "tests"), str(HERE)]

import fastmm  # noqa: E402
from probe_util import need_gpu  # noqa: E402
from tests.test_nn import _reference_cuda, _set_precision, grads, loss_of, make_models  # noqa: E402


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(seeds):
    ratios, per_seed = {}, []
    for seed in range(seeds):
        ref, ours, x, target = make_models("cuda", seed=seed)
        (out_t, g_t), (out_64, g_64) = _reference_cuda(ref, x, target, "tf32")
        fastmm.unpatch(ours)
        fastmm.patch(ours)
        _set_precision("tf32")
        out, loss = loss_of(ours, x, target)
        loss.backward()
        g = grads(ours)
        for name in ["<output>", *g]:
            o, t, e = (out, out_t, out_64) if name == "<output>" else (g[name], g_t[name], g_64[name])
            ratios.setdefault(name, []).append(rel(o, e) / rel(t, e))
        per_seed.append(statistics.geometric_mean([r[-1] for r in ratios.values()]))
    print(f"{'parameter':48s} {'median':>7s} {'min':>6s} {'max':>6s}  (fastmm err / torch err vs float64, {seeds} seeds)")
    for name, r in ratios.items():
        print(f"{name:48s} {statistics.median(r):7.3f} {min(r):6.3f} {max(r):6.3f}")
    print("geomean over the output and every gradient, per seed: " + " ".join(f"{x:.3f}" for x in per_seed))
    everything = [v for r in ratios.values() for v in r]
    print(f"all: median {statistics.median(everything):.3f}, geomean "
          f"{statistics.geometric_mean(everything):.3f}, max {max(everything):.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("seeds", type=int, nargs="?", default=12)
    args = ap.parse_args()
    if not need_gpu("tf32_grad_seeds.py"):
        raise SystemExit(2)
    main(args.seeds)
