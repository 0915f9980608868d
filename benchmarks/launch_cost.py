"""Host cost of the pieces of a fastmm call (launches, tensor maps, allocation), microseconds each:
`python benchmarks/launch_cost.py` on the GPU machine."""
import sys, time, ctypes
sys.path.insert(0, ".")
import torch, fastmm
from fastmm import api
from fastmm.runtime import launcher, tensor_map
from fastmm.families import FAMILIES
a, b = torch.randn(256, 64, device="cuda"), torch.randn(64, 256, device="cuda")
c, plan, _ = api.matmul_fastmm(a, b, None, "tf32", force="wgmma_tf32")
loaded = launcher.load(plan.device, plan.kernel)
p = plan.launch_problem or plan.problem
sa, sb, bits = FAMILIES["wgmma_tf32"].map_specs(p, plan.kernel)
maps = (tensor_map.encode(b.data_ptr(), sa), tensor_map.encode(a.data_ptr(), sb))
args = (c.data_ptr(), p.M, p.N, p.K, *p.c_strides, p.batch_inner, p.batch_total, *p.c_batch_strides, bits)
stream = torch.cuda.current_stream().cuda_stream
def bench(name, fn, n=2000):
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"{name:<40} {t:7.2f} us")
bench("launch_with_maps", lambda: launcher.launch_with_maps(loaded, stream, maps, args))
bench("encode x2 (cached)", lambda: (tensor_map.encode(b.data_ptr(), sa), tensor_map.encode(a.data_ptr(), sb)))
bench("encode_new x1", lambda: tensor_map.encode_new(b.data_ptr(), sa), n=200)
vals = (ctypes.c_int64 * len(args))(*args)
ptrs = [m.getPtr() for m in maps] + [ctypes.addressof(vals) + 8 * i for i in range(len(args))]
params = (ctypes.c_void_p * len(ptrs))(*ptrs)
fn = launcher._cu_launch_kernel()
cfg = loaded.launch_config
h = int(loaded.kernel.handle)
g, bl = tuple(cfg.grid), tuple(cfg.block)
bench("ctypes cuLaunchKernel only (CUkernel)", lambda: fn(h, *g, *bl, cfg.shmem_size, stream, params, None))
from cuda.bindings import driver
err, func = driver.cuKernelGetFunction(loaded.kernel.handle) if hasattr(driver, "cuKernelGetFunction") else (None, None)
print("cuKernelGetFunction", err)
if func is not None:
    hf = int(func)
    bench("ctypes cuLaunchKernel only (CUfunction)", lambda: fn(hf, *g, *bl, cfg.shmem_size, stream, params, None))
bench("ctypes arrays only", lambda: (ctypes.c_void_p * len(ptrs))(*([m.getPtr() for m in maps] + [ctypes.addressof((ctypes.c_int64 * len(args))(*args)) + 8 * i for i in range(len(args))])))
bench("torch.empty 256x256", lambda: torch.empty(256, 256, device="cuda"))
bench("_fast_key", lambda: api._fast_key(a, b, None, "tf32"))
bench("fastmm.matmul tf32 (fast path)", lambda: fastmm.matmul(a, b, precision="tf32"))
bench("torch.matmul", lambda: torch.matmul(a, b))
a2, b2 = torch.randn(256, 256, device="cuda"), torch.randn(256, 256, device="cuda")
bench("fastmm.matmul ieee 256^3 (simt)", lambda: fastmm.matmul(a2, b2, precision="ieee"))
a3, b3 = torch.randn(1000, 1000, device="cuda"), torch.randn(1000, 1000, device="cuda")
bench("fastmm.matmul tf32 1000^3 (wgmma)", lambda: fastmm.matmul(a3, b3, precision="tf32"), n=500)
bench("torch.matmul tf32 1000^3", lambda: torch.matmul(a3, b3), n=500)
bench("fastmm.matmul tf32 1000^3 + sync", lambda: (fastmm.matmul(a3, b3, precision="tf32"), torch.cuda.synchronize()), n=300)
