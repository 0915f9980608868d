#!/usr/bin/env python3
"""Where a compiled model step's host time goes, torch against ``fastmm.patch``, both under
``torch.compile`` (default mode): the patched model as it is, and the same compiled graphs with
torch's arithmetic inside fastmm's op bodies (``F.linear`` / ``torch.matmul`` where fastmm's
planner and launches would run). The second isolates what the op structure costs (the
dispatcher's Python kernel, Dynamo's guards on the patched modules, the graph Inductor makes
around an opaque op) from what fastmm's bodies cost (keys, allocation, launches, staging copies).

    PYTHONPATH=. python benchmarks/probes/compiled_host.py [--models vit,bert] [--precisions tf32]
        [--tokens 1024] [--rounds 15]

Per side, the median over interleaved rounds of: the step (CUDA events, as models.py) and the
host time to enqueue one step with the GPU kept busy ahead (a sleep kernel queued first). Models
come from ``benchmarks/models.py`` (needs ``transformers``).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE), str(HERE.parent)]  # the repo, this folder, benchmarks/

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fastmm  # noqa: E402
from fastmm import fast_path, ops  # noqa: E402
from fastmm.precision import torch_precision  # noqa: E402
from model_step import one_step  # noqa: E402
from probe_util import need_gpu  # noqa: E402


def sample(model, batch, loss_fn) -> tuple[float, float]:
    """(step ms by CUDA events, host ms to enqueue a step behind queued GPU work)."""
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    one_step(model, batch, loss_fn)
    e.record()
    e.synchronize()
    torch.cuda._sleep(300_000_000)  # ~0.15 s of GPU work ahead: the next step only enqueues
    t0 = time.perf_counter()
    one_step(model, batch, loss_fn)
    host = 1e3 * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    return s.elapsed_time(e), host


class TorchBodies:
    """fastmm's op bodies compute with torch (the registered ops, their dispatch and the graphs
    around them unchanged): ``with TorchBodies():``."""

    def __enter__(self):
        self.saved = ops.compute_linear, ops.compute, fast_path.linear_backward
        ops.compute_linear = lambda x, w, b, precision: F.linear(x, w, b)
        ops.compute = lambda a, b, out, precision: torch.matmul(a, b)
        # (linear_grads' two products: the formula straight, without the entry fastmm's own
        # products leave, which torch's would look for on every call)
        fast_path.linear_backward = lambda g, x, w, precision, need_x, need_w, formula, in_out=False: formula()

    def __exit__(self, *exc):
        ops.compute_linear, ops.compute, fast_path.linear_backward = self.saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="compiled_host.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="vit,bert")
    ap.add_argument("--precisions", default="tf32")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=15)
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    warnings.filterwarnings("ignore")
    import models

    print(f"{'model':<8}{'prec':<7}{'side':<34}{'step ms':>9}{'host ms':>9}")
    for name in o.models.split(","):
        model, batch, loss_fn, _ = models.build(name, tokens=o.tokens)
        model = model.cuda().train()
        batch = {k: v.cuda() for k, v in batch.items()}
        patched = fastmm.patch(copy.deepcopy(model))
        for precision in o.precisions.split(","):
            patched = fastmm.patch(patched, precision=precision)
            torch._dynamo.reset()
            with torch_precision(precision):
                cm, cp = torch.compile(model), torch.compile(patched)
                sides = [("torch, eager", model, None), ("fastmm, eager", patched, None),
                         ("torch, compiled", cm, None), ("fastmm, compiled", cp, None),
                         ("fastmm, compiled, torch's bodies", cp, TorchBodies)]
                for _, m, bodies in sides:  # warm-up: compile, load, remember
                    for _ in range(3):
                        if bodies:
                            with bodies():
                                one_step(m, batch, loss_fn)
                        else:
                            one_step(m, batch, loss_fn)
                got = {label: [] for label, _, _ in sides}
                for r in range(o.rounds):
                    for label, m, bodies in (sides if r % 2 == 0 else sides[::-1]):
                        if bodies:
                            with bodies():
                                got[label].append(sample(m, batch, loss_fn))
                        else:
                            got[label].append(sample(m, batch, loss_fn))
                for label, _, _ in sides:
                    step = statistics.median(s for s, _ in got[label])
                    host = statistics.median(h for _, h in got[label])
                    print(f"{name:<8}{precision:<7}{label:<34}{step:9.2f}{host:9.2f}", flush=True)
        del model, patched
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
