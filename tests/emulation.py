"""A GPU emulated on the CPU, for fastmm's host code: CPU tensors pass for CUDA ones on a simulated
H200 (conftest.simulate_h200), and every kernel fastmm launches is computed here in Python from its
arguments, with the conventions of cuda_src/:

- the GEMM families' FASTMM_PARAMS (common.cuh): A, B, C pointers, sizes, strides, batch strides;
  split-K into workspace slices (split_range; cluster pairs adding into one slice; a fused split
  summing its own slices with zeroed arrival counters);
- splitk_reduce.cu: the slices summed in slice order;
- the fused epilogue (EPILOGUE = 1, common.cuh): alpha * product + beta * D in the stores that
  finish outputs, its five arguments last (D's pointer, its strides, alpha's and beta's float32
  bits); beta = 0 reads no D;
- stage_kmajor.cu: an operand copied K-major, zero-padded, split into TF32 halves for tf32x3;
- wgmma_tf32.cu: A and B read through tensor maps (``tensor_map.encode`` records the pointer and
  geometry and checks what cuTensorMapEncodeTiled requires), zeros outside a map, the copy
  engine's TF32 rounding where the map says TFLOAT32, the epilogue's addressing of C.

Kernels read and write the tensors' memory through the pointers fastmm passes, so a wrong stride,
offset, batch stride or pointer gives a wrong C (or fails the memory check: every element an
argument or a map reaches must lie in a live tensor made while the emulation is on). The GEMM
arithmetic is float64, rounded to float32 per slice: the emulation checks where fastmm's plans
read and write, not the kernels' rounding (the GPU tests do that). Stream-K plans are not
emulated (their launches fail loudly); at the sizes CPU tests use the planner never makes one.
"""
from __future__ import annotations

import ctypes
import struct
import weakref
from dataclasses import dataclass

import torch

from fastmm.families import MapSpec

#: Weak references to the storages of the tensors made by torch.empty / randn / full / zeros (and the
#: copies torch.Tensor.reshape makes) while the emulation is on. Weak, so that a buffer the host
#: code drops before the kernel reading it is queued (a staging copy) is no longer memory.
_memory: list = []
#: Whether kernels may only reach memory made while the emulation is on (False: a test that runs a
#: whole model, whose activations torch's own ops make, turns the check off for itself).
CHECK_MEMORY = True


def track(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        _memory.append(weakref.ref(t.untyped_storage()))
    return t


def floats(ptr: int, shape, strides, dtype=torch.float32) -> torch.Tensor:
    """A view of the memory at ``ptr`` (non-negative strides, in elements of ``dtype``)."""
    assert all(s >= 0 for s in strides), strides
    size = torch.tensor([], dtype=dtype).element_size()
    n = 1 + sum((d - 1) * s for d, s in zip(shape, strides)) if all(shape) else 0
    live = [s for s in (ref() for ref in _memory) if s is not None]
    assert not CHECK_MEMORY or any(s.data_ptr() <= ptr and ptr + size * n <= s.data_ptr() + s.nbytes() for s in live), (
        f"a kernel argument or tensor map reaches outside every live tensor: {n} elements at {ptr:#x}")
    ctype = {torch.float32: ctypes.c_float, torch.int32: ctypes.c_int32}[dtype]
    flat = torch.frombuffer((ctype * max(n, 1)).from_address(ptr), dtype=dtype)
    return flat.as_strided(tuple(shape), tuple(strides))


def tf32_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> TF32, to nearest, ties away from zero (cvt.rna; as tests/test_gpu.py)."""
    bits = x.contiguous().view(torch.int32)
    low = bits & 0x1FFF
    return ((bits & ~0x1FFF) + (low >= 0x1000).int() * 0x2000).view(torch.float32)


# ---------------------------------------------------------------------------------------------
# tensor maps

@dataclass(frozen=True)
class FakeMap:
    """What the emulated tensor_map.encode returns."""

    ptr: int
    spec: MapSpec
    tf32: bool


def encode(ptr: int, spec: MapSpec, *, tf32: bool = True) -> FakeMap:
    """cuTensorMapEncodeTiled's requirements for the wgmma family's maps (fp32, 128-byte swizzle);
    the driver would refuse the map (and fastmm fall back to torch) where one fails."""
    assert isinstance(spec, MapSpec) and len(spec.dims) == 4 and len(spec.strides) == 3 and len(spec.box) == 4, spec
    assert ptr % 16 == 0, f"map base {ptr:#x} is not 16-byte aligned"
    assert all(0 < d < 2**32 for d in spec.dims), spec
    assert all(s % 16 == 0 and 0 < s < 2**40 for s in spec.strides), spec
    assert all(0 < b <= 256 for b in spec.box), spec
    assert spec.box[0] * 4 % 16 == 0 and spec.box[0] * 4 <= 128, spec  # 128-byte swizzle: inner box <= 128 B
    floats(ptr, spec.dims[::-1], tuple(s // 4 for s in spec.strides[::-1]) + (1,))  # all of it is memory
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
    plane = floats(m.ptr + 4 * (c2 * s2 + c3 * s3), (d1, d0), (s1, 1))
    if mn:  # (row, k): plane is [k][row]
        plane = plane.t()
    plane = plane[:rows, :K]
    if m.tf32:
        plane = tf32_round(plane)
    out[:plane.shape[0], :plane.shape[1]] = plane.double()
    return out


# ---------------------------------------------------------------------------------------------
# the kernels

def _vectors(cfg) -> dict:
    """The vector accesses the kernel's macros ask for: operand -> (bytes per vector, the stride
    along which a vector runs, which must be 1 ("m", "k", "n" as in FASTMM_PARAMS' order))."""
    m, family = dict(cfg.macros), cfg.family
    out = {}
    if family in ("simt_float4", "simt_cp_async"):  # load modes of simt_core.cuh: 0 along the fast dim, 1 along k
        if m["A_MODE"] in (0, 1):
            out["a"] = (16, "m" if m["A_MODE"] == 0 else "k")
        if m["B_MODE"] in (0, 1):
            out["b"] = (16, "n" if m["B_MODE"] == 0 else "k")
        if m["C_VEC"]:
            out["c"] = (16, "n")
    elif family == "tf32_mma":  # 16-byte cp.async along the operand's shared-memory rows; float2 stores
        if m["A_VEC"]:
            out["a"] = (16, "k" if m["A_SMEM_MK"] else "m")
        if m["B_VEC"]:
            out["b"] = (16, "n" if m["B_SMEM_KN"] else "k")
        if m["C_VEC"]:
            out["c"] = (8, "n")
    elif family == "skinny":  # B read as float4 along n; v2's register path reads A as float4 along k
        if m["B_VEC"]:
            out["b"] = (16, "n")
        if m.get("A_VEC"):
            out["a"] = (16, "k")
    elif family in ("skinny_kmajor", "kmajor_mma"):  # W's rows (B along k) read as float4; A along k (16 bytes)
        if m["B_VEC"]:
            out["b"] = (16, "k")
        if m["A_VEC"]:
            out["a"] = (16, "k")
    return out


def _check_vector_access(cfg, args) -> None:
    """Every vector the kernel's macros make it load or store must be aligned to its size: the
    base pointer of every batch matrix, and every row of vectors (the other stride), with unit
    stride along the vector. (A kernel would fault, or read the wrong floats, on the GPU.)"""
    (pa, pb, pc, M, N, K, sam, sak, sbk, sbn, scm, scn, inner, total,
     sa0, sa1, sb0, sb1, sc0, sc1) = args[:20]
    sizes = {"m": M, "n": N, "k": K}
    operands = {"a": (pa, {"m": sam, "k": sak}, (sa0, sa1)),
                "b": (pb, {"k": sbk, "n": sbn}, (sb0, sb1)),
                "c": (pc, {"m": scm, "n": scn}, (sc0, sc1))}
    for which, (size, along) in _vectors(cfg).items():
        ptr, strides, batch = operands[which]
        floats_per = size // 4
        (across,) = [d for d in strides if d != along]
        where = f"{cfg.family} {which.upper()}: {size}-byte vectors along {along}, {dict(cfg.macros)}"
        assert ptr % size == 0, f"{where}: pointer {ptr:#x}"
        assert strides[along] == 1, f"{where}: strides {strides}"
        if sizes[across] > 1:  # every row of vectors starts aligned
            assert strides[across] % floats_per == 0, f"{where}: strides {strides}"
        assert all(s % floats_per == 0 for s in batch), f"{where}: batch strides {batch}"


def has_epilogue(cfg) -> bool:
    return ("EPILOGUE", 1) in cfg.macros


def split_epilogue(cfg, args) -> tuple[tuple, object]:
    """(the arguments before a fused epilogue's, the epilogue as a function of the finished
    (M, N) values at their row / column offsets), the identity where ``cfg`` has none."""
    if not has_epilogue(cfg):
        return args, lambda values, m0=0, n0=0: values
    pd, sdm, sdn, alpha_bits, beta_bits = args[-5:]
    alpha, beta = (struct.unpack("<f", struct.pack("<I", x))[0] for x in (alpha_bits, beta_bits))
    # wgmma's EPILOGUE_VECTOR reads D as one vector: D[n * sDn] (1) or D[m * sDm] (2), whatever
    # the other stride; it is built only for a D whose other stride is 0
    vector = dict(cfg.macros).get("EPILOGUE_VECTOR", 0)
    if vector:
        assert (sdm if vector == 1 else sdn) == 0, f"EPILOGUE_VECTOR={vector} launched with D strides {(sdm, sdn)}"
        sdm, sdn = (0, sdn) if vector == 1 else (sdm, 0)

    def epilogue(values, m0=0, n0=0):
        out = alpha * values.double()
        if beta != 0:  # (D is not read: NaN there is ignored)
            M, N = values.shape
            out = out + beta * floats(pd + 4 * (m0 * sdm + n0 * sdn), (M, N), (sdm, sdn)).double()
        return out.float()
    return args[:-5], epilogue


def emulate_gemm(cfg, args) -> None:
    """A GEMM family's kernel (FASTMM_PARAMS), split-K slices and the fused split's own sums."""
    assert cfg.stream_k is None, "stream-K launches are not emulated"
    args, epilogue = split_epilogue(cfg, args)
    # a split that a second pass sums writes partial slices only: its epilogue is the reduce's
    assert not (has_epilogue(cfg) and cfg.split_k > 1 and not cfg.split_fused), cfg
    fused = args[20:]  # a fused split-K launch: (out, its strides, arrival counters)
    assert len(args) >= 20 and len(fused) == (4 if cfg.split_fused else 0), (cfg.family, len(args))
    (pa, pb, pc, M, N, K, sam, sak, sbk, sbn, scm, scn, inner, total,
     sa0, sa1, sb0, sb1, sc0, sc1) = args[:20]
    assert 1 <= inner <= total and total % inner == 0, args
    _check_vector_access(cfg, args)
    split, bk = cfg.split_k, cfg.tile[2]
    per = -(-(-(-K // bk)) // split)  # k-tiles per block row, as split_range()
    for z in range(total):
        za, zb = z // inner, z % inner
        a = floats(pa + 4 * (za * sa0 + zb * sa1), (M, K), (sam, sak))
        b = floats(pb + 4 * (za * sb0 + zb * sb1), (K, N), (sbk, sbn))
        for y in range(split):
            k0, k1 = min(K, y * per * bk), min(K, (y + 1) * per * bk)
            part = (a[:, k0:k1].double() @ b[k0:k1].double()).float()
            if cfg.split_pair:  # cluster pairs: rows 2j and 2j + 1 add into slice j
                c = floats(pc + 4 * (za * sc0 + zb * sc1 + (y // 2) * sc0), (M, N), (scm, scn))
                c.copy_(part if y % 2 == 0 else c + part)
            else:
                c = floats(pc + 4 * (za * sc0 + zb * sc1 + y * sc0), (M, N), (scm, scn))
                c.copy_(part if split > 1 else epilogue(part))
    if fused:  # the last block of each column tile sums the slices in order; counters start at 0
        out, som, son, counters = fused
        count = floats(counters, (cfg.arrival_counters,), (1,), torch.int32)
        assert not count.any(), "arrival counters not zero at the launch"
        count += split  # every block of a tile arrives ...
        count.zero_()  # ... and the last one puts the count back
        sums = torch.zeros(M, N)
        for y in range(split):
            sums += floats(pc + 4 * y * sc0, (M, N), (scm, scn))
        floats(out, (M, N), (som, son)).copy_(epilogue(sums))


def emulate_reduce(cfg, args) -> None:
    """splitk_reduce.cu: C = the sum of S contiguous M x N slices, in slice order, in float32."""
    args, epilogue = split_epilogue(cfg, args)
    w, c, M, N, S, scm, scn = args
    work = floats(w, (S, M, N), (M * N, N, 1))
    total = torch.zeros(M, N)
    for s in range(S):
        total += work[s]
    floats(c, (M, N), (scm, scn)).copy_(epilogue(total))


def emulate_stage(cfg, args) -> None:
    """stage_kmajor.cu: dst[r * ld + k] = src[r * sR + k * sK], zero pad up to ld; SPLIT:
    dst = tf32(x), dst2 = tf32(x - tf32(x)). With batch arguments (batch_inner, batch_total, s0,
    s1): matrix z from src + z0 * s0 + z1 * s1 to dst + z * R * ld."""
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
        x = floats(src + 4 * ((z // inner) * s0 + (z % inner) * s1), (R, K), (s_r, s_k)).clone()
        if macros["SPLIT"]:
            big = tf32_round(x)
            small = tf32_round(x - big)
            small[~torch.isfinite(x)] = 0
            pairs = ((dst, big), (dst2, small))
        else:
            pairs = ((dst, x),)
        for ptr, value in pairs:
            d = floats(ptr + 4 * z * R * ld, (R, ld), (ld, 1))
            d[:, :K] = value
            d[:, K:] = 0


def _halves_sum(x: torch.Tensor) -> torch.Tensor:
    """What the kernel's split of an fp32 tile feeds the tensor core, summed: big = tf32(x) and
    small = tf32(x - big) (0 where x is not finite), as float64; where big is not finite (x
    rounded up to Inf), big alone, as the kernel keeps the big products' sum where it is not finite."""
    big = tf32_round(x.float())
    small = tf32_round(x.float() - big)
    small[~torch.isfinite(x)] = 0
    return torch.where(torch.isfinite(big), big.double() + small.double(), big.double())


def emulate_wgmma(cfg, maps, args) -> None:
    """cuda_src/wgmma_tf32.cu on (maps, args): C_z[m, n] = sum_k A(m, k) * B^T(n, k)."""
    assert cfg.family == "wgmma_tf32"
    macros = dict(cfg.macros)
    x3, a_mn, bn, c_vec = macros["PRECISION_X3"], macros["A_MN"], macros["BN"], macros["C_VEC"]
    bm = macros.get("BM", 128)  # 64: one consumer warpgroup, the cooperative form
    assert bm in (64, 128) and cfg.tile[0] == bm and cfg.block == 128 * (1 + bm // 64), cfg
    assert bm == 128 or not macros.get("PINGPONG"), cfg.macros
    split_b = macros.get("X3_SPLIT_B", 0)  # tf32x3 on 64-row tiles: B's fp32 tile split by the kernel
    assert split_b == int(bool(x3) and bm == 64), cfg.macros
    a_regs = macros.get("X3_A_REGS", 0)  # tf32x3 on 128-row tiles: A's fp32 tile split in registers
    assert not a_regs or (x3 and bm == 128 and not a_mn), cfg.macros
    args, epilogue = split_epilogue(cfg, tuple(args))
    split = cfg.split_k if cfg.split_fused else 1
    fused = args[11:]  # SPLIT: (C itself, its strides, the arrival counters) after the workspace's
    args = args[:11]
    assert len(fused) == (4 if split > 1 else 0) and all(isinstance(x, int) for x in args + fused), (args, fused)
    assert macros.get("SPLIT", 0) == int(split > 1), cfg.macros
    pc, M, N, K, scm, scn, inner, total, sc0, sc1, bits = args
    assert M > 0 and N > 0 and K > 0 and 1 <= inner <= total and total % inner == 0
    work = -(-M // bm) * -(-N // bn) * total
    if split > 1:  # one block a (tile, slice); the workspace: split M x N slices along C's
        # contiguous dim (m where A_MN writes an m-contiguous C: C_VEC 2; else n), lines padded to 4 floats
        assert total == 1 and cfg.grid == (work, split, 1) and cfg.work_items == work * split, (cfg.grid, args)
        som, son = fused[1:3]
        assert c_vec == (2 if a_mn and som == 1 and son != 1 else 1), (cfg.macros, som, son)
        pad = lambda x: -(-x // 4) * 4  # noqa: E731
        want = (1, pad(M), pad(M) * N) if c_vec == 2 else (pad(N), 1, pad(N) * M)
        assert (scm, scn, sc0, sc1) == want + (0,) and not macros.get("TMA_STORE"), args
    else:  # a 1-D grid walking (tile, batch entry) pairs: one block each, or fewer (persistent) taking turns
        assert cfg.work_items == work and 1 <= cfg.grid[0] <= work and cfg.grid[1:] == (1, 1), (cfg.grid, args)
    parts = 2 if x3 else 1
    a_parts = 1 if a_regs else parts
    b_parts = 1 if split_b else parts
    tma_store = macros.get("TMA_STORE", 0)
    assert len(maps) == a_parts + b_parts + tma_store
    a_maps, b_maps = maps[:a_parts], maps[a_parts:a_parts + b_parts]
    if tma_store:  # C written by the copy engine: fp32 boxes of 32 columns by the tile's rows
        c_map = maps[-1]
        assert c_map.spec.box == (32, bm, 1, 1) and not c_map.tf32 and c_map.ptr == pc, c_map
        assert c_map.spec.dims[:2] == (N, M) and c_map.spec.strides[0] == 4 * scm and scn == 1, (c_map.spec, args)
        regions = 2 if macros.get("PINGPONG") else 1  # (taking turns: a staging region each consumer)
        assert 1 <= macros["C_BOXES"] <= 4 and cfg.smem >= regions * macros["C_BOXES"] * bm * 32 * 4
        if macros.get("PINGPONG"):  # (tf32: a slot holds one A and one B tile)
            ring = macros["STAGES"] * (bm + bn) * 32 * 4
            assert cfg.smem >= 1024 + ring + regions * macros["C_BOXES"] * bm * 32 * 4, (cfg.smem, cfg.macros)
    if macros.get("C_COPY_OUT"):  # C staged the same way, written by the consumers: n-contiguous rows
        assert not tma_store and scn == 1 and not macros.get("PINGPONG") and split == 1, (cfg.macros, args)
        assert 1 <= macros["C_BOXES"] <= 4 and cfg.smem >= macros["C_BOXES"] * bm * 32 * 4
    for m in a_maps:  # the boxes must move what the kernel expects per stage (A_BYTES, B_BYTES)
        assert m.spec.box == ((32, 32, 1, 1) if a_mn else (32, bm, 1, 1)), m.spec
        assert m.tf32 == (not x3)
    for m in b_maps:
        assert m.spec.box == (32, bn, 1, 1), m.spec
        assert m.tf32 == (not x3)  # (X3_SPLIT_B: B itself in fp32; X3_A_REGS: A)
    assert all(m.spec == a_maps[0].spec for m in a_maps) and all(m.spec == b_maps[0].spec for m in b_maps)
    if c_vec == 1:  # float2 stores along n (a split's padded workspace lines take the pair past an odd N)
        assert (N % 2 == 0 or (split > 1 and scm % 4 == 0)) and scm % 2 == 0 and pc % 8 == 0 and sc0 % 2 == 0 and sc1 % 2 == 0, args
    elif c_vec == 2:  # float2 stores along m (adjacent row pairs of A_MN)
        assert a_mn and scm == 1 and scn % 2 == 0 and pc % 8 == 0 and sc0 % 2 == 0 and sc1 % 2 == 0, args
    for z in range(total):
        z0, z1 = z // inner, z % inner
        a2, a3 = (z1 if bits & 1 else 0), (z0 if bits & 2 else 0)
        b2, b3 = (z1 if bits & 4 else 0), (z0 if bits & 8 else 0)
        a = sum(_read_map(m, M, K, a2, a3, bool(a_mn)) for m in a_maps)
        bt = sum(_read_map(m, N, K, b2, b3, False) for m in b_maps)
        if split_b:  # the kernel's halves: big = tf32(x), small = tf32(x - big) (0 where x is not finite)
            bt = _halves_sum(bt)
        if a_regs:
            a = _halves_sum(a)
        if tma_store:  # the batch coordinates (z1, z0) through the map's 3rd and 4th dims
            d0, d1, d2, d3 = c_map.spec.dims
            s1, s2, s3 = (s // 4 for s in c_map.spec.strides)
            assert z1 < d2 and z0 < d3, (c_map.spec, z)
            c = floats(pc + 4 * (z1 * s2 + z0 * s3), (d1, d0), (s1, 1))
            assert c.data_ptr() == pc + 4 * (z0 * sc0 + z1 * sc1)  # the same matrix the strides name
        elif split > 1:
            # slice y holds k-tiles [y * per, (y + 1) * per) (split_range), none of them empty
            per = -(-(-(-K // 32)) // split)
            assert (split - 1) * per * 32 < K, (split, per, K)
            for y in range(split):
                k0, k1 = y * per * 32, min(K, (y + 1) * per * 32)
                floats(pc + 4 * y * sc0, (M, N), (scm, scn)).copy_((a[:, k0:k1] @ bt[:, k0:k1].t()).float())
            out, som, son, counters = fused
            count = floats(counters, (work,), (1,), torch.int32)
            assert cfg.arrival_counters == work and not count.any(), "arrival counters not zero at the launch"
            sums = torch.zeros(M, N)
            for y in range(split):  # the last block of each tile: the slices in slice order
                sums += floats(pc + 4 * y * sc0, (M, N), (scm, scn))
            floats(out, (M, N), (som, son)).copy_(epilogue(sums))
            continue
        else:
            c = floats(pc + 4 * (z0 * sc0 + z1 * sc1), (M, N), (scm, scn))
        c.copy_(epilogue((a @ bt.t()).float()))


PLAIN_KERNELS = {"splitk_reduce": emulate_reduce, "stage_kmajor": emulate_stage}
GEMM_FAMILIES = ("scalar", "simt_float4", "simt_cp_async", "tf32_mma", "skinny", "skinny_kmajor", "kmajor_mma")


# ---------------------------------------------------------------------------------------------
# the record

@dataclass(frozen=True)
class Launch:
    """One emulated launch: the kernel's config, its arguments after the tensor maps, the maps."""

    cfg: object
    args: tuple
    maps: tuple | None = None

    @property
    def family(self) -> str:
        return self.cfg.family

    @property
    def pointers(self) -> tuple:
        """The data pointers: what differs between two calls of one plan on fresh tensors."""
        d = self.args[-5:-4] if has_epilogue(self.cfg) else ()  # (a fused epilogue's D)
        if self.maps is not None:  # (C, or for SPLIT the workspace and C)
            return tuple(m.ptr for m in self.maps) + self.args[:1] + (self.args[11:12] if self.cfg.split_fused else ()) + d
        if self.family == "splitk_reduce":
            return self.args[:2] + d  # (workspace, C)
        if self.cfg.split_fused:
            return self.args[:3] + self.args[20:21] + d  # (A, B, workspace, out)
        return self.args[:3] + d  # (A, B, C); stage_kmajor: (source, copy, its second half)

    @property
    def rest(self) -> tuple:
        """Everything else: what a later call of the same plan must repeat exactly."""
        args = self.args
        if has_epilogue(self.cfg):  # (without D's pointer)
            args = args[:-5] + args[-4:]
        if self.maps is not None:  # (SPLIT: without C's pointer, with the arrival counters: per stream)
            rest = args[1:11] + args[12:] if self.cfg.split_fused else args[1:]
            return self.cfg, tuple((m.spec, m.tf32) for m in self.maps), rest
        if self.family == "splitk_reduce":
            return self.cfg, args[2:]
        if self.cfg.split_fused:
            return self.cfg, args[3:20] + args[21:]  # (the arrival counters too: per stream)
        return self.cfg, args[3:]


class EmulatedGpu:
    """What the emulation records: ``launches`` (:class:`Launch`, in order) and ``slow_calls``, the
    calls that took the full path (fastmm.dispatch.run)."""

    def __init__(self):
        self.launches: list[Launch] = []
        self.slow_calls = 0

    @property
    def families(self) -> list[str]:
        return [x.family for x in self.launches]

    def clear(self) -> None:
        del self.launches[:]


EMULATED_KERNEL = "emulated kernel"


def install(monkeypatch, gpu: EmulatedGpu) -> None:
    """Replace the launcher (load: the config itself; launch: emulated), tensor map encoding, and
    the tensor factories and reshape's copies (to know what is memory), for one test (monkeypatch
    restores them)."""
    from fastmm.runtime import launcher, tensor_map

    # (each under a profiler range named EMULATED_KERNEL: the torch ops computing a kernel here
    # are not the host code's, and a test counting those can leave them out)
    def launch(cfg, stream, args):
        assert stream == 7  # simulate_h200's current stream
        args = tuple(args)
        gpu.launches.append(Launch(cfg, args))
        with torch.profiler.record_function(EMULATED_KERNEL):
            if cfg.family in PLAIN_KERNELS:
                PLAIN_KERNELS[cfg.family](cfg, args)
            else:
                assert cfg.family in GEMM_FAMILIES, f"no emulation of a plain launch of {cfg.family}"
                emulate_gemm(cfg, args)

    def launch_with_maps(cfg, stream, maps, args):
        assert stream == 7
        gpu.launches.append(Launch(cfg, tuple(args), tuple(maps)))
        with torch.profiler.record_function(EMULATED_KERNEL):
            emulate_wgmma(cfg, tuple(maps), tuple(args))

    def recorded(make):
        def made(*args, **kwargs):
            return track(make(*args, **kwargs))
        return made

    for name in ("empty", "randn", "full", "zeros"):
        monkeypatch.setattr(torch, name, recorded(getattr(torch, name)))
    # (a reshape that cannot view copies into memory torch allocates itself: a Linear's flattened
    # rows of a seq-first x, which the weight gradient's kernel reads, are such a copy)
    reshape = torch.Tensor.reshape

    def reshaped(self, *args, **kwargs):
        out = reshape(self, *args, **kwargs)
        try:
            copied = out.untyped_storage().data_ptr() != self.untyped_storage().data_ptr()
        except (NotImplementedError, RuntimeError):  # (no storage: functorch wrappers, sparse)
            return out
        return track(out) if copied else out

    monkeypatch.setattr(torch.Tensor, "reshape", reshaped)
    monkeypatch.setattr(launcher, "load", lambda dev, cfg: cfg)
    monkeypatch.setattr(launcher, "launch", launch)
    monkeypatch.setattr(launcher, "launch_with_maps", launch_with_maps)
    # (a runner binds the kernel once: launcher.maps_launcher(loaded)(stream, maps, args))
    monkeypatch.setattr(launcher, "maps_launcher",
                        lambda cfg: lambda stream, maps, args: launch_with_maps(cfg, stream, maps, args))
    monkeypatch.setattr(tensor_map, "encode", encode)


def forget() -> None:
    """After a test: no memory is the emulation's any more."""
    del _memory[:]
