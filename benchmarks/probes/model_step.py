#!/usr/bin/env python3
"""Where a model's training step spends its time, torch against ``fastmm.patch``: is the step
bound by the host (enqueueing) or by the GPU, and, on the host, which code takes the time.

    PYTHONPATH=. python benchmarks/probes/model_step.py [--models llama,bert] [--precisions tf32]
        [--steps 10] [--top 25] [--pieces] [--kernels 20] [--tokens 8192] [--compile]

Per model and precision, for each side: the step time (CUDA events, as ``models.py``), the host
time to enqueue one step with the GPU kept busy ahead (a sleep kernel queued first: a step that
synchronizes shows it as host time close to the step time), the GPU's kernel time per step (the
profiler's kernel events summed) and the number of kernels. Then cProfile of the patched model's
steps: own time per step by file (fastmm's modules, torch's autograd, cuda.core) and the top
functions. ``--pieces``: the host cost of each piece of one patched Linear call on the GPU
(allocation, the stream, the key, the launch, the autograd.Function apply). ``--compile``: the
same numbers again with both sides under ``torch.compile``. Models come from
``benchmarks/models.py`` (needs ``transformers``).
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE), str(HERE.parent)]  # the repo, this folder, benchmarks/

import torch  # noqa: E402

import fastmm  # noqa: E402
from fastmm.precision import torch_precision  # noqa: E402
from probe_util import enqueue_us, need_gpu, own_time_by_group  # noqa: E402


def one_step(model, batch, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_fn(model(**batch)).backward()


def step_numbers(model, batch, loss_fn, steps: int) -> dict:
    for _ in range(3):
        one_step(model, batch, loss_fn)
    torch.cuda.synchronize()
    ev = []
    for _ in range(steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        one_step(model, batch, loss_fn)
        e.record()
        ev.append((s, e))
    torch.cuda.synchronize()
    step = statistics.median(s.elapsed_time(e) for s, e in ev)
    host = []
    for _ in range(steps):
        torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU work ahead: the step only enqueues
        t0 = time.perf_counter()
        one_step(model, batch, loss_fn)
        host.append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            one_step(model, batch, loss_fn)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kernels) / 3
    return {"step_ms": step, "host_ms": statistics.median(host), "gpu_ms": gpu_us / 1e3, "kernels": len(kernels) / 3}


def kernel_table(model, batch, loss_fn, label: str, top: int, trace: str | None) -> None:
    """The step's GPU kernels by total time (one step after warm-up), and a chrome trace of it."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        one_step(model, batch, loss_fn)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        one_step(model, batch, loss_fn)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    busy = sum(e.device_time for e in kernels)
    span = kernels[-1].time_range.end - kernels[0].time_range.start if kernels else 0
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_name[e.name[:90]][0] += e.device_time
        by_name[e.name[:90]][1] += 1
    print(f"  {label}: kernels {len(kernels)}, busy {busy / 1e3:.2f} ms of a {span / 1e3:.2f} ms span")
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {t / 1e3:8.3f} ms {n:4d}x  {name}")
    print(f"  {label}: host ops by total CPU time (profiler's, inflated by it), one step:")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=top, max_name_column_width=60))
    if trace:
        prof.export_chrome_trace(f"{trace}/{label.replace(' ', '_')}.json")


def profile_host(model, batch, loss_fn, steps: int, top: int, sort: str = "tottime") -> None:
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(steps):
        one_step(model, batch, loss_fn)
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    by_file = own_time_by_group(stats)
    print("  own time per step, ms (cProfile's, inflated by it):")
    for k, v in by_file.most_common(16):
        print(f"    {1e3 * v / steps:7.3f}  {k}")
    stats.sort_stats(sort).print_stats(top)


def pieces() -> None:
    """Host us of each piece of a patched Linear's call, [4,256,1024] @ W^T, W [2816,1024]."""
    from fastmm import dispatch, fast_path, ops
    from fastmm.runtime import launcher

    ref = torch.nn.Linear(1024, 2816, device="cuda")
    fm = fastmm.nn.Linear.from_linear(ref, precision="tf32")
    x = torch.randn(4, 256, 1024, device="cuda")
    xg = x.clone().requires_grad_()
    w, bias = ref.weight, ref.bias
    wt = w.t()
    with torch.no_grad():
        fm(x)
    key = fast_path.fused_key(x, wt, bias, 1, 1, "tf32")
    entry = fast_path.ENTRIES.get(key)
    rows = [
        ("torch.empty (1024, 2816)", lambda: torch.empty((4, 256, 2816), device="cuda")),
        ("torch.cuda.current_device()", torch.cuda.current_device),
        ("dispatch.current_stream(0)", lambda: dispatch.current_stream(0)),
        ("w.t()", w.t),
        ("fast_path.key_of", lambda: fast_path.key_of(x, wt, None, "tf32")),
        ("fast_path.fused_key", lambda: fast_path.fused_key(x, wt, bias, 1, 1, "tf32")),
        ("torch.is_grad_enabled()", torch.is_grad_enabled),
        ("ops.tracing_or_in_dispatch_mode()", ops.tracing_or_in_dispatch_mode),
        ("fastmm.resolve_precision(None)", lambda: fastmm.resolve_precision(None)),
    ]
    if type(entry) is fast_path.FastEntry and entry.runner is None:
        stream = dispatch.current_stream(0)
        c = torch.empty((4, 256, 2816), device="cuda")
        args = (x.data_ptr(), wt.data_ptr(), c.data_ptr()) + entry.tail + (bias.data_ptr(),) + entry.epi_tail
        rows.append(("launcher.launch (cuda.core)", lambda: launcher.launch(entry.kernel, stream, args)))
        rows.append(("fast_path.launch (alloc + launch)", lambda: fast_path.launch(entry, x.data_ptr(), wt.data_ptr(), None, 0, bias)))
    else:
        print(f"  (the Linear's entry is {entry!r}: no single-launch pieces)")
    # what a compiled graph calls: the registered op (the dispatcher, then ops._direct_kernel),
    # its body alone, and inductor's extern call for torch's side (addmm into a buffer)
    x2, out = x.view(1024, 1024), torch.empty((1024, 2816), device="cuda")
    no_grad_rows = [
        ("fastmm.nn.Linear, no grad", lambda: fm(x)), ("torch nn.Linear, no grad", lambda: ref(x)),
        ("torch.ops.fastmm.linear.default, no grad", lambda: torch.ops.fastmm.linear.default(x2, w, bias, "tf32")),
        ("ops.linear_body", lambda: ops.linear_body(x2, w, bias, "tf32")),
        ("torch.ops.fastmm.matmul.default (g @ W)", lambda: torch.ops.fastmm.matmul.default(out, w, "tf32")),
        ("ops.matmul_body (g @ W)", lambda: ops.matmul_body(out, w, "tf32")),
        ("torch.addmm(bias, x, W^T, out=)", lambda: torch.addmm(bias, x2, wt, out=out)),
        ("torch.ops.aten.addmm.default", lambda: torch.ops.aten.addmm.default(bias, x2, wt)),
        ("torch.ops.aten.mm.default (g @ W)", lambda: torch.ops.aten.mm.default(out, w)),
    ]
    rows += [("fastmm.nn.Linear, with grad", lambda: fm(xg)), ("torch nn.Linear, with grad", lambda: ref(xg)),
             ("ops._Linear.apply", lambda: ops._Linear.apply(xg, w, bias, "tf32")),
             ("torch.addmm with grad", lambda: torch.addmm(bias, xg.view(1024, 1024), wt)),
             ("torch.ops.fastmm.linear.default, with grad", lambda: torch.ops.fastmm.linear.default(x2, w, bias, "tf32"))]
    for what, fn in rows:
        print(f"  {what:<44} {enqueue_us(fn, 400):8.2f} us")
    with torch.no_grad():
        for what, fn in no_grad_rows:
            print(f"  {what:<44} {enqueue_us(fn, 400):8.2f} us")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="model_step.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama")
    ap.add_argument("--precisions", default="tf32")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--pieces", action="store_true")
    ap.add_argument("--kernels", type=int, default=0, help="list the step's top N kernels of each side")
    ap.add_argument("--trace", help="with --kernels: write each side's chrome trace of one step here")
    ap.add_argument("--no-cprofile", action="store_true")
    ap.add_argument("--sort", default="tottime", help="cProfile's order: tottime (own) or cumulative")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens a training step (models.py's --tokens)")
    ap.add_argument("--compile", action="store_true",
                    help="both sides under torch.compile (default mode) as well, after their eager numbers")
    ap.add_argument("--only-compiled", action="store_true", help="with --compile: leave the eager numbers out")
    ap.add_argument("--routing", choices=("default", "no-sdpa", "modules"), default="default",
                    help="the patched side's functional routing: patch's default; the same with SDPA left to "
                         "torch (its math path too: the attention module then loses its hooks); modules only "
                         "(patch(functional=False))")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    warnings.filterwarnings("ignore")
    import copy

    import models

    if o.pieces:
        print("pieces of one patched Linear call (host us, GPU busy ahead):")
        pieces()
    if o.routing == "no-sdpa":
        from fastmm import patching
        patching.takes_math_path = lambda *args: False
    functional = o.routing != "modules"
    for name in o.models.split(","):
        model, batch, loss_fn, _ = models.build(name, tokens=o.tokens)
        model = model.cuda().train()
        batch = {k: v.cuda() for k, v in batch.items()}
        patched = fastmm.patch(copy.deepcopy(model), functional=functional)
        for precision in o.precisions.split(","):
            # (as models.py: modules and routing at the row's precision)
            patched = fastmm.patch(patched, precision=precision, functional=functional)
            with torch_precision(precision):
                sides = [] if o.compile and o.only_compiled else [("", model, patched)]
                if o.compile:
                    torch._dynamo.reset()
                    sides.append((" compiled", torch.compile(model), torch.compile(patched)))
                for how, tm, fm in sides:
                    t = step_numbers(tm, batch, loss_fn, o.steps)
                    f = step_numbers(fm, batch, loss_fn, o.steps)
                    print(f"\n{name} {precision}{how}: " + "; ".join(
                        f"{side}: step {r['step_ms']:.2f} ms, host {r['host_ms']:.2f} ms, GPU {r['gpu_ms']:.2f} ms, "
                        f"{r['kernels']:.0f} kernels" for side, r in (("torch", t), ("fastmm", f))), flush=True)
                    if o.kernels:
                        kernel_table(tm, batch, loss_fn, f"{name} {precision}{how} torch", o.kernels, o.trace)
                        kernel_table(fm, batch, loss_fn, f"{name} {precision}{how} fastmm", o.kernels, o.trace)
                    if not o.no_cprofile:
                        profile_host(fm, batch, loss_fn, o.steps, o.top, o.sort)
        del model, patched
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
