"""The steady-state path of fastmm.matmul (api._remember_fast / api._launch_fast) on the CPU.

CPU tensors pass for CUDA ones on a simulated H200, and the kernels are emulated in Python with
the argument conventions of cuda_src/common.cuh and cuda_src/splitk_reduce.cu, reading and
writing the tensors' memory through their data pointers. So the first call of a shape (the full
path, api._launch_plan) and every later one (the entry api._remember_fast stored) both really
compute C, and must agree with torch and with each other launch for launch.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

import fastmm
from fastmm import api
from fastmm.runtime import arrivals, launcher
from conftest import simulate_h200

NAN = float("nan")


#: Storages the emulated kernels may touch (every tensor made by torch.empty / randn / full while
#: emulated_gpu is on, kept alive by this list): an argument pointing elsewhere fails the test
#: instead of writing over the process's memory.
_memory: list = []


def _floats(ptr: int, shape, strides) -> torch.Tensor:
    """A float32 view of the memory at ``ptr`` (non-negative strides, in elements)."""
    n = 1 + sum((d - 1) * s for d, s in zip(shape, strides)) if all(shape) else 0
    assert any(s.data_ptr() <= ptr and ptr + 4 * n <= s.data_ptr() + s.nbytes() for s in _memory), (
        f"a kernel argument reaches outside every tensor: {n} floats at {ptr:#x}")
    flat = torch.frombuffer((ctypes.c_float * max(n, 1)).from_address(ptr), dtype=torch.float32)
    return flat.as_strided(shape, strides)


def _emulate(cfg, args) -> None:
    """Run the kernel ``cfg`` (the fake launcher.load returns the config itself) on ``args``."""
    if cfg.family == "splitk_reduce":
        w, c, M, N, S, scm, scn = args
        work = _floats(w, (S, M, N), (M * N, N, 1))
        total = torch.zeros(M, N)
        for s in range(S):  # fixed order, in float32, as the kernel sums
            total += work[s]
        _floats(c, (M, N), (scm, scn)).copy_(total)
        return
    fused = args[20:]  # a fused split-K launch: (out, its strides, arrival counters)
    assert len(fused) == (4 if cfg.split_fused else 0)
    (pa, pb, pc, M, N, K, sam, sak, sbk, sbn, scm, scn, inner, total,
     sa0, sa1, sb0, sb1, sc0, sc1) = args[:20]
    split, bk = cfg.split_k, cfg.tile[2]
    per = -(-(-(-K // bk)) // split)  # k-tiles per block row, as split_range()
    for z in range(total):
        za, zb = z // inner, z % inner
        a = _floats(pa + 4 * (za * sa0 + zb * sa1), (M, K), (sam, sak))
        b = _floats(pb + 4 * (za * sb0 + zb * sb1), (K, N), (sbk, sbn))
        for y in range(split):
            k0, k1 = min(K, y * per * bk), min(K, (y + 1) * per * bk)
            part = (a[:, k0:k1].double() @ b[k0:k1].double()).float()
            if cfg.split_pair:  # cluster pairs: rows 2j and 2j + 1 add into slice j
                c = _floats(pc + 4 * (za * sc0 + zb * sc1 + (y // 2) * sc0), (M, N), (scm, scn))
                c.copy_(part if y % 2 == 0 else c + part)
            else:
                c = _floats(pc + 4 * (za * sc0 + zb * sc1 + y * sc0), (M, N), (scm, scn))
                c.copy_(part)
    if fused:  # the last block of each column tile sums the slices in order; counters start at 0
        out, som, son, counters = fused
        tiles = cfg.arrival_counters
        count = torch.frombuffer((ctypes.c_int32 * tiles).from_address(counters), dtype=torch.int32)
        assert not count.any(), "arrival counters not zero at the launch"
        for _ in range(split):  # every block of a tile arrives; the last one puts the count back
            count += 1
        assert (count == split).all()
        count.zero_()
        sums = torch.zeros(M, N)
        for y in range(split):
            sums += _floats(pc + 4 * y * sc0, (M, N), (scm, scn))
        _floats(out, (M, N), (som, son)).copy_(sums)


@pytest.fixture
def emulated_gpu(tmp_cache, monkeypatch):
    """A simulated H200 whose launches are emulated on the CPU; records (family, args) of every
    launch and counts the calls that took the full path (api._run)."""
    gpu = simulate_h200(monkeypatch)

    def launch(cfg, stream, args):
        assert stream == 7  # the current stream
        gpu.launches.append((cfg.family, tuple(args)))
        _emulate(cfg, args)

    def recorded(make):
        def made(*args, **kwargs):
            t = make(*args, **kwargs)
            if t.device.type == "cpu":
                _memory.append(t.untyped_storage())
            return t
        return made

    monkeypatch.setattr(torch, "empty", recorded(torch.empty))
    monkeypatch.setattr(torch, "randn", recorded(torch.randn))
    monkeypatch.setattr(torch, "full", recorded(torch.full))
    monkeypatch.setattr(launcher, "load", lambda dev, cfg: cfg)
    monkeypatch.setattr(launcher, "launch", launch)
    yield gpu
    del _memory[:]
    arrivals.forget()  # (the emulated stream's counters live in CPU memory)


def _same_launches(first, later, workspace: bool) -> None:
    """``later`` queues what ``first`` queued: the same kernels and arguments, except the data
    pointers of A, B, C (fresh tensors) and of the workspace, which only has to be the one the
    GEMM wrote and the reduce read."""
    assert [f for f, _ in later] == [f for f, _ in first]
    for (_, x), (_, y) in zip(first, later):
        skip = 2 if len(x) == 7 else 3  # (workspace, c) of the reduce; (a, b, c) of a GEMM
        if len(x) == 24:  # a fused split-K GEMM: also its out; the same arrival counters
            assert x[skip:20] + x[21:] == y[skip:20] + y[21:]
        else:
            assert x[skip:] == y[skip:]
    if workspace and len(later) == 2:
        assert later[0][1][2] == later[1][1][0]


def _check(c, a, b) -> None:
    assert not torch.isnan(c).any()
    ref = a.double() @ b.double()
    assert ((c.double() - ref).norm() / ref.norm()).item() <= 1e-6


SPLIT_SHAPES = [(16, 4096, 4096, "ieee", "skinny"), (16, 4096, 4096, "tf32", "skinny"),
                (64, 64, 16384, "ieee", "simt_cp_async"), (64, 64, 8192, "tf32", "tf32_mma"),
                (256, 256, 65536, "ieee", "simt_cp_async")]


@pytest.mark.parametrize("M,N,K,precision,family", SPLIT_SHAPES, ids=[f"{s[4]}-{s[3]}-K{s[2]}" for s in SPLIT_SHAPES])
@pytest.mark.parametrize("out_kind", ["none", "contiguous", "transposed"])
def test_split_k_plans_take_the_fast_path_with_the_full_paths_launches(emulated_gpu, M, N, K, precision, family,
                                                                      out_kind):
    gpu = emulated_gpu

    def make_out():
        if out_kind == "none":
            return None
        if out_kind == "contiguous":
            return torch.full((M, N), NAN)
        return torch.full((N, M), NAN).t()  # C column-major: the reduce writes C's strides

    a, b = torch.randn(M, K), torch.randn(K, N)
    exp = fastmm.explain(a, b, precision=precision)
    fused = exp.plan.kernel.split_fused  # the skinny kernel sums its own slices (sm_90)
    assert fused == (family == "skinny")
    assert exp.kernel == family and (exp.plan.reduce is None) == fused and exp.plan.kernel.split_k > 1, str(exp)
    out = make_out()
    c = fastmm.matmul(a, b, precision=precision, out=out)
    assert out is None or c is out
    _check(c, a, b)
    assert gpu.slow_calls == 1
    first = list(gpu.launches)
    assert [f for f, _ in first] == [family] + ([] if fused else ["splitk_reduce"])
    key = api._fast_key(a, b, out, precision)
    entry = api._fast[key]
    assert entry and entry[7] is not None  # a fast entry with its runner (the reduce pass or the counters)
    for _ in range(3):
        a, b = torch.randn(M, K), torch.randn(K, N)
        out = make_out()
        del gpu.launches[:]
        c = fastmm.matmul(a, b, precision=precision, out=out)
        assert out is None or c is out
        assert c.shape == (M, N) and (out is not None or c.is_contiguous())
        _check(c, a, b)
        _same_launches(first, gpu.launches, workspace=True)
    assert gpu.slow_calls == 1  # every later call took the fast path


def test_one_launch_plans_still_take_the_fast_path(emulated_gpu):
    gpu = emulated_gpu
    a, b = torch.randn(2, 96, 80), torch.randn(80, 72)  # batched, B broadcast
    assert fastmm.explain(a, b, precision="ieee").plan.reduce is None
    _check(fastmm.matmul(a, b, precision="ieee"), a, b)
    first = list(gpu.launches)
    assert len(first) == 1 and api._fast[api._fast_key(a, b, None, "ieee")][7] is None
    a, b = torch.randn(2, 96, 80), torch.randn(80, 72)
    del gpu.launches[:]
    c = fastmm.matmul(a, b, precision="ieee")
    assert c.shape == (2, 96, 72)
    _check(c, a, b)
    _same_launches(first, gpu.launches, workspace=False)
    assert gpu.slow_calls == 1


def test_split_k_plans_with_staged_operands_stay_on_the_full_path(emulated_gpu):
    """A staged operand is copied per call (the kernel reads the copy): never a fast entry."""
    gpu = emulated_gpu
    a, b = torch.randn(64, 8191), torch.randn(8191, 1024)  # rows of A: 8191 floats, not 16-byte aligned
    plan = fastmm.explain(a, b, precision="tf32").plan
    assert plan.staging and plan.reduce is not None, plan.describe()
    for _ in range(3):
        _check(fastmm.matmul(a, b, precision="tf32"), a, b)
    assert api._fast[api._fast_key(a, b, None, "tf32")] == ()
    assert gpu.slow_calls == 3


def test_an_out_overlapping_an_input_is_not_written_by_the_split_k_fast_path(emulated_gpu):
    """A fast entry stored for an out apart from the inputs must not serve a later call (same
    key) whose out is A's memory: the full path computes aside, then copies."""
    M, N, K = 16, 4096, 4096  # M * K == M * N: A and out can be the same floats
    a, b, out = torch.randn(M, K), torch.randn(K, N), torch.full((M, N), NAN)
    fastmm.matmul(a, b, precision="ieee", out=out)
    key = api._fast_key(a, b, out, "ieee")
    assert api._fast[key][7] is not None
    a2 = torch.randn(M, K)
    out2 = a2.view(M, N)
    assert api._fast_key(a2, b, out2, "ieee") == key
    expected = a2.double() @ b.double()
    assert fastmm.matmul(a2, b, precision="ieee", out=out2) is out2
    assert ((out2.double() - expected).norm() / expected.norm()).item() <= 1e-6
    assert emulated_gpu.slow_calls == 2

