#!/usr/bin/env python3
"""A fastmm-patched Llama-style model trained under FSDP2 (``fully_shard``) on 2 processes: its
losses over STEPS optimizer steps match the unpatched model's within fp32 noise, and the step time
of both is reported.

    PYTHONPATH=. python benchmarks/fsdp2_check.py                      # ieee and tf32x3, 2 GPUs
    PYTHONPATH=. python benchmarks/fsdp2_check.py --precisions ieee,tf32x3,tf32 --json /tmp/fsdp2.json
    PYTHONPATH=. python benchmarks/fsdp2_check.py --cpu --steps 3      # gloo on CPU processes, --tiny:
                                                                       # the plumbing, torch computing

What it does:
1. spawns WORLD (2) processes (torch.multiprocessing, start method spawn), rank r on cuda:r with
   NCCL (``--cpu``: gloo, CPU tensors), all with one shared, initially empty FASTMM_CACHE_DIR;
2. each builds the same ``transformers.LlamaForCausalLM`` from a config (random weights, seeded:
   identical on every rank; hidden 1024, 4 layers, 16 heads, 4 KV heads, intermediate 2816, vocab
   32000, SDPA attention; ``--tiny``: 64 / 2 / 4 / 2 / 176 / 512) and, for every run, a fresh copy
   of it: optionally ``fastmm.patch(model, precision=P)`` (BEFORE sharding), then ``fully_shard`` on
   each decoder layer and on the root (``torch.distributed.fsdp``; ``torch.distributed._composable
   .fsdp`` on torch < 2.6), AdamW (or ``--optim sgd``);
3. the runs, in the same processes and on the same data: ``torch`` (unpatched, full fp32: TF32 off),
   ``torch again`` (the same, a second time: torch's own run-to-run noise), ``fastmm P`` for P in
   ieee / tf32x3, and for tf32 ``torch tf32`` (TF32 on) and ``fastmm tf32``. Each run makes WARMUP
   untimed forward+backward passes on step 0's batch (kernels compiled or loaded; no optimizer
   step, gradients dropped: they change nothing; the first pass's gradients, at the initial
   weights, are compared across runs) then STEPS steps (zero_grad, forward, causal-LM
   loss, backward: FSDP2 reduce-scatters the gradients, optimizer step) on a seeded global batch
   of Zipf-distributed token ids (learnable: the loss falls from ~ln(vocab)), each rank
   on its own slice; the loss of each step is averaged over the ranks, the step time is the
   slowest rank's (CUDA events; wall time on the CPU);
4. probes, during a fastmm run's first warm-up pass: a forward pre-hook on every
   ``fastmm.nn.Linear`` and counters around ``fastmm.ops.linear_eager`` and the autograd
   function's backward check that under FSDP2 each layer's forward reads an unsharded, full-shape,
   plain (not DTensor) weight and bias from ``_parameters``, and that every forward goes to the
   fastmm op and every backward through fastmm's; on GPU, ``fastmm.explain`` names the kernel of
   each layer's forward product (a ``torch (...)`` fallback there is a mismatch).

Checks (exit 1 on any failure): per step, |loss_fastmm - loss_ref| / loss_ref <= 1e-4 for ieee
and tf32x3 (ref: torch fp32) and <= 1e-2 for tf32 (ref: torch with TF32); the first pass's
gradients, parameter by parameter (every rank's shards together), within 1e-4 relative of the
reference run's (tf32: 3e-2); losses finite; the torch loss falls over the steps; the probes as
above; the shared kernel cache verifies clean with no temporary files left. Exit 2 if the machine
lacks the GPUs or NCCL (``--cpu``: gloo), or torch has no FSDP2, or transformers is missing, or
(``--cpu``) FSDP2 cannot train the unpatched model on CPU processes with gloo.

The tolerances are fp32 noise, measured on the CPU in one process (this script's model and kind
of data, 20 steps): torch's fp32 Linear against the same model with (a) another fp32 summation
order (K split in two halves), (b) an exactly rounded Linear (float64 products rounded to
float32), (c) everything in float64.
- Losses, AdamW lr 1e-3: at most 1.4e-7 relative per step at hidden 256, 2 layers, 512 tokens a
  step (one or two float32 ulps of the loss, no growth over the steps), 8.5e-7 at the default
  width (128 tokens a step: the CPU's budget). SGD lr 0.1 (hidden 256): 6e-6, growing over the
  last steps. fastmm's ieee and tf32x3 products differ from cuBLAS's fp32 about as (a) and (b)
  do (benchmarks/RESULTS.md: 1e-7..2e-6 relative per product), so 1e-4 is ~100x over the noise
  (~15x with SGD). It needs a stable run: SGD at lr 0.5 diverges (loss up to 28) and turns the
  same 1e-7 into 1e-1 by step 15.
- The loss is a coarse detector: with ``--tiny``, scaling both down projections' outputs by
  1.001 in the fastmm runs moves the losses by only 2e-6 (passes); by 1.1, 2e-4 (fails). Hence
  the gradient check: the first pass's gradients carry fp32 noise of 1.2e-6 (hidden 256) and
  1.6e-6 (default width) in the worst parameter (a k_proj), while the 1.001 scaling moves the
  worst gradient by 1e-3 (fails, as it should).
- TF32 (operands rounded to TF32 to nearest, as fastmm's kernels do, or truncated, as tensor cores
  take fp32): the default-width losses move by up to 1.7e-4 and 6.2e-4 from fp32 (two TF32
  implementations: up to ~8e-4 apart), the worst gradient by 1.7e-3 and 3.3e-3; tf32 is compared
  with torch's own TF32 at 1e-2 (losses) and 3e-2 (gradients).

NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set for the spawned processes (the
machines this runs on require NVLink multicast off). ``--cpu`` checks the script and FSDP2 with
fastmm's layers (fastmm hands CPU products to torch.matmul, so the losses match exactly there),
not the kernels, and implies ``--tiny``. Prints a short report table last.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a source checkout without install; spawned children inherit sys.path

import torch  # noqa: E402

from dist_util import free_port, init_rank  # noqa: E402  (beside this script)

#: per-step relative loss tolerance against the reference run, and that reference
TOL = {"ieee": 1e-4, "tf32x3": 1e-4, "tf32": 1e-2}
REF = {"ieee": "torch", "tf32x3": "torch", "tf32": "torch tf32"}
#: the gradients of the first pass (the initial weights, step 0's batch): largest relative
#: difference of one parameter's full gradient against the reference run's
GRAD_TOL = {"ieee": 1e-4, "tf32x3": 1e-4, "tf32": 3e-2}
#: (hidden, layers, heads, kv heads, intermediate, vocab, global batch, sequence)
SIZES = {"default": (1024, 4, 16, 4, 2816, 32000, 8, 512), "tiny": (64, 2, 4, 2, 176, 512, 4, 32)}


def fully_shard_fn():
    """FSDP2's ``fully_shard``, or None where this torch has none."""
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
        return fully_shard
    except ImportError:
        pass
    try:
        from torch.distributed._composable.fsdp import fully_shard  # torch 2.4 / 2.5
        return fully_shard
    except ImportError:
        return None


def build_model(size):
    """The Llama-style model, random weights seeded the same in every process (made on the CPU)."""
    import transformers

    transformers.logging.set_verbosity_error()
    H, L, NH, KV, F, V, _, S = size
    cfg = transformers.LlamaConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                                   intermediate_size=F, vocab_size=V, max_position_embeddings=max(2048, S),
                                   tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    return transformers.LlamaForCausalLM(cfg).float()


def global_batches(size, steps: int) -> list[torch.Tensor]:
    """STEPS global batches [B, S] of token ids, Zipf-distributed over a seeded permutation of the
    vocabulary (something the model can learn: the loss falls)."""
    V, B, S = size[5], size[6], size[7]
    g = torch.Generator().manual_seed(99)
    probs = 1.0 / torch.arange(1, V + 1, dtype=torch.float64) ** 1.1
    perm = torch.randperm(V, generator=g)
    return [perm[torch.multinomial(probs, B * S, replacement=True, generator=g)].reshape(B, S) for _ in range(steps)]


class Probes:
    """Checks, for one forward+backward pass of a patched model under FSDP2, what fastmm's layers
    receive: installed around the pass, removed after."""

    def __init__(self, model, precision: str, explain: bool):
        import fastmm
        from fastmm import ops

        self.fastmm, self.ops, self.precision, self.explain = fastmm, ops, precision, explain
        self.layers = {m: n for n, m in model.named_modules() if isinstance(m, fastmm.nn.Linear)}
        self.forwards = self.eager = self.backwards = 0
        self.bad: list[str] = []
        self.kernels: dict[str, str] = {}
        self.handles = [m.register_forward_pre_hook(self.pre_hook) for m in self.layers]
        self.orig_eager, self.orig_backward = ops.linear_eager, ops._Linear.backward
        shapes = {(m.out_features, m.in_features) for m in self.layers}
        probes = self

        def linear_eager(x, weight, bias, precision):
            probes.eager += 1
            if tuple(weight.shape) not in shapes:
                probes.bad.append(f"linear_eager got a weight of shape {tuple(weight.shape)}")
            return probes.orig_eager(x, weight, bias, precision)

        def backward(ctx, g):
            probes.backwards += 1
            x, w = ctx.saved_tensors
            if tuple(w.shape) not in shapes or w.untyped_storage().nbytes() < w.numel() * w.element_size():
                probes.bad.append(f"backward saw a weight of shape {tuple(w.shape)}, "
                                  f"storage {w.untyped_storage().nbytes()} bytes")
            return probes.orig_backward(ctx, g)

        ops.linear_eager = linear_eager
        ops._Linear.backward = staticmethod(backward)

    def pre_hook(self, module, args):
        self.forwards += 1
        name = self.layers[module]
        params = module._parameters  # what fastmm.nn.Linear.forward reads
        for pname, shape in (("weight", (module.out_features, module.in_features)), ("bias", (module.out_features,))):
            p = params.get(pname)
            if p is None and pname == "bias":
                continue
            if p is None or not self.fastmm.nn.plain_tensor(p):
                self.bad.append(f"{name}.{pname} is a {type(p).__name__} in forward, not a plain tensor")
            elif tuple(p.shape) != shape or p.untyped_storage().nbytes() < p.numel() * p.element_size():
                self.bad.append(f"{name}.{pname} has shape {tuple(p.shape)} (storage "
                                f"{p.untyped_storage().nbytes()} bytes) in forward, expected {shape}")
        if self.explain and name not in self.kernels and args and isinstance(args[0], torch.Tensor):
            x, w = args[0], params.get("weight")
            try:
                exp = self.fastmm.explain(x.reshape(-1, x.shape[-1]), w.t(), precision=self.precision)
                self.kernels[name] = exp.kernel or f"torch ({exp.fallback})"
            except Exception as exc:  # explain is a report: it must not stop the check
                self.kernels[name] = f"? ({type(exc).__name__}: {exc})"

    def remove(self) -> dict:
        for h in self.handles:
            h.remove()
        self.ops.linear_eager, self.ops._Linear.backward = self.orig_eager, staticmethod(self.orig_backward)
        return {"layers": len(self.layers), "forwards": self.forwards, "eager": self.eager,
                "backwards": self.backwards, "bad": self.bad[:10], "kernels": self.kernels}


def local_grads(model) -> dict:
    """This rank's shards of the gradients (FSDP2: DTensors sharded on dim 0), by parameter name."""
    return {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def grad_diff(grads: dict, ref: dict, device) -> dict:
    """Relative Frobenius difference of the full gradients (every rank's shards together) against
    ``ref``'s: over all parameters, and the parameter where it is largest."""
    import torch.distributed as dist

    names = sorted(ref)
    sums = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
    for i, n in enumerate(names):
        if n in grads:
            sums[i, 0] = (grads[n].double() - ref[n].double()).pow(2).sum()
        else:
            sums[i, 0] = ref[n].double().pow(2).sum()
        sums[i, 1] = ref[n].double().pow(2).sum()
    missing = sorted(set(grads) ^ set(ref))
    dist.all_reduce(sums)
    sums = sums.cpu()
    per = [(sums[i, 0].sqrt() / sums[i, 1].sqrt()).item() if sums[i, 1] > 0 else sums[i, 0].sqrt().item()
           for i in range(len(names))]
    worst = max(range(len(names)), key=lambda i: per[i])
    return {"all": (sums[:, 0].sum().sqrt() / sums[:, 1].sum().sqrt()).item(), "worst": per[worst],
            "worst_param": names[worst], "missing": missing}


def run_one(base, label: str, precision: str | None, torch_prec: str, mine, device, opts, fully_shard,
            ref_grads: dict | None) -> dict:
    """One training run of a fresh copy of ``base``: losses (averaged over the ranks), step times,
    the first warm-up pass's gradients (kept on the reference runs; compared with ``ref_grads``
    where given), probes on fastmm runs."""
    import torch.distributed as dist

    import fastmm
    from fastmm.precision import torch_allows_tf32, torch_precision

    model = copy.deepcopy(base)
    if precision is not None:
        model = fastmm.patch(model, precision=precision)  # before fully_shard
    model = model.to(device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.train()
    params = list(model.parameters())
    if opts["optim"] == "adamw":
        opt = torch.optim.AdamW(params, lr=opts["lr"], weight_decay=0.01)
    else:
        opt = torch.optim.SGD(params, lr=opts["lr"])
    cuda = device.type == "cuda"
    out = {"label": label, "precision": precision}
    with torch_precision(torch_prec):
        out["torch_tf32"] = torch_allows_tf32()
        if torch_prec != "tf32" and out["torch_tf32"]:
            raise RuntimeError(f"{label}: torch's fp32 matmul still allows TF32")
        x0 = mine[0].to(device)
        for i in range(opts["warmup"]):
            probes = Probes(model, precision, explain=cuda) if precision is not None and i == 0 else None
            try:
                model(input_ids=x0, labels=x0).loss.backward()
            finally:
                if probes is not None:
                    out["probes"] = probes.remove()
            if i == 0:  # the gradients at the initial weights: the same batch and weights in every run
                grads = local_grads(model)
                if ref_grads is not None:
                    out["grad0"] = grad_diff(grads, ref_grads, device)
                if label in ("torch", "torch tf32"):
                    out["grads"] = grads
                del grads
            opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        losses, times = [], []
        for ids in mine:
            ids = ids.to(device)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            if cuda:
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                times.append(1e3 * (time.perf_counter() - t0))
            losses.append(loss.detach())
    world = dist.get_world_size()
    loss_t = torch.stack(losses).double()
    dist.all_reduce(loss_t)  # summed over the ranks (equal token counts): / world is the global mean loss
    time_t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(time_t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    out["loss"] = (loss_t / world).tolist()
    out["step_ms"] = time_t.tolist()
    out["median_ms"] = statistics.median(out["step_ms"])
    out["param_numel"] = sum(p.numel() for p in params)
    out["local_numel"] = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    out["sharded"] = all(type(p).__name__ == "DTensor" for p in params)
    del model, opt, params, losses, loss
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return out


def worker(rank: int, world: int, port: int, precisions, size, opts: dict, outdir: str, cpu: bool) -> None:
    import torch.distributed as dist

    from fastmm.runtime.cache import default_cache

    if cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    device = init_rank(rank, world, port, cpu)
    fully_shard = fully_shard_fn()
    result = {"rank": rank, "runs": {}}
    try:
        base = build_model(size)
        per = size[6] // world
        mine = [x[rank * per:(rank + 1) * per] for x in global_batches(size, opts["steps"])]
        runs, ref_of = [], {"torch again": "torch", "fastmm tf32": "torch tf32"}
        ref_of.update({f"fastmm {p}": "torch" for p in ("ieee", "tf32x3")})
        grads_of = {}
        if any(p in ("ieee", "tf32x3") for p in precisions):
            runs += [("torch", None, "ieee"), ("torch again", None, "ieee")]
        runs += [(f"fastmm {p}", p, p) for p in precisions if p != "tf32"]
        if "tf32" in precisions:
            runs += [("torch tf32", None, "tf32"), ("fastmm tf32", "tf32", "tf32")]
        for i, (label, precision, torch_prec) in enumerate(runs):
            try:
                out = run_one(base, label, precision, torch_prec, mine, device, opts, fully_shard,
                              grads_of.get(ref_of.get(label)))
                if "grads" in out:
                    grads_of[label] = out.pop("grads")
                result["runs"][label] = out
            except Exception as exc:
                if cpu and i == 0:  # the unpatched model: FSDP2 itself does not run here
                    result["unsupported"] = f"{type(exc).__name__}: {exc}"
                    (Path(outdir) / f"unsupported{rank}.txt").write_text(traceback.format_exc())
                    return
                raise
        result["compiles"] = default_cache().compiles
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def rel_diffs(got: list[float], ref: list[float]) -> list[float]:
    return [abs(g - r) / abs(r) if r else abs(g - r) for g, r in zip(got, ref)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precisions", default="ieee,tf32x3",
                    help="comma list of ieee, tf32x3, tf32 (default ieee,tf32x3; tf32 is compared with torch's TF32)")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed forward+backward passes before the steps, no optimizer step (default 2, at least 1)")
    ap.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default: AdamW 1e-3, SGD 0.1)")
    ap.add_argument("--batch", type=int, default=None, help="global batch in sequences (default 8; --tiny 4)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 512; --tiny 32)")
    ap.add_argument("--world", type=int, default=2, help="processes (one GPU each; default 2)")
    ap.add_argument("--tiny", action="store_true", help="a toy-sized model and batch (a smoke run)")
    ap.add_argument("--cache-dir", default=None,
                    help="the shared kernel cache (default: a fresh temporary folder, so the ranks compile at once)")
    ap.add_argument("--json", default=None, help="write the report here as JSON")
    ap.add_argument("--cpu", action="store_true",
                    help="gloo on CPU processes (no GPU needed; fastmm hands the products to torch): checks this "
                    "script and FSDP2 with fastmm's layers, not the kernels; implies --tiny")
    args = ap.parse_args(argv)
    precisions = [p for p in args.precisions.split(",") if p]
    if not precisions or any(p not in TOL for p in precisions):
        ap.error(f"--precisions: a comma list of {', '.join(TOL)}")
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be at least 1")
    tiny = args.tiny or args.cpu
    size = list(SIZES["tiny" if tiny else "default"])
    size[6] = args.batch or size[6]
    size[7] = args.seq or size[7]
    size = tuple(size)
    if size[6] % args.world:
        ap.error("--batch must be a multiple of --world")
    opts = {"steps": args.steps, "warmup": args.warmup, "optim": args.optim,
            "lr": args.lr if args.lr is not None else (1e-3 if args.optim == "adamw" else 0.1)}

    if not args.cpu and (not torch.cuda.is_available() or torch.cuda.device_count() < args.world):
        print(f"fsdp2_check: needs {args.world} CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        return 2
    import torch.distributed as dist

    if not dist.is_available() or not (dist.is_gloo_available() if args.cpu else dist.is_nccl_available()):
        print(f"fsdp2_check: torch.distributed with {'gloo' if args.cpu else 'NCCL'} is not available in this torch build")
        return 2
    if fully_shard_fn() is None:
        print(f"fsdp2_check: torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard)")
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"fsdp2_check: needs transformers (pip install 'fastmm[models]'): {exc}")
        return 2

    # the spawned processes inherit this environment
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    tmp = tempfile.TemporaryDirectory(prefix="fastmm-fsdp2-")
    cache_dir = Path(args.cache_dir) if args.cache_dir else Path(tmp.name) / "kernel-cache"
    os.environ["FASTMM_CACHE_DIR"] = str(cache_dir)
    outdir = Path(tmp.name) / "results"
    outdir.mkdir()

    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    try:
        mp.spawn(worker, args=(args.world, free_port(), precisions, size, opts, str(outdir), args.cpu),
                 nprocs=args.world, join=True)
    except Exception as exc:  # a rank failed: its traceback is in the exception
        print(f"fsdp2_check: a rank failed: {type(exc).__name__}: {exc}")
        return 1
    seconds = time.perf_counter() - t0
    unsupported = sorted(outdir.glob("unsupported*.txt"))
    if unsupported:
        print(unsupported[0].read_text())
        print(f"fsdp2_check: FSDP2 (fully_shard) could not train the unpatched model on CPU processes with gloo "
              f"in torch {torch.__version__} (traceback above): --cpu cannot check anything with this torch; "
              f"run it on 2 GPUs")
        return 2
    ranks = [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(args.world)]
    runs = ranks[0]["runs"]

    H, L, NH, KV, F, V, B, S = size
    report = {"device": "cpu (gloo)" if args.cpu else "cuda (nccl)", "torch": torch.__version__, "world": args.world,
              "model": dict(hidden=H, layers=L, heads=NH, kv_heads=KV, intermediate=F, vocab=V,
                            params=runs["torch" if "torch" in runs else "torch tf32"]["param_numel"]),
              "global_batch": B, "seq": S, "steps": args.steps, "warmup": args.warmup, "optim": opts["optim"],
              "lr": opts["lr"], "seconds": round(seconds, 1), "cache_dir": str(cache_dir),
              "runs": {k: {kk: vv for kk, vv in v.items() if kk != "probes"} for k, v in runs.items()},
              "precisions": {}, "probes": {}, "ok": True, "problems": []}

    def problem(text):
        report["ok"] = False
        report["problems"].append(text)

    for label, r in runs.items():
        if not all(math.isfinite(x) for x in r["loss"]):
            problem(f"{label}: a loss is not finite: {r['loss']}")
        if not r["sharded"]:
            problem(f"{label}: not every parameter is a DTensor after fully_shard")
    for label in ("torch", "torch tf32"):
        if label in runs and args.steps >= 2 and not runs[label]["loss"][-1] < runs[label]["loss"][0]:
            problem(f"{label}: the loss did not fall over the steps: {runs[label]['loss']}")
    if "torch again" in runs:
        report["torch_run_to_run"] = max(rel_diffs(runs["torch again"]["loss"], runs["torch"]["loss"]))
    for precision in precisions:
        ref, mine = runs[REF[precision]], runs[f"fastmm {precision}"]
        diffs = rel_diffs(mine["loss"], ref["loss"])
        worst = max(diffs)
        tol = TOL[precision]
        for step, e in enumerate(diffs):
            if not e <= tol:
                problem(f"{precision} step {step}: loss {mine['loss'][step]:.8g} vs {REF[precision]} "
                        f"{ref['loss'][step]:.8g} (rel. {e:.2e} > {tol:.0e})")
        g0 = mine.get("grad0")
        if g0 is None:
            problem(f"{precision}: the first pass's gradients were not compared")
        else:
            if not g0["worst"] <= GRAD_TOL[precision]:
                problem(f"{precision}: step-0 gradient of {g0['worst_param']} rel. difference {g0['worst']:.2e} "
                        f"> {GRAD_TOL[precision]:.0e} (all parameters together {g0['all']:.2e})")
            if g0["missing"]:
                problem(f"{precision}: gradients present in only one of the runs: {g0['missing'][:5]}")
        report["precisions"][precision] = {"reference": REF[precision], "max_rel_diff": worst, "rel_diff": diffs,
                                           "tolerance": tol, "grad0": g0, "grad_tolerance": GRAD_TOL[precision],
                                           "torch_ms": ref["median_ms"],
                                           "fastmm_ms": mine["median_ms"],
                                           "ratio": ref["median_ms"] / mine["median_ms"]}
        for rk in ranks:
            pr = rk["runs"][f"fastmm {precision}"].get("probes")
            if pr is None:
                problem(f"fastmm {precision} rank {rk['rank']}: the probes did not run")
                continue
            report["probes"].setdefault(precision, {})[rk["rank"]] = pr
            n = pr["layers"]
            if n == 0 or pr["forwards"] != n or pr["eager"] != n or pr["backwards"] != n:
                problem(f"fastmm {precision} rank {rk['rank']}: {n} fastmm.nn.Linear layers, but one pass made "
                        f"{pr['forwards']} forwards, {pr['eager']} fastmm op calls, {pr['backwards']} fastmm backwards")
            for text in pr["bad"]:
                problem(f"fastmm {precision} rank {rk['rank']}: {text}")
            if not args.cpu:
                on_torch = sorted(k for k, v in pr["kernels"].items() if v.startswith(("torch", "?")))
                if on_torch:
                    problem(f"fastmm {precision} rank {rk['rank']}: layers not on a fastmm kernel: "
                            + ", ".join(f"{k} {pr['kernels'][k]}" for k in on_torch[:5]))

    from fastmm.runtime.cache import DiskCache

    if cache_dir.is_dir():
        results = DiskCache(cache_dir).verify()
        bad = [p.name for p, ok in results if not ok]
        leftovers = sorted(p.name for p in cache_dir.glob("*.tmp")) + sorted(p.name for p in cache_dir.glob(".*.tmp"))
    else:
        results, bad, leftovers = [], [], []
    report["cache"] = {"entries": len(results), "bad": bad, "temp_files_left": leftovers,
                       "compiles_per_rank": [r["compiles"] for r in ranks]}
    if bad or leftovers:
        problem(f"shared cache: bad entries {bad}, temporary files left {leftovers}")

    # the report, table last
    m = report["model"]
    unit = "ms (CUDA events)" if not args.cpu else "ms (wall)"
    print(f"fsdp2_check ({report['device']}, torch {torch.__version__}): {args.world} ranks, fully_shard per decoder "
          f"layer + root; LlamaForCausalLM {m['params'] / 1e6:.1f}M params (hidden {H}, {L} layers, {NH} heads, {KV} kv "
          f"heads, intermediate {F}, vocab {V}); global batch {B} x {S} tokens; {args.steps} {opts['optim']} steps "
          f"(lr {opts['lr']:g}) after {args.warmup} warm-up passes; {report['seconds']:.1f} s in all")
    if "torch_run_to_run" in report:
        print(f"  torch run to run: max rel. loss difference {report['torch_run_to_run']:.1e}")
    for precision, pr_ranks in report["probes"].items():
        pr = pr_ranks[0]
        kinds = {}
        for v in pr["kernels"].values():
            kinds[v] = kinds.get(v, 0) + 1
        print(f"  probes fastmm {precision} (rank 0): {pr['layers']} fastmm.nn.Linear; one pass: {pr['forwards']} forwards "
              f"with full-shape plain weights, {pr['eager']} fastmm op calls, {pr['backwards']} fastmm backwards"
              + ("; kernels " + ", ".join(f"{k} x{c}" for k, c in sorted(kinds.items())) if kinds else ""))
    c = report["cache"]
    print(f"  cache: {c['entries']} entries, {len(c['bad'])} bad, {len(c['temp_files_left'])} temp files left; "
          f"compiles per rank {c['compiles_per_rank']}")
    for text in report["problems"]:
        print(f"  MISMATCH: {text}")
    print()
    print(f"{'run':<14} {'loss[0]':>9} {'loss[-1]':>9} {'loss diff':>9} {'tol':>6} {'grad0 diff':>10} {'tol':>6} "
          f"{'vs':<10} {'median step ' + unit:>24} {'torch/fastmm':>12}")
    for label, r in runs.items():
        row = f"{label:<14} {r['loss'][0]:>9.5f} {r['loss'][-1]:>9.5f} "
        prec, g0 = r["precision"], r.get("grad0")
        if prec is not None:
            p = report["precisions"][prec]
            row += f"{p['max_rel_diff']:>9.1e} {p['tolerance']:>6.0e} "
            row += (f"{g0['worst']:>10.1e} " if g0 else f"{'-':>10} ") + f"{p['grad_tolerance']:>6.0e} "
            row += f"{p['reference']:<10} {r['median_ms']:>24.2f} {p['ratio']:>11.3f}x"
        elif label == "torch again":
            row += f"{report['torch_run_to_run']:>9.1e} {'-':>6} " + (f"{g0['worst']:>10.1e} " if g0 else f"{'-':>10} ")
            row += f"{'-':>6} {'torch':<10} {r['median_ms']:>24.2f} {'-':>12}"
        else:
            row += f"{'-':>9} {'-':>6} {'-':>10} {'-':>6} {'':<10} {r['median_ms']:>24.2f} {'-':>12}"
        print(row)
    print("(loss diff: largest relative difference of a step's loss; grad0 diff: largest relative difference of one "
          "parameter's gradient in the first pass, at the initial weights)")
    if args.cpu:
        print("(--cpu: fastmm hands CPU products to torch, so the differences are 0 and the times compare nothing)")
    print("fsdp2_check: " + ("OK" if report["ok"] else "FAILED"))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    tmp.cleanup()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
