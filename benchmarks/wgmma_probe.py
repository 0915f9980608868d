"""Kernel-only timing of the wgmma TF32 family and its tile options on the current GPU (sm_90),
next to torch.matmul with TF32 and the cost of the transposed copy of a row-major B.
A tuning aid: `python benchmarks/wgmma_probe.py`, table printed last."""
from __future__ import annotations

import dataclasses
import sys

import torch

sys.path.insert(0, ".")
from fastmm import api  # noqa: E402
from fastmm.families import FAMILIES, kmajor_source  # noqa: E402
from fastmm.runtime import launcher, tensor_map  # noqa: E402
from variants import time_ms  # noqa: E402  (benchmarks/variants.py, beside this script)

WG = FAMILIES["wgmma_tf32"]


def variant(cfg, p, bn, stages):
    m = dict(cfg.macros)
    m.update(BN=bn, STAGES=stages)
    tiles = -(-p.M // 128) * -(-p.N // bn)
    return dataclasses.replace(cfg, macros=tuple(m.items()), smem=WG.smem_bytes(bn, stages), tile=(128, bn, 32),
                               grid=(tiles, 1, cfg.grid[2]))


def main():
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for M, N, K in ((8192, 4096, 6144), (2048, 2048, 2048), (4097, 4095, 4093)):
        a = torch.randn(M, K, device="cuda")
        b = torch.randn(K, N, device="cuda")
        bt = b.t().contiguous().t()  # K-major view of the same values
        flop = 2 * M * N * K
        ref = a.double() @ b.double()
        c = torch.full((M, N), float("nan"), device="cuda")
        s = api.analyse(a, bt)
        p, _ = api.build_problem(s, c, "tf32")
        plan = api.plan_for(p, 0, force="wgmma_tf32")
        lp = plan.launch_problem or p
        stream = torch.cuda.current_stream().cuda_stream

        def checked_row(label, run):
            """Run once into a NaN-poisoned C for the error, then time it: one table row."""
            c.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            err = ((c.double() - ref).norm() / ref.norm()).item()
            ms = time_ms(run)
            rows.append((f"{M}x{N}x{K}", label, ms, flop / ms / 1e9, err))

        a_k, b_k = (a, bt) if not plan.staging else (None, None)
        if plan.staging:  # unaligned: time the kernel on the staged copies
            k4 = -(-K // 4) * 4
            a_k = torch.zeros(M, k4, device="cuda"); a_k[:, :K] = a
            b_k = torch.zeros(N, k4, device="cuda"); b_k[:, :K] = b.t()
        for bn, stages in ((256, 4), (128, 6)):
            cfg = variant(plan.kernel, lp, bn, stages)
            loaded = launcher.load(plan.device, cfg)
            spec_a, spec_b, bits = WG.map_specs(lp, cfg)
            maps = (tensor_map.encode(a_k.data_ptr(), spec_a), tensor_map.encode(b_k.data_ptr(), spec_b))
            args = (c.data_ptr(), M, N, K, *lp.c_strides, lp.batch_inner, lp.batch_total, *lp.c_batch_strides, bits)

            checked_row(f"wgmma BN{bn} S{stages}", lambda: launcher.launch_with_maps(loaded, stream, maps, args))
        ms = time_ms(lambda: torch.matmul(a, b))
        rows.append((f"{M}x{N}x{K}", "torch tf32", ms, flop / ms / 1e9, float("nan")))
        ms = time_ms(lambda: api.matmul(a, b, precision="tf32"))
        rows.append((f"{M}x{N}x{K}", "fastmm tf32 (B row-major)", ms, flop / ms / 1e9, float("nan")))
        ms = time_ms(lambda: api.matmul(a, bt, precision="tf32"))
        rows.append((f"{M}x{N}x{K}", "fastmm tf32 (B K-major)", ms, flop / ms / 1e9, float("nan")))
        s3 = api.analyse(a, b)
        p3, offs3 = api.build_problem(s3, c, "tf32x3")
        plan3 = api.plan_for(p3, 0, force="wgmma_tf32")
        for pe, comp in ((1, 2), (2, 2), (2, 1), (1, 1), (4, 2), (4, 1), (1, 0)):
            cfg = dataclasses.replace(plan3.kernel, macros=plan3.kernel.macros + (("PROMOTE_EVERY", pe), ("COMPENSATE", comp)))
            loaded = launcher.load(plan3.device, cfg)

            checked_row(f"tf32x3 every {pe} comp {comp}",
                        lambda: api._launch_wgmma(plan3, loaded, stream, s3, c, plan3.launch_problem, offs3))
        bufs = [torch.empty(2, r, k4, device="cuda") for _, r, k4 in plan3.staging]

        def split_only():
            for (which, rows_, cols), stager, buf in zip(plan3.staging, plan3.stagers, bufs):
                _, sr, sk, _ = kmajor_source(p3, which)
                ptr = a.data_ptr() if which == "a" else b.data_ptr()
                launcher.launch(launcher.load(plan3.device, stager), stream,
                                (ptr, buf[0].data_ptr(), buf[1].data_ptr(), rows_, K, sr, sk, cols, 1, 1, 0, 0))
        ms = time_ms(split_only)
        rows.append((f"{M}x{N}x{K}", "tf32x3 split pass alone", ms, float("nan"), float("nan")))
        x3 = api.matmul(a, b, precision="tf32x3")
        err = ((x3.double() - ref).norm() / ref.norm()).item()
        ms = time_ms(lambda: api.matmul(a, b, precision="tf32x3"))
        rows.append((f"{M}x{N}x{K}", "fastmm tf32x3", ms, flop / ms / 1e9, err))
        torch.backends.cuda.matmul.allow_tf32 = False
        f32 = torch.matmul(a, b)
        err = ((f32.double() - ref).norm() / ref.norm()).item()
        ms = time_ms(lambda: torch.matmul(a, b))
        rows.append((f"{M}x{N}x{K}", "torch fp32", ms, flop / ms / 1e9, err))
        torch.backends.cuda.matmul.allow_tf32 = True
        del x3, f32
        buf = torch.empty(N, K, device="cuda")
        ms = time_ms(lambda: buf.copy_(b.t()))
        rows.append((f"{M}x{N}x{K}", "B^T copy alone", ms, float("nan"), float("nan")))
    import time
    for n in (1000, 2048):
        a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
        for prec in ("ieee", "tf32", "tf32x3"):
            api.matmul(a, b, precision=prec)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                api.matmul(a, b, precision=prec)
            host = (time.perf_counter() - t0) / 50 * 1e3
            torch.cuda.synchronize()
            gpu = time_ms(lambda: api.matmul(a, b, precision=prec))
            rows.append((f"{n}^3 {prec}", f"host ms/call {host:.3f}", gpu, 2 * n**3 / gpu / 1e9, float("nan")))
    print(f"{'shape':<18} {'what':<28} {'ms':>8} {'TFLOP/s':>8} {'rel err':>9}")
    for shape, what, ms, tf, err in rows:
        print(f"{shape:<18} {what:<28} {ms:8.3f} {tf:8.1f} {err:9.2e}")


if __name__ == "__main__":
    main()
