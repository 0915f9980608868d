#!/usr/bin/env python3
"""A 2-process torch.distributed (NCCL) DDP training step of a small model patched with fastmm,
compared with a 1-process run of the same model on the concatenated batch.

    PYTHONPATH=. python benchmarks/ddp_check.py                 # ieee and tf32, 2 GPUs
    PYTHONPATH=. python benchmarks/ddp_check.py --precision ieee --json /tmp/ddp.json
    PYTHONPATH=. python benchmarks/ddp_check.py --cpu          # gloo on CPU processes: the same
                                                               # comparison, with torch computing

What it does:
1. spawns WORLD processes (torch.multiprocessing, start method spawn), rank r on cuda:r, all with
   one shared, initially empty FASTMM_CACHE_DIR (so they compile the same kernels at the same
   time: the per-key file lock must make one compile and the others load it);
2. each builds the same model (seeded, on the CPU, then moved), swaps its nn.Linear layers for
   fastmm's (``fastmm.patch``), wraps it in DistributedDataParallel and runs STEPS steps of SGD on
   its slice of a seeded global batch: forward, MSE loss, backward (gradients all-reduced by
   DDP), optimizer step; it records the loss (averaged over ranks), the gradients and the
   parameters after every step, and which fastmm kernels ran;
3. the parent runs the same steps in one process on cuda:0 on the whole batch (DDP averages the
   ranks' gradients of their mean losses: the gradient of the whole batch's mean loss);
4. compares: loss and every gradient and parameter within the precision's tolerance
   (relative Frobenius: ieee 1e-5, tf32x3 1e-5, tf32 1e-3); every rank's gradients equal each
   other exactly (DDP's all-reduce); the shared cache verifies clean (``DiskCache.verify()``),
   has no temporary files left, and each kernel key was compiled once across the processes.
Prints a short report; exits 1 on any mismatch, 2 if the machine lacks the GPUs or NCCL.

NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set for the spawned processes (the
machines this runs on require NVLink multicast off).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a source checkout without install; spawned children inherit sys.path

import torch  # noqa: E402

from dist_util import free_port, init_rank  # noqa: E402  (beside this script)

TOL = {"ieee": 1e-5, "tf32": 1e-3, "tf32x3": 1e-5}
#: layer widths: aligned and unaligned sizes, so several kernel families and load modes run
WIDTHS = (96, 257, 128, 67, 10)


def build_model(precision: str) -> torch.nn.Module:
    import fastmm

    torch.manual_seed(1234)  # the same weights in every process (made on the CPU)
    layers = []
    for i, (n_in, n_out) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        layers.append(torch.nn.Linear(n_in, n_out))
        if i < len(WIDTHS) - 2:
            layers.append(torch.nn.GELU())
    return fastmm.patch(torch.nn.Sequential(*layers), precision=precision)


def global_batch(size: int, steps: int):
    g = torch.Generator().manual_seed(99)
    return [(torch.randn(size, WIDTHS[0], generator=g), torch.randn(size, WIDTHS[-1], generator=g))
            for _ in range(steps)]


def train(model, batches, device, lr: float = 0.05):
    """STEPS of SGD; per step: (loss, {name: grad}, {name: param after the step}) on the CPU."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        opt.step()
        params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        out.append((loss.detach(), grads, params))
    return out


def kernels_used(model, x, precision) -> list[str]:
    """The fastmm kernel (or the torch fallback reason) for each Linear's forward product."""
    import fastmm

    names, h = [], x
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                exp = fastmm.explain(h, layer.weight.t(), precision=precision)
                names.append(exp.kernel or f"torch ({exp.fallback})")
            h = layer(h)
    return names


def _strip_ddp(name: str) -> str:
    return name[len("module."):] if name.startswith("module.") else name


def worker(rank: int, world: int, port: int, precisions, batch: int, steps: int, outdir: str, cpu: bool) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fastmm.runtime.cache import default_cache

    device = init_rank(rank, world, port, cpu)
    try:
        result = {"rank": rank, "runs": {}}
        for precision in precisions:
            model = build_model(precision).to(device)
            ddp = DDP(model, device_ids=None if cpu else [rank])
            per = batch // world
            mine = [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
                    for x, y in global_batch(batch, steps)]
            steps_out = []
            for loss, grads, params in train(ddp, mine, device):
                dist.all_reduce(loss)  # summed over the ranks; / world: the whole batch's mean loss
                loss /= world
                steps_out.append((loss.item(), {_strip_ddp(n): g for n, g in grads.items()},
                                  {_strip_ddp(n): p for n, p in params.items()}))
            result["runs"][precision] = {
                "steps": steps_out,
                "kernels": kernels_used(model, mine[0][0].to(device), precision),
            }
        if not cpu:
            torch.cuda.synchronize(device)
        result["compiles"] = default_cache().compiles
        result["cache_folder"] = str(default_cache().folder)
        dist.barrier()
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.double().norm().item()
    diff = (a.double() - b.double()).norm().item()
    return diff / denom if denom else diff


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", action="append", choices=sorted(TOL),
                    help="precision(s) to check (repeatable; default ieee and tf32)")
    ap.add_argument("--world", type=int, default=2, help="processes (one GPU each; default 2)")
    ap.add_argument("--batch", type=int, default=64, help="global batch (split evenly over the ranks)")
    ap.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    ap.add_argument("--cache-dir", default=None,
                    help="the shared kernel cache (default: a fresh temporary folder, so the ranks compile at once)")
    ap.add_argument("--json", default=None, help="write the report here as JSON")
    ap.add_argument("--cpu", action="store_true",
                    help="gloo on CPU processes (no GPU needed; fastmm hands the products to torch): checks this "
                    "script and the patched model under DDP, not the kernels")
    args = ap.parse_args(argv)
    precisions = args.precision or ["ieee", "tf32"]

    if not args.cpu and (not torch.cuda.is_available() or torch.cuda.device_count() < args.world):
        print(f"ddp_check: needs {args.world} CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        return 2
    import torch.distributed as dist

    if not dist.is_available() or not (dist.is_gloo_available() if args.cpu else dist.is_nccl_available()):
        print(f"ddp_check: torch.distributed with {'gloo' if args.cpu else 'NCCL'} is not available in this torch build")
        return 2
    if args.batch % args.world:
        ap.error("--batch must be a multiple of --world")

    # the spawned processes inherit this environment
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    tmp = tempfile.TemporaryDirectory(prefix="fastmm-ddp-")
    cache_dir = Path(args.cache_dir) if args.cache_dir else Path(tmp.name) / "kernel-cache"
    fresh_cache = not any(cache_dir.glob("*.cubin")) if cache_dir.is_dir() else True
    os.environ["FASTMM_CACHE_DIR"] = str(cache_dir)
    outdir = Path(tmp.name) / "results"
    outdir.mkdir()

    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    try:
        mp.spawn(worker, args=(args.world, free_port(), precisions, args.batch, args.steps, str(outdir), args.cpu),
                 nprocs=args.world, join=True)
    except Exception as exc:  # a rank failed: its traceback is in the exception
        print(f"ddp_check: a rank failed: {type(exc).__name__}: {exc}")
        return 1
    ddp_s = time.perf_counter() - t0
    ranks = [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(args.world)]

    # the same steps in one process, on the whole batch
    from fastmm.runtime.cache import DiskCache, default_cache

    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if not args.cpu:
        torch.cuda.set_device(device)
    report = {"device": "cpu (gloo)" if args.cpu else "cuda (nccl)", "world": args.world, "batch": args.batch, "steps": args.steps, "cache_dir": str(cache_dir),
              "ddp_seconds": round(ddp_s, 1), "precisions": {}, "ok": True, "problems": []}

    def problem(text):
        report["ok"] = False
        report["problems"].append(text)

    for precision in precisions:
        model = build_model(precision).to(device)
        ref_steps = train(model, global_batch(args.batch, args.steps), device)
        tol = TOL[precision]
        worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        for step, (loss, grads, params) in enumerate(ref_steps):
            got_loss, got_grads, got_params = ranks[0]["runs"][precision]["steps"][step]
            e = abs(got_loss - loss.item()) / abs(loss.item())
            worst["loss"] = max(worst["loss"], e)
            if not e <= tol:
                problem(f"{precision} step {step}: loss {got_loss:.8g} vs {loss.item():.8g} (rel. {e:.2e} > {tol:.0e})")
            for name in grads:
                for kind, mine, ref in (("grad", got_grads[name], grads[name]), ("param", got_params[name], params[name])):
                    e = rel(mine, ref)
                    worst[kind] = max(worst[kind], e)
                    if not e <= tol:
                        problem(f"{precision} step {step}: {kind} of {name} rel. error {e:.2e} > {tol:.0e}")
            for other in ranks[1:]:
                their = other["runs"][precision]["steps"][step][1]
                if any(not torch.equal(their[n], got_grads[n]) for n in got_grads):
                    problem(f"{precision} step {step}: rank {other['rank']}'s gradients differ from rank 0's")
        kernels = ranks[0]["runs"][precision]["kernels"]
        if not args.cpu and any(k.startswith("torch") for k in kernels):
            problem(f"{precision}: not every layer ran on fastmm: {kernels}")
        report["precisions"][precision] = {"worst_rel_error": worst, "tolerance": tol, "kernels": kernels,
                                          "loss": [s[0] for s in ranks[0]["runs"][precision]["steps"]]}

    cache = DiskCache(cache_dir)
    results = cache.verify()
    bad = [p.name for p, ok in results if not ok]
    leftovers = sorted(p.name for p in cache_dir.glob("*.tmp")) if cache_dir.is_dir() else []
    compiles = [r["compiles"] for r in ranks]
    report["cache"] = {"entries": len(results), "bad": bad, "temp_files_left": leftovers,
                       "compiles_per_rank": compiles, "compiles_reference": default_cache().compiles}
    if not results and not args.cpu:
        problem("the shared cache is empty: the ranks did not write their kernels")
    if bad or leftovers:
        problem(f"shared cache: bad entries {bad}, temporary files left {leftovers}")
    if fresh_cache and sum(compiles) != len(results) - default_cache().compiles:
        # a fresh cache: each kernel the ranks needed was compiled by exactly one of them
        problem(f"the ranks compiled {compiles} kernels for {len(results) - default_cache().compiles} entries")

    print(f"ddp_check ({report['device']}): {args.world} ranks x batch {args.batch // args.world} vs 1 process x batch {args.batch}, "
          f"{args.steps} SGD steps, cache {cache_dir}")
    for precision, r in report["precisions"].items():
        w = r["worst_rel_error"]
        print(f"  {precision:<7} loss {r['loss'][0]:.6f}: worst rel. error loss {w['loss']:.1e}, grads {w['grad']:.1e}, "
              f"params {w['param']:.1e} (tolerance {r['tolerance']:.0e}); kernels "
              + ", ".join("torch" if k.startswith("torch") else k for k in r["kernels"]))
    c = report["cache"]
    print(f"  cache: {c['entries']} entries, {len(c['bad'])} bad, {len(c['temp_files_left'])} temp files left; "
          f"compiles per rank {c['compiles_per_rank']}, reference process {c['compiles_reference']}")
    for text in report["problems"]:
        print(f"  MISMATCH: {text}")
    print("ddp_check: " + ("OK" if report["ok"] else "FAILED"))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    tmp.cleanup()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
