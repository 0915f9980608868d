"""The host side of the wgmma_tf32 family on the CPU: tensor maps, batch bits, the C^T = B^T A^T
swap, launch offsets, C strides and the staging buffers, on the full path (api._launch_wgmma) and
the fast path (runtime.runners.wgmma_runner).

As in test_fast_path.py, CPU tensors pass for CUDA ones on a simulated H200. Here
``tensor_map.encode`` records (pointer, MapSpec, tf32) instead of asking the driver (checking what
cuTensorMapEncodeTiled requires), ``launcher.launch_with_maps`` computes C from those maps as
cuda_src/wgmma_tf32.cu does (map coordinates of the producer's tma_load_4d, zeros outside the map,
TF32 rounding of the copy engine, the epilogue's addressing), and ``launcher.launch`` runs the
stage_kmajor pass (cuda_src/stage_kmajor.cu). Every element a map or an argument reaches must lie
in a tensor made during the test.
"""
from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import pytest
import torch

import fastmm
from fastmm import api
from fastmm.families import FAMILIES, MapSpec
from fastmm.runtime import launcher, tensor_map
from conftest import simulate_h200

NAN = float("nan")
WGMMA = FAMILIES["wgmma_tf32"]

#: Storages the emulated kernels may touch: weak references to those of the tensors made by
#: torch.empty / randn / full / zeros while the fixture is on. Weak, so that a buffer the host
#: code drops before the kernel reading it is queued (a staging copy) is no longer memory.
_memory: list = []


def _floats(ptr: int, shape, strides) -> torch.Tensor:
    """A float32 view of the memory at ``ptr`` (non-negative strides, in elements)."""
    assert all(s >= 0 for s in strides), strides
    n = 1 + sum((d - 1) * s for d, s in zip(shape, strides)) if all(shape) else 0
    live = [s for s in (ref() for ref in _memory) if s is not None]
    assert any(s.data_ptr() <= ptr and ptr + 4 * n <= s.data_ptr() + s.nbytes() for s in live), (
        f"a kernel argument or tensor map reaches outside every live tensor: {n} floats at {ptr:#x}")
    flat = torch.frombuffer((ctypes.c_float * max(n, 1)).from_address(ptr), dtype=torch.float32)
    return flat.as_strided(shape, strides)


def tf32_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> TF32, to nearest, ties away from zero (cvt.rna; as tests/test_gpu.py)."""
    bits = x.contiguous().view(torch.int32)
    low = bits & 0x1FFF
    return ((bits & ~0x1FFF) + (low >= 0x1000).int() * 0x2000).view(torch.float32)


@dataclass(frozen=True)
class FakeMap:
    """What the fake tensor_map.encode returns."""

    ptr: int
    spec: MapSpec
    tf32: bool


def _encode(ptr: int, spec: MapSpec, *, tf32: bool = True) -> FakeMap:
    """cuTensorMapEncodeTiled's requirements for this family's maps (fp32, 128-byte swizzle);
    the driver would refuse the map (and the api fall back to torch) where one fails."""
    assert isinstance(spec, MapSpec) and len(spec.dims) == 4 and len(spec.strides) == 3 and len(spec.box) == 4, spec
    assert ptr % 16 == 0, f"map base {ptr:#x} is not 16-byte aligned"
    assert all(0 < d < 2**32 for d in spec.dims), spec
    assert all(s % 16 == 0 and 0 < s < 2**40 for s in spec.strides), spec
    assert all(0 < b <= 256 for b in spec.box), spec
    assert spec.box[0] * 4 % 16 == 0 and spec.box[0] * 4 <= 128, spec  # 128-byte swizzle: inner box <= 128 B
    _floats(ptr, spec.dims[::-1], tuple(s // 4 for s in spec.strides[::-1]) + (1,))  # all of it is memory
    return FakeMap(ptr, spec, tf32)


def _read_map(m: FakeMap, rows: int, K: int, c2: int, c3: int, mn: bool) -> torch.Tensor:
    """The rows x K operand (float64) the kernel reads through map ``m`` at batch coordinates
    (c2, c3): K-major maps are (k, row, ...), m-contiguous ones (row, k, ...); zero outside the map;
    rounded to TF32 where the map's element type is TFLOAT32."""
    d0, d1, d2, d3 = m.spec.dims
    s1, s2, s3 = (s // 4 for s in m.spec.strides)
    out = torch.zeros(rows, K, dtype=torch.float64)
    if c2 >= d2 or c3 >= d3:
        return out
    plane = _floats(m.ptr + 4 * (c2 * s2 + c3 * s3), (d1, d0), (s1, 1))
    if mn:  # (row, k): plane is [k][row]
        plane = plane.t()
    plane = plane[:rows, :K]
    if m.tf32:
        plane = tf32_round(plane)
    out[:plane.shape[0], :plane.shape[1]] = plane.double()
    return out


def _emulate_wgmma(cfg, maps, args) -> None:
    """cuda_src/wgmma_tf32.cu on (maps, args): C_z[m, n] = sum_k A(m, k) * B^T(n, k)."""
    assert cfg.family == "wgmma_tf32"
    macros = dict(cfg.macros)
    x3, a_mn, bn, c_vec = macros["PRECISION_X3"], macros["A_MN"], macros["BN"], macros["C_VEC"]
    assert len(args) == 11 and all(isinstance(x, int) for x in args), args
    pc, M, N, K, scm, scn, inner, total, sc0, sc1, bits = args
    assert M > 0 and N > 0 and K > 0 and 1 <= inner <= total and total % inner == 0
    assert cfg.grid == (-(-M // 128) * -(-N // bn), 1, min(total, 65535)), (cfg.grid, args)
    parts = 2 if x3 else 1
    assert len(maps) == 2 * parts
    a_maps, b_maps = maps[:parts], maps[parts:]
    for m in a_maps:  # the boxes must move what the kernel expects per stage (A_BYTES, B_BYTES)
        assert m.spec.box == ((32, 32, 1, 1) if a_mn else (32, 128, 1, 1)), m.spec
        assert m.tf32 == (not x3)
    for m in b_maps:
        assert m.spec.box == (32, bn, 1, 1), m.spec
        assert m.tf32 == (not x3)
    assert all(m.spec == a_maps[0].spec for m in a_maps) and all(m.spec == b_maps[0].spec for m in b_maps)
    if c_vec == 1:  # float2 stores along n
        assert N % 2 == 0 and scm % 2 == 0 and pc % 8 == 0 and sc0 % 2 == 0 and sc1 % 2 == 0, args
    elif c_vec == 2:  # float2 stores along m (adjacent row pairs of A_MN)
        assert a_mn and scm == 1 and scn % 2 == 0 and pc % 8 == 0 and sc0 % 2 == 0 and sc1 % 2 == 0, args
    for z in range(total):
        z0, z1 = z // inner, z % inner
        a2, a3 = (z1 if bits & 1 else 0), (z0 if bits & 2 else 0)
        b2, b3 = (z1 if bits & 4 else 0), (z0 if bits & 8 else 0)
        a = sum(_read_map(m, M, K, a2, a3, bool(a_mn)) for m in a_maps)
        bt = sum(_read_map(m, N, K, b2, b3, False) for m in b_maps)
        c = _floats(pc + 4 * (z0 * sc0 + z1 * sc1), (M, N), (scm, scn))
        c.copy_((a @ bt.t()).float())


def _emulate_stage(cfg, args) -> None:
    """cuda_src/stage_kmajor.cu: dst[r * ld + k] = src[r * sR + k * sK], zero pad up to ld; SPLIT:
    dst = tf32(x), dst2 = tf32(x - tf32(x)). With batch arguments (batch_inner, batch_total, s0,
    s1): matrix z from src + z0 * s0 + z1 * s1 to dst + z * R * ld."""
    assert cfg.family == "stage_kmajor"
    macros = dict(cfg.macros)
    src, dst, dst2, R, K, s_r, s_k, ld, inner, total, s0, s1 = args
    assert 1 <= inner <= total and total % inner == 0, args
    assert ld % 4 == 0 and K <= ld < K + 4 and dst % 16 == 0 and dst2 % 16 == 0
    assert cfg.grid == (-(-R // 64) * -(-K // 64), 1, min(total, 65535)), (cfg.grid, args)
    assert macros["SRC_R_CONTIG"] == int(s_r == 1 and s_k != 1)
    if macros["SRC_VEC"]:  # float4 reads along the source's contiguous dim
        other = s_k if macros["SRC_R_CONTIG"] else s_r
        assert src % 16 == 0 and other % 4 == 0 and s0 % 4 == 0 and s1 % 4 == 0, args
        assert (s_r if macros["SRC_R_CONTIG"] else s_k) == 1, args
    assert not macros["SPLIT"] or dst2 != dst
    for z in range(total):
        x = _floats(src + 4 * ((z // inner) * s0 + (z % inner) * s1), (R, K), (s_r, s_k)).clone()
        if macros["SPLIT"]:
            big = tf32_round(x)
            small = tf32_round(x - big)
            small[~torch.isfinite(x)] = 0
            pairs = ((dst, big), (dst2, small))
        else:
            pairs = ((dst, x),)
        for ptr, value in pairs:
            d = _floats(ptr + 4 * z * R * ld, (R, ld), (ld, 1))
            d[:, :K] = value
            d[:, K:] = 0


@pytest.fixture
def wgmma_gpu(tmp_cache, monkeypatch):
    """A simulated H200 whose wgmma and stage_kmajor launches are emulated on the CPU; records
    every launch and counts the calls that took the full path (api._run)."""
    gpu = simulate_h200(monkeypatch)  # launches: (family, pointers, the rest: what a later call must repeat)

    def launch(cfg, stream, args):
        assert stream == 7  # the current stream
        assert cfg.family == "stage_kmajor", f"unexpected plain launch of {cfg.family}"
        gpu.launches.append((cfg.family, tuple(args[:3]), (cfg, tuple(args[3:]))))
        _emulate_stage(cfg, tuple(args))

    def launch_with_maps(cfg, stream, maps, args):
        assert stream == 7
        gpu.launches.append((cfg.family, tuple(m.ptr for m in maps) + (args[0],),
                             (cfg, tuple((m.spec, m.tf32) for m in maps), tuple(args[1:]))))
        _emulate_wgmma(cfg, tuple(maps), tuple(args))

    def recorded(make):
        def made(*args, **kwargs):
            t = make(*args, **kwargs)
            if t.device.type == "cpu":
                _memory.append(weakref.ref(t.untyped_storage()))
            return t
        return made

    for name in ("empty", "randn", "full", "zeros"):
        monkeypatch.setattr(torch, name, recorded(getattr(torch, name)))
    monkeypatch.setattr(launcher, "load", lambda dev, cfg: cfg)
    monkeypatch.setattr(launcher, "launch", launch)
    monkeypatch.setattr(launcher, "launch_with_maps", launch_with_maps)
    # (the fast path binds the kernel once: launcher.maps_launcher(loaded)(stream, maps, args))
    monkeypatch.setattr(launcher, "maps_launcher",
                        lambda cfg: lambda stream, maps, args: launch_with_maps(cfg, stream, maps, args), raising=False)
    monkeypatch.setattr(tensor_map, "encode", _encode)
    yield gpu
    del _memory[:]


def _rel(c: torch.Tensor, ref: torch.Tensor) -> float:
    return ((c.double() - ref).norm() / ref.norm()).item()


def _check(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, precision: str = "tf32") -> None:
    """C against float64 references: A @ B of the TF32-rounded inputs (what the copy engine
    feeds the tensor core) to float32 accuracy, and the exact product at TF32 accuracy."""
    exact = a.double() @ b.double()
    assert c.shape == exact.shape
    assert not torch.isnan(c).any(), "some element of C was not written"
    if precision == "tf32x3":
        assert _rel(c, exact) <= 1e-6
        return
    assert _rel(c, tf32_round(a).double() @ tf32_round(b).double()) <= 1e-6
    assert _rel(c, exact) <= 3e-3


def _the_plan():
    plans = {hit[0] for hit in api._prepared.values()}
    assert len(plans) == 1, plans
    plan = plans.pop()
    assert plan.kernel is not None and plan.kernel.family == "wgmma_tf32", plan.describe()
    return plan


def _calls(gpu, make, make_out=lambda: None, precision="tf32", calls=3):
    """The first call of fastmm.matmul (full path) and ``calls`` later ones with fresh operands:
    each right, the later ones queueing what the first queued (pointers aside), the same operands
    giving the same bits, and the fast path taken exactly where the plan launches once (its
    copies, if any, included in the fast entry's runner). Returns the plan."""
    a, b = make()
    out = make_out()
    c = fastmm.matmul(a, b, precision=precision, out=out)
    assert out is None or c is out
    _check(c, a, b, precision)
    assert gpu.slow_calls == 1
    plan = _the_plan()
    first = list(gpu.launches)
    launches = len(first) // (len(plan.staging) + 1)  # one per batch offset, each after its copies
    assert [f for f, _, _ in first] == (["stage_kmajor"] * len(plan.staging) + ["wgmma_tf32"]) * launches
    key = api._fast_key(a, b, out, precision)
    entry = api._fast[key]
    fast = launches == 1
    assert bool(entry) == fast, (plan.describe(), len(first))
    if fast:
        assert entry[7] is not None  # the wgmma runner
    c2 = fastmm.matmul(a, b, precision=precision, out=make_out())
    assert torch.equal(c2, c), "a later call with the same operands computed other bits"
    for _ in range(calls - 1):
        a, b = make()
        out = make_out()
        del gpu.launches[:]
        c = fastmm.matmul(a, b, precision=precision, out=out)
        assert out is None or c is out
        assert out is not None or c.is_contiguous()
        _check(c, a, b, precision)
        assert [(f, rest) for f, _, rest in gpu.launches] == [(f, rest) for f, _, rest in first]
    assert gpu.slow_calls == (1 if fast else calls + 1)
    return plan


# ---------------------------------------------------------------------------------------------
# the heuristics' own choice (no force): big enough that 128x128 tiles fill 1/3 of the SMs

M, N, K = 1040, 772, 68  # K % 32 != 0: a k-tail; M, N not multiples of the tiles


def test_row_major_operands_are_computed_transposed_without_copies(wgmma_gpu):
    """A, B row-major: C^T = B^T A^T, B as the m-contiguous (register-fed) A of the kernel."""
    plan = _calls(wgmma_gpu, lambda: (torch.randn(M, K), torch.randn(K, N)))
    assert plan.swap_ab and not plan.staging and dict(plan.kernel.macros)["A_MN"] == 1
    assert plan.origin == "heuristic"


def test_wide_tiles_map_b_in_boxes_of_256_rows(wgmma_gpu):
    """Enough tiles for BN = 256: B's box (and the grid) follow the tile, not BM."""
    plan = _calls(wgmma_gpu, lambda: (torch.randn(2048, 36), torch.randn(2048, 36).t()))
    assert dict(plan.kernel.macros)["BN"] == 256 and not plan.swap_ab and not plan.staging
    (_, _, (_, specs, _)), = wgmma_gpu.launches
    assert specs[1][0].box == (32, 256, 1, 1)


def test_a_row_major_with_b_k_major_reads_both_in_place(wgmma_gpu):
    plan = _calls(wgmma_gpu, lambda: (torch.randn(M, K), torch.randn(N, K).t()))
    assert not plan.swap_ab and not plan.staging and dict(plan.kernel.macros)["A_MN"] == 0


def test_m_contiguous_a_with_k_major_b_feeds_a_from_registers(wgmma_gpu):
    plan = _calls(wgmma_gpu, lambda: (torch.randn(K, M).t(), torch.randn(N, K).t()))
    assert not plan.swap_ab and not plan.staging and dict(plan.kernel.macros)["A_MN"] == 1


def test_m_contiguous_a_with_row_major_b_stages_b_transposed(wgmma_gpu):
    """One operand staged (B^T, K-major) each call, by the fast path's runner after the first."""
    plan = _calls(wgmma_gpu, lambda: (torch.randn(K, M).t(), torch.randn(K, N)))
    assert not plan.swap_ab and [w for w, _, _ in plan.staging] == ["bt"]
    assert dict(plan.kernel.macros)["A_MN"] == 1


def test_row_major_a_with_misaligned_b_pitch_stages_only_b(wgmma_gpu):
    """B's rows 771 floats apart (no 16-byte pitch): B^T copied, A read in place."""
    plan = _calls(wgmma_gpu, lambda: (torch.randn(M, K), torch.randn(K, N + 1)[:, :N - 1]))
    assert [w for w, _, _ in plan.staging] == ["bt"] and not plan.swap_ab
    assert dict(plan.kernel.macros)["C_VEC"] == 0  # N odd


OUTS = {
    "contiguous": lambda shape: torch.zeros(shape),
    "nan-filled": lambda shape: torch.full(shape, NAN),
    "transposed": lambda shape: torch.full(shape[:-2] + shape[-2:][::-1], NAN).transpose(-1, -2),
    "row-strided": lambda shape: torch.full(shape[:-1] + (shape[-1] + 3,), NAN)[..., 1:shape[-1] + 1],
}
OUT_CASES = {
    "row-major": lambda: (torch.randn(M, K), torch.randn(K, N)),
    "b-k-major": lambda: (torch.randn(M, K), torch.randn(N, K).t()),
    "batched": lambda: (torch.randn(3, 256, 64), torch.randn(3, 64, 136)),
}


@pytest.mark.parametrize("case", list(OUT_CASES))
@pytest.mark.parametrize("out_kind", list(OUTS))
def test_out_variants_are_written_through_their_strides(wgmma_gpu, monkeypatch, case, out_kind):
    """out= contiguous, NaN-filled (every element must be written), a transposed view (C
    m-contiguous) and a row-strided slice of a wider tensor (odd offset and pitch: single-float
    stores); with and without the swap, batched too."""
    if case == "batched":
        monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    make = OUT_CASES[case]
    a, b = make()
    shape = tuple(torch.matmul(a[..., :1, :], b[..., :, :1]).shape[:-2]) + (a.shape[-2], b.shape[-1])
    plan = _calls(wgmma_gpu, make, lambda: OUTS[out_kind](shape))
    assert not plan.staging


# ---------------------------------------------------------------------------------------------
# batches (forced: too few tiles for the heuristics), through fastmm.matmul with FASTMM_KERNEL

Mb, Nb, Kb = 256, 136, 64

BATCH_CASES = {
    # name: (operands, expected swap, expected broadcast bits of the launch)
    "batched": (lambda: (torch.randn(4, Mb, Kb), torch.randn(4, Kb, Nb)), True, 1 | 4),
    "batched-b-k-major": (lambda: (torch.randn(4, Mb, Kb), torch.randn(4, Nb, Kb).transpose(1, 2)), False, 1 | 4),
    "batched-a-m-contiguous": (lambda: (torch.randn(4, Kb, Mb).transpose(1, 2), torch.randn(4, Nb, Kb).transpose(1, 2)),
                               False, 1 | 4),
    "broadcast-a": (lambda: (torch.randn(Mb, Kb), torch.randn(4, Kb, Nb)), True, 1),  # swapped: B's bit is A's
    "broadcast-b": (lambda: (torch.randn(4, Mb, Kb), torch.randn(Kb, Nb)), True, 4),
    "expanded-a": (lambda: (torch.randn(Mb, Kb).expand(4, Mb, Kb), torch.randn(4, Kb, Nb)), True, 1),
    "expanded-both": (lambda: (torch.randn(1, Mb, Kb).expand(5, Mb, Kb), torch.randn(Kb, Nb).expand(5, Kb, Nb)),
                      True, 0),
    "4d-broadcast": (lambda: (torch.randn(3, 1, Mb, Kb), torch.randn(2, Kb, Nb)), True, 1 | 8),  # B inner, A outer
    "4d-broadcast-b-k-major": (lambda: (torch.randn(3, 1, Mb, Kb), torch.randn(2, Nb, Kb).transpose(1, 2)),
                               False, 2 | 4),
}


@pytest.mark.parametrize("case", list(BATCH_CASES))
def test_batches_walk_the_maps_batch_dims(wgmma_gpu, monkeypatch, case):
    make, swap, bits = BATCH_CASES[case]
    monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    plan = _calls(wgmma_gpu, make)
    assert plan.swap_ab == swap and not plan.staging
    p = plan.launch_problem or plan.problem
    assert p.batch_total > 1
    assert WGMMA.map_specs(p, plan.kernel)[2] == bits
    (_, _, (_, _, args)), = wgmma_gpu.launches
    assert args[-1] == bits


EDGE_CASES = {
    # name: (operands, out)
    "out-batch-innermost": (lambda: (torch.randn(4, Mb, Kb), torch.randn(4, Kb, Nb)),
                            lambda: torch.full((Mb, Nb, 4), NAN).permute(2, 0, 1)),
    "out-batch-dims-permuted": (lambda: (torch.randn(2, 3, Mb, Kb), torch.randn(2, 3, Kb, Nb)),
                                lambda: torch.full((3, 2, Mb, Nb), NAN).transpose(0, 1)),
    "out-8-byte-aligned": (lambda: (torch.randn(Mb, Kb), torch.randn(Kb, Nb)), lambda: torch.full((Mb, Nb + 2), NAN)[:, 2:]),
    "overlapping-a-batches": (lambda: (torch.randn(Mb * Kb + 3 * 64).as_strided((4, Mb, Kb), (64, Kb, 1)),
                                       torch.randn(4, Kb, Nb)), lambda: None),
    "vector-a": (lambda: (torch.randn(Kb), torch.randn(Kb, Nb)), lambda: None),
    "single-column-b": (lambda: (torch.randn(Mb, Kb), torch.randn(Kb, 1)), lambda: None),
}


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_layouts(wgmma_gpu, monkeypatch, case):
    """C with its batch dim innermost or batch dims out of order, C 8-byte aligned, A batches
    overlapping in memory, 1-D A and a one-column B (staged: a size-1 dim's stride reads as 1)."""
    monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    make, make_out = EDGE_CASES[case]
    _calls(wgmma_gpu, make, make_out)


def test_three_batch_dims_launch_once_per_outer_index(wgmma_gpu, monkeypatch):
    """Batch dims that do not fuse: a Python loop of launches at offsets (exchanged with the
    operands where the plan swaps); never a fast entry."""
    monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    plan = _calls(wgmma_gpu, lambda: (torch.randn(2, 3, 4, 128, 64), torch.randn(3, 1, 64, 136)))
    assert plan.swap_ab
    assert len(wgmma_gpu.launches) == 2


def test_forced_small_row_major_product_through_matmul_fastmm(wgmma_gpu):
    """api.matmul_fastmm with force= (the full path only), C given NaN-filled."""
    a, b, out = torch.randn(256, 64), torch.randn(64, 384), torch.full((256, 384), NAN)
    result, plan, reason = api.matmul_fastmm(a, b, out, "tf32", force="wgmma_tf32")
    assert reason is None and result is out and plan.kernel.family == "wgmma_tf32" and plan.swap_ab
    _check(out, a, b)
    assert [f for f, _, _ in wgmma_gpu.launches] == ["wgmma_tf32"]


# ---------------------------------------------------------------------------------------------
# staging both operands

def _offset_by_one(*shape):
    """A tensor whose data starts 4 bytes into its storage (4-byte aligned only)."""
    n = 1
    for d in shape:
        n *= d
    return torch.randn(n + 1)[1:].view(*shape)


def test_unaligned_operands_are_both_staged(wgmma_gpu):
    """A at storage offset 1, B with an odd pitch (N = 257), K = 70: neither readable by a
    tensor map, both copied K-major (pad columns up to 72) before the launch."""
    a, b = _offset_by_one(300, 70), torch.randn(70, 257)
    result, plan, reason = api.matmul_fastmm(a, b, None, "tf32", force="wgmma_tf32")
    assert reason is None and plan.kernel.family == "wgmma_tf32"
    assert plan.staging == (("a", 300, 72), ("bt", 257, 72)) and not plan.swap_ab
    _check(result, a, b)
    (f1, (src1, dst1, _), _), (f2, (src2, dst2, _), _), (f3, maps, _) = wgmma_gpu.launches
    assert (f1, f2, f3) == ("stage_kmajor", "stage_kmajor", "wgmma_tf32")
    assert (src1, src2) == (a.data_ptr(), b.data_ptr())
    assert maps[:2] == (dst1, dst2)  # the kernel reads the copies


def test_unaligned_operands_take_the_fast_path_with_their_copies(wgmma_gpu, monkeypatch):
    monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    plan = _calls(wgmma_gpu, lambda: (_offset_by_one(300, 70), torch.randn(70, 257)),
                  lambda: torch.full((300, 257), NAN))
    assert [w for w, _, _ in plan.staging] == ["a", "bt"]


BATCH_STAGED = {
    # name: (operands, precision, expected staging entries)
    "b-per-matrix": (lambda: (torch.randn(4, Kb, Mb).transpose(1, 2), torch.randn(4, Kb, Nb)), "tf32", ["bt"]),
    # A^T (broadcast) with a row-major batched B: one copy either way; A's (256 rows, once) is
    # smaller than B^T's (3 x 136 rows), so A is copied and the product swapped
    "broadcast-a-copied-once": (lambda: (torch.randn(Kb, Mb).t(), torch.randn(3, Kb, Nb)), "tf32", ["a"]),
    "both-4d": (lambda: (_offset_by_one(3, 1, 300, 70), torch.randn(2, 70, 257)), "tf32", ["a", "bt"]),
    "a-then-swap-4d": (lambda: (_offset_by_one(3, 1, 300, 68), torch.randn(2, 68, 260)), "tf32", ["a"]),
    "three-batch-dims": (lambda: (_offset_by_one(2, 3, 4, 100, 70), torch.randn(3, 1, 70, 130)), "tf32", ["a", "bt"]),
    "tf32x3-b-broadcast": (lambda: (torch.randn(4, Mb, Kb), torch.randn(Kb, Nb)), "tf32x3", ["a", "bt"]),
}


@pytest.mark.parametrize("case", list(BATCH_STAGED))
def test_batched_operands_are_staged_matrix_by_matrix(wgmma_gpu, monkeypatch, case):
    """Copies of a batched operand: one K-major matrix per batch index it really has (a
    broadcast operand copied once), read through the map's batch dims."""
    make, precision, staged = BATCH_STAGED[case]
    monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    plan = _calls(wgmma_gpu, make, precision=precision)
    assert [w for w, _, _ in plan.staging] == staged and plan.problem.batch_total > 1


def test_tf32x3_splits_both_operands_into_halves(wgmma_gpu, monkeypatch):
    """tf32x3: both operands staged as big and small TF32 halves, four plain fp32 maps."""
    monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    plan = _calls(wgmma_gpu, lambda: (torch.randn(200, 130), torch.randn(130, 260)), precision="tf32x3")
    assert [w for w, _, _ in plan.staging] == ["a", "bt"] and plan.precision_used == "tf32x3"
    assert all(dict(s.macros)["SPLIT"] == 1 for s in plan.stagers)
