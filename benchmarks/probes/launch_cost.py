"""Host cost of the pieces of a fastmm call, microseconds each (wall clock over back-to-back
calls, not synchronized in between): the tensor-map launch of a wgmma kernel and its parts
(cuLaunchKernel through ctypes, the parameter arrays, encoding or looking up the tensor maps),
an allocation, the fast-path key, and whole calls of fastmm.matmul and torch.matmul:

    python benchmarks/probes/launch_cost.py [--n N]

The wgmma pieces need sm_90 (elsewhere they are skipped).
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

import fastmm  # noqa: E402
from fastmm import dispatch, fast_path  # noqa: E402
from fastmm.families import FAMILIES  # noqa: E402
from fastmm.runtime import launcher, tensor_map  # noqa: E402
from probe_util import enqueue_us, need_gpu  # noqa: E402

N_CALLS = 500  # (fewer than the ~1000 launches a stream queues before the host waits)


def bench(name, fn, n=None):
    print(f"{name:<44} {enqueue_us(fn, n or N_CALLS):7.2f} us")


def wgmma_pieces(a, b):
    """The launch of a planned wgmma kernel taken apart (a @ b, tf32, no staging copies)."""
    c, plan, reason = dispatch.matmul_fastmm(a, b, None, "tf32", force="wgmma_tf32")
    if reason is not None or plan.staging:
        print(f"wgmma pieces skipped: {reason or 'the plan stages an operand'}")
        return
    loaded = launcher.load(plan.device, plan.kernel)
    p = plan.launch_problem or plan.problem
    spec_a, spec_b, bits = FAMILIES["wgmma_tf32"].map_specs(p, plan.kernel)
    first, second = (b, a) if plan.swap_ab else (a, b)  # the kernel's A is B where it computes C^T = B^T A^T
    maps = (tensor_map.encode(first.data_ptr(), spec_a), tensor_map.encode(second.data_ptr(), spec_b))
    args = (c.data_ptr(), p.M, p.N, p.K, *p.c_strides, p.batch_inner, p.batch_total, *p.c_batch_strides, bits)
    stream = dispatch.current_stream(plan.device.index)
    print(f"wgmma: {plan.kernel.describe()}{' (swap form)' if plan.swap_ab else ''}")
    bench("launch_with_maps (a launcher made per call)", lambda: launcher.launch_with_maps(loaded, stream, maps, args))
    gemm = launcher.maps_launcher(loaded)
    bench("maps_launcher's launch (the runners' way)", lambda: gemm(stream, maps, args))
    bench("encode x2 (cached)", lambda: (tensor_map.encode(first.data_ptr(), spec_a),
                                         tensor_map.encode(second.data_ptr(), spec_b)))
    bench("encode_new x1", lambda: tensor_map.encode_new(first.data_ptr(), spec_a), n=200)
    vals = (ctypes.c_int64 * len(args))(*args)
    ptrs = [m.getPtr() for m in maps] + [ctypes.addressof(vals) + 8 * i for i in range(len(args))]
    params = (ctypes.c_void_p * len(ptrs))(*ptrs)
    cu_launch = launcher._cu_launch_kernel()
    cfg = loaded.launch_config
    handle = int(loaded.kernel.handle)
    grid, block = tuple(cfg.grid), tuple(cfg.block)
    bench("ctypes cuLaunchKernel only (CUkernel)",
          lambda: cu_launch(handle, *grid, *block, cfg.shmem_size, stream, params, None))
    from cuda.bindings import driver

    if hasattr(driver, "cuKernelGetFunction"):
        err, func = driver.cuKernelGetFunction(loaded.kernel.handle)
        print("cuKernelGetFunction", err)
        hf = int(func)
        bench("ctypes cuLaunchKernel only (CUfunction)",
              lambda: cu_launch(hf, *grid, *block, cfg.shmem_size, stream, params, None))

    def arrays():
        values = (ctypes.c_int64 * len(args))(*args)
        base = ctypes.addressof(values)
        return (ctypes.c_void_p * len(ptrs))(*([m.getPtr() for m in maps] + [base + 8 * i for i in range(len(args))]))
    bench("ctypes arrays only", arrays)
    fobj, paddr = driver.CUfunction(handle), ctypes.addressof(params)
    bench("cuda.bindings cuLaunchKernel, prebuilt arrays",
          lambda: driver.cuLaunchKernel(fobj, *grid, *block, cfg.shmem_size, stream, paddr, 0))


def plain_pieces(a, b):
    """One plain launch (a SIMT kernel, pointer arguments only) four ways: cuda.core's launch,
    cuda.bindings' cuLaunchKernel, ctypes with the parameter arrays built per call, and ctypes
    with arrays built once (three pointer slots rewritten per call); and allocations."""
    c, plan, reason = dispatch.matmul_fastmm(a, b, None, "ieee", force="simt_cp_async")
    if reason is not None or plan.kernel.split_k > 1 or plan.kernel.stream_k is not None:
        print(f"plain pieces skipped: {reason or 'a multi-launch plan'}")
        return
    from fastmm.runtime import runners

    loaded = launcher.load(plan.device, plan.kernel)
    p = plan.launch_problem or plan.problem
    args = (a.data_ptr(), b.data_ptr(), c.data_ptr()) + runners.gemm_args(p)
    stream = dispatch.current_stream(plan.device.index)
    cfg = loaded.launch_config
    print(f"plain: {plan.kernel.describe()}, {len(args)} arguments")
    bench("launcher.launch (cuda.core)", lambda: launcher.launch(loaded, stream, args))
    from cuda.bindings import driver

    handle = loaded.kernel.handle
    types = tuple(ctypes.c_int64 for _ in args)
    grid, block = tuple(cfg.grid), tuple(cfg.block)
    bench("cuda.bindings cuLaunchKernel", lambda: driver.cuLaunchKernel(
        handle, *grid, *block, cfg.shmem_size, stream, (args, types), 0))
    cu_launch = launcher._cu_launch_kernel()
    h = int(handle)
    n = len(args)

    def per_call():
        values = (ctypes.c_int64 * n)(*args)
        base = ctypes.addressof(values)
        params = (ctypes.c_void_p * n)(*range(base, base + 8 * n, 8))
        cu_launch(h, *grid, *block, cfg.shmem_size, stream, params, None)
    bench("ctypes, arrays per call", per_call)
    values = (ctypes.c_int64 * n)(*args)
    base = ctypes.addressof(values)
    params = (ctypes.c_void_p * n)(*range(base, base + 8 * n, 8))
    head = (h, *grid, *block, cfg.shmem_size)

    def prebuilt():
        values[0], values[1], values[2] = a.data_ptr(), b.data_ptr(), c.data_ptr()
        cu_launch(*head, stream, params, None)
    bench("ctypes, arrays built once", prebuilt)
    # cuda.bindings' Cython entry with the same prebuilt arrays: kernelParams as their address
    fobj, paddr = driver.CUfunction(h), ctypes.addressof(params)
    sobj = driver.CUstream(stream)

    def bindings_prebuilt(st=stream):
        values[0], values[1], values[2] = a.data_ptr(), b.data_ptr(), c.data_ptr()
        driver.cuLaunchKernel(fobj, *grid, *block, cfg.shmem_size, st, paddr, 0)
    c.fill_(float("nan"))
    bindings_prebuilt()
    torch.cuda.synchronize()
    ok = torch.allclose(c, a @ b, rtol=1e-4, atol=1e-3)
    print(f"cuda.bindings prebuilt launch computes a @ b: {ok}")
    bench("cuda.bindings, arrays built once (int stream)", bindings_prebuilt)
    bench("cuda.bindings, arrays built once (CUstream)", lambda: bindings_prebuilt(sobj))
    bench("torch.empty((1024, 2816), device=dev)", lambda: torch.empty((1024, 2816), device=a.device))
    bench("torch.empty(1024, 2816, device='cuda')", lambda: torch.empty(1024, 2816, device="cuda"))
    bench("a.new_empty((1024, 2816))", lambda: a.new_empty((1024, 2816)))
    bench("torch.cuda.current_stream().cuda_stream", lambda: torch.cuda.current_stream().cuda_stream)
    bench("torch._C._cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0))


def main(argv=None) -> int:
    global N_CALLS
    ap = argparse.ArgumentParser(prog="launch_cost.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=N_CALLS, help="calls per piece (default %(default)s)")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    N_CALLS = o.n
    a, b = torch.randn(256, 64, device="cuda"), torch.randn(64, 256, device="cuda")
    if torch.cuda.get_device_capability() == (9, 0):
        wgmma_pieces(a, b)
    else:
        print("wgmma pieces skipped: they need sm_90")
    plain_pieces(torch.randn(2048, 256, device="cuda"), torch.randn(256, 2048, device="cuda"))  # (no split-K)
    bench("torch.empty 256x256", lambda: torch.empty(256, 256, device="cuda"))
    bench("fast_path.key_of", lambda: fast_path.key_of(a, b, None, "tf32"))
    bench("fastmm.matmul tf32 256x256x64 (fast path)", lambda: fastmm.matmul(a, b, precision="tf32"))
    bench("torch.matmul 256x256x64", lambda: torch.matmul(a, b))
    a2, b2 = torch.randn(256, 256, device="cuda"), torch.randn(256, 256, device="cuda")
    bench("fastmm.matmul ieee 256^3", lambda: fastmm.matmul(a2, b2, precision="ieee"))
    a3, b3 = torch.randn(1000, 1000, device="cuda"), torch.randn(1000, 1000, device="cuda")
    print(f"1000^3 tf32 runs {fastmm.explain(a3, b3, precision='tf32').kernel}")
    bench("fastmm.matmul tf32 1000^3", lambda: fastmm.matmul(a3, b3, precision="tf32"), n=500)
    torch.backends.cuda.matmul.allow_tf32 = True
    bench("torch.matmul tf32 1000^3", lambda: torch.matmul(a3, b3), n=500)
    torch.backends.cuda.matmul.allow_tf32 = False
    bench("fastmm.matmul tf32 1000^3 + sync", lambda: (fastmm.matmul(a3, b3, precision="tf32"),
                                                     torch.cuda.synchronize()), n=300)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
