"""Stream-K on and off for the SIMT ieee kernel, against torch.matmul, in alternating rounds:
    python benchmarks/stream_k_probe.py [rounds]        (NOTES.md run 13)

Per shape: the planner's plan (stream-K where the last wave of tiles is partial), the same tile
without stream-K, and torch.matmul; each result checked against float64 first. Shapes whose
tiles make whole waves (8448x4096: 1056 = 8 x 132 tiles of 128x256) show what the partial last
wave costs: with no stream-K plan there, both fastmm columns run the same kernel."""
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from fastmm import api  # noqa: E402
from fastmm.families import FAMILIES, second_pass_config  # noqa: E402
from fastmm.runtime import launcher, runners  # noqa: E402
from fastmm.runtime.device import device_facts  # noqa: E402
from variants import rel_err, time_ms  # noqa: E402

SHAPES = [(8192, 4096, 6144), (8448, 4096, 6144), (8192, 8192, 4096), (4096, 4096, 4096), (4224, 4096, 4096),
          (4096, 11008, 4096), (3000, 3000, 3000)]


def runner_for(a, b, c, stream_k: bool):
    """(run(), config) for fastmm's SIMT cp.async plan of a @ b -> c, with or without stream-K."""
    fam = FAMILIES["simt_cp_async"]
    s = api.analyse(a, b)
    problem, _ = api.build_problem(s, c, "ieee")
    dev = device_facts(torch.cuda.current_device())
    fam.can_stream_k = stream_k
    try:
        cfg = fam.configure(problem, dev)
    finally:
        del fam.can_stream_k  # back to the class's value
    loaded = launcher.load(dev, cfg)
    stream = api._current_stream(dev.index)
    second = second_pass_config(problem, dev, cfg)
    if second is not None:
        run = runners.plan_runner(loaded, launcher.load(dev, second), cfg, problem, a.device)
        return (lambda: run(a.data_ptr(), b.data_ptr(), c.data_ptr(), stream)), cfg
    args = (a.data_ptr(), b.data_ptr(), c.data_ptr()) + runners.gemm_args(problem)
    return (lambda: launcher.launch(loaded, stream, args)), cfg


def main():
    rounds = int(sys.argv[1]) if sys.argv[1:] else 3
    torch.backends.cuda.matmul.allow_tf32 = False
    res: dict = {}
    for r in range(rounds):
        for M, N, K in SHAPES:
            a, b = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
            c = torch.full((M, N), float("nan"), device="cuda")
            row = res.setdefault((M, N, K), {"sk": [], "plain": [], "torch": []})
            for name in ("sk", "plain"):
                run, cfg = runner_for(a, b, c, name == "sk")
                if r == 0:
                    c.fill_(float("nan"))
                    run()
                    err = rel_err(c, a, b)
                    assert err < 1e-5, (M, N, K, name, err)
                    row[name + "_cfg"] = cfg
                row[name].append(time_ms(run, reps=15))
            row["torch"].append(time_ms(lambda: torch.matmul(a, b, out=c), reps=15))
    print("| shape | tiles | stream-K plan | fastmm stream-K | fastmm plain | torch | stream-K / torch | plain / torch |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (M, N, K), row in res.items():
        f = 2 * M * N * K / 1e9
        med = {k: sorted(v)[len(v) // 2] for k, v in row.items() if isinstance(v, list)}
        sk = row["sk_cfg"].stream_k
        plan = f"{sk.whole_tiles} whole + {sk.blocks} x {sk.iters} k-tiles" if sk else "none"
        tiles = row["plain_cfg"].grid[0]
        print(f"| {M}x{N}x{K} | {tiles} | {plan} | {f / med['sk']:.2f} | {f / med['plain']:.2f} | "
              f"{f / med['torch']:.2f} | {med['torch'] / med['sk']:.3f} | {med['torch'] / med['plain']:.3f} |")


if __name__ == "__main__":
    main()
