"""Compile every skinny variant of skinny_variants.py (beside this file; the sm_90 default is one
of them) for sm_75/80/86/89/90 with NVRTC and report ptxas registers, stack and spills (CPU
only, no GPU):

    python benchmarks/probes/skinny_v2_ptxas.py [--quick]

--quick: decode16 only (16x4096x4096). Exit status 1 if anything fails to compile or spills."""
from __future__ import annotations

import argparse
import io
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

from fastmm.problem import DeviceFacts, Problem  # noqa: E402
from fastmm.runtime.compiler import _cuda_core  # noqa: E402
from fastmm.runtime.sources import read_source, source_dir  # noqa: E402
from skinny_variants import VARIANTS  # noqa: E402

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")


def ptxas(macros, arch):
    core = _cuda_core()  # imported once, under fastmm's lock (a racy first import fails)
    Program, ProgramOptions = core.Program, core.ProgramOptions
    opts = ProgramOptions(name="skinny.cu", arch=arch, std="c++17", include_path=[str(source_dir())],
                          define_macro=[(k, str(v)) for k, v in macros] or None, ptxas_options=["-v"])
    log = io.StringIO()
    try:
        Program(read_source("skinny.cu"), "c++", opts).compile("cubin", logs=log)
    except Exception as exc:  # report, keep going
        return None, f"{exc} {log.getvalue()}"[:2000]
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    stack = re.search(r"(\d+) bytes stack frame", text)
    return (int(regs.group(1)), int(stack.group(1)), int(spill.group(1)) + int(spill.group(2))), None


def problems(quick):
    """The problems of skinny_variants.py (its checks and timings) and a few more layouts."""
    if quick:
        return [Problem.dense(16, 4096, 4096)]
    out = [Problem.dense(m, n, k) for m in (1, 2, 3, 8, 16, 17, 32) for n, k in ((4096, 4096), (4095, 4093), (1000, 333))]
    out += [Problem.dense(16, 8192, 8192), Problem.dense(16, 1000, 333, batch=3), Problem.dense(5, 4096, 1024, batch=3),
            Problem.dense(16, 1000, 333, b_t=True), Problem.dense(17, 4096, 4096, a_t=True),
            Problem.dense(32, 4096, 4096, a_t=True, b_t=True), Problem.dense(32, 1024, 1024, align=4)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="skinny_v2_ptxas.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="decode16 only")
    quick = ap.parse_args(argv).quick
    jobs = {}
    notes = []
    for arch in ARCHS:
        dev = DeviceFacts.simulated_device(arch)
        for p in problems(quick):
            for name, fam in VARIANTS:
                try:
                    cfg = fam.configure(p, dev)
                except ValueError as exc:
                    notes.append(f"{arch} {name} M={p.M}: not available ({exc})")
                    continue
                jobs.setdefault((arch, cfg.macros), (name, p.M, cfg.smem))
    print(f"compiling {len(jobs)} kernels ...", flush=True)
    with ThreadPoolExecutor(os.cpu_count() or 2) as ex:
        results = dict(zip(jobs, ex.map(lambda k: ptxas(k[1], k[0]), jobs)))
    bad = 0
    for (arch, macros), (res, err) in sorted(results.items(), key=lambda kv: (kv[0][0], jobs[kv[0]][0], str(kv[0][1]))):
        name, m, smem = jobs[(arch, macros)]
        short = " ".join(f"{k}={v}" for k, v in macros if k not in ("SK_V2",))
        if err:
            bad += 1
            print(f"FAIL {arch} {name}: {short}\n  {err}")
            continue
        regs, stack, spills = res
        flag = "" if spills == 0 and stack == 0 else "   <-- SPILLS/STACK"
        bad += bool(flag)
        print(f"{arch} {name:<22} regs {regs:3d} stack {stack:4d} spill {spills:4d} smem {smem:6d}  {short}{flag}")
    for n in sorted(set(notes)):
        print(n)
    print("failures:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
