"""The host side of the wgmma_tf32 family on the CPU: tensor maps, batch bits, the C^T = B^T A^T
swap, launch offsets, C strides and the staging buffers, on the full path (fastmm.dispatch, through
runtime.runners.runner_for) and the fast path (the FastEntry's runner: runtime.runners.wgmma_runner).

On the emulated GPU (conftest.emulated_gpu, tests/emulation.py): ``tensor_map.encode`` records
(pointer, MapSpec, tf32) instead of asking the driver (checking what cuTensorMapEncodeTiled
requires), the wgmma launch computes C from those maps as cuda_src/wgmma_tf32.cu does (map
coordinates of the producer's tma_load_4d, zeros outside the map, TF32 rounding of the copy engine,
the epilogue's addressing), and stage_kmajor launches make the copies as cuda_src/stage_kmajor.cu
does. Every element a map or an argument reaches must lie in a tensor made during the test.
"""
from __future__ import annotations

import pytest
import torch

import fastmm
from fastmm import dispatch, fast_path
from fastmm.families import FAMILIES
from emulation import tf32_round
from conftest import relative_error

NAN = float("nan")
WGMMA = FAMILIES["wgmma_tf32"]


def _check(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, precision: str = "tf32") -> None:
    """C against float64 references: A @ B of the TF32-rounded inputs (what the copy engine
    feeds the tensor core) to float32 accuracy, and the exact product at TF32 accuracy."""
    exact = a.double() @ b.double()
    assert c.shape == exact.shape
    assert not torch.isnan(c).any(), "some element of C was not written"
    if precision == "tf32x3":
        assert relative_error(c, exact) <= 1e-6
        return
    assert relative_error(c, tf32_round(a), tf32_round(b)) <= 1e-6
    assert relative_error(c, exact) <= 3e-3


def _the_plan():
    plans = {hit.plan for hit in dispatch.PLANS.prepared.values()}
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
    assert gpu.families == (["stage_kmajor"] * len(plan.staging) + ["wgmma_tf32"]) * launches
    entry = fast_path.ENTRIES[fast_path.key_of(a, b, out, precision)]
    fast = launches == 1
    assert isinstance(entry, fast_path.FastEntry) == fast and (fast or entry is fast_path.NOT_FAST), (
        plan.describe(), len(first))
    if fast:
        assert entry.runner is not None  # the wgmma runner
    c2 = fastmm.matmul(a, b, precision=precision, out=make_out())
    assert torch.equal(c2, c), "a later call with the same operands computed other bits"
    for _ in range(calls - 1):
        a, b = make()
        out = make_out()
        gpu.clear()
        c = fastmm.matmul(a, b, precision=precision, out=out)
        assert out is None or c is out
        assert out is not None or c.is_contiguous()
        _check(c, a, b, precision)
        assert [x.rest for x in gpu.launches] == [x.rest for x in first]
    assert gpu.slow_calls == (1 if fast else calls + 1)
    return plan


# ---------------------------------------------------------------------------------------------
# the heuristics' own choice (no force): big enough that 128x128 tiles fill 1/3 of the SMs

M, N, K = 1040, 772, 68  # K % 32 != 0: a k-tail; M, N not multiples of the tiles


def test_row_major_operands_are_computed_transposed_without_copies(emulated_gpu):
    """A, B row-major: C^T = B^T A^T, B as the m-contiguous (register-fed) A of the kernel."""
    plan = _calls(emulated_gpu, lambda: (torch.randn(M, K), torch.randn(K, N)))
    assert plan.swap_ab and not plan.staging and dict(plan.kernel.macros)["A_MN"] == 1
    assert plan.origin == "heuristic"


def test_tiles_of_another_width_map_b_in_boxes_of_that_width(emulated_gpu):
    """A tile width other than BM: B's box (and the grid) follow the tile, not BM."""
    plan = _calls(emulated_gpu, lambda: (torch.randn(2048, 36), torch.randn(2048, 36).t()))
    bn = dict(plan.kernel.macros)["BN"]
    assert bn != 128 and not plan.swap_ab and not plan.staging
    (launch,) = emulated_gpu.launches
    assert launch.maps[1].spec.box == (32, bn, 1, 1)


def test_a_row_major_with_b_k_major_reads_both_in_place(emulated_gpu):
    plan = _calls(emulated_gpu, lambda: (torch.randn(M, K), torch.randn(N, K).t()))
    assert not plan.swap_ab and not plan.staging and dict(plan.kernel.macros)["A_MN"] == 0


def test_m_contiguous_a_with_k_major_b_feeds_a_from_registers(emulated_gpu):
    plan = _calls(emulated_gpu, lambda: (torch.randn(K, M).t(), torch.randn(N, K).t()))
    assert not plan.swap_ab and not plan.staging and dict(plan.kernel.macros)["A_MN"] == 1


def test_m_contiguous_a_with_row_major_b_stages_b_transposed(emulated_gpu):
    """One operand staged (B^T, K-major) each call, by the fast path's runner after the first.
    (K = 2068: at K = 68 the copy's launch makes the call host-bound, and the planner runs the
    fp32 SIMT plan instead, cost.HOST_US_PER_LAUNCH.)"""
    k = 2068
    plan = _calls(emulated_gpu, lambda: (torch.randn(k, M).t(), torch.randn(k, N)))
    assert not plan.swap_ab and [w for w, _, _ in plan.staging] == ["bt"]
    assert dict(plan.kernel.macros)["A_MN"] == 1


def test_row_major_a_with_misaligned_b_pitch_stages_only_b(emulated_gpu):
    """B's rows 771 floats apart (no 16-byte pitch): B^T copied, A read in place."""
    plan = _calls(emulated_gpu, lambda: (torch.randn(M, K), torch.randn(K, N + 1)[:, :N - 1]))
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
def test_out_variants_are_written_through_their_strides(emulated_gpu, monkeypatch, case, out_kind):
    """out= contiguous, NaN-filled (every element must be written), a transposed view (C
    m-contiguous) and a row-strided slice of a wider tensor (odd offset and pitch: single-float
    stores); with and without the swap, batched too."""
    if case == "batched":
        monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    make = OUT_CASES[case]
    a, b = make()
    shape = tuple(torch.matmul(a[..., :1, :], b[..., :, :1]).shape[:-2]) + (a.shape[-2], b.shape[-1])
    plan = _calls(emulated_gpu, make, lambda: OUTS[out_kind](shape))
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
    # (a batch dim of 1: a plain matrix B would be folded into one product, as torch.matmul does)
    "broadcast-b": (lambda: (torch.randn(4, Mb, Kb), torch.randn(1, Kb, Nb)), True, 4),
    "expanded-a": (lambda: (torch.randn(Mb, Kb).expand(4, Mb, Kb), torch.randn(4, Kb, Nb)), True, 1),
    "expanded-both": (lambda: (torch.randn(1, Mb, Kb).expand(5, Mb, Kb), torch.randn(Kb, Nb).expand(5, Kb, Nb)),
                      True, 0),
    "4d-broadcast": (lambda: (torch.randn(3, 1, Mb, Kb), torch.randn(2, Kb, Nb)), True, 1 | 8),  # B inner, A outer
    "4d-broadcast-b-k-major": (lambda: (torch.randn(3, 1, Mb, Kb), torch.randn(2, Nb, Kb).transpose(1, 2)),
                               False, 2 | 4),
}


@pytest.mark.parametrize("case", list(BATCH_CASES))
def test_batches_walk_the_maps_batch_dims(emulated_gpu, monkeypatch, case):
    make, swap, bits = BATCH_CASES[case]
    monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    plan = _calls(emulated_gpu, make)
    assert plan.swap_ab == swap and not plan.staging
    p = plan.launch_problem or plan.problem
    assert p.batch_total > 1
    assert WGMMA.map_specs(p, plan.kernel)[2] == bits
    (launch,) = emulated_gpu.launches
    assert launch.args[-1] == bits


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
def test_edge_layouts(emulated_gpu, monkeypatch, case):
    """C with its batch dim innermost or batch dims out of order, C 8-byte aligned, A batches
    overlapping in memory, 1-D A and a one-column B (staged: a size-1 dim's stride reads as 1)."""
    monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    make, make_out = EDGE_CASES[case]
    _calls(emulated_gpu, make, make_out)


def test_three_batch_dims_launch_once_per_outer_index(emulated_gpu, monkeypatch):
    """Batch dims that do not fuse: a Python loop of launches at offsets (exchanged with the
    operands where the plan swaps); never a fast entry."""
    monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    plan = _calls(emulated_gpu, lambda: (torch.randn(2, 3, 4, 128, 64), torch.randn(3, 1, 64, 136)))
    assert plan.swap_ab
    assert len(emulated_gpu.launches) == 2


@pytest.mark.parametrize("form", ["row-major-b", "m-contiguous-a", "row-major-b-split", "batched"])
def test_a_fed_from_registers_on_64_row_tiles_maps_a_in_32_row_boxes(emulated_gpu, form):
    """A_MN on 64-row tiles (the planner's for a row-major B as C^T; asked for, rows64="always",
    for an m-contiguous A read in place and a split): two 32-row boxes of A a k-step, a 256-thread block, the same
    maps as the 128-row tile's, C written through its strides (float2 along m, the copy engine,
    a split's workspace); every output right into NaN-filled C."""
    from fastmm.families import WgmmaTf32

    a, b = {"row-major-b": lambda: (torch.randn(300, 1000), torch.randn(1000, 700)),
            "m-contiguous-a": lambda: (torch.randn(1100, 1000).t(), torch.randn(700, 1100).t()),
            "row-major-b-split": lambda: (torch.randn(197, 3100), torch.randn(3100, 768)),
            "batched": lambda: (torch.randn(3, 96, 200), torch.randn(3, 200, 264))}[form]()
    out = torch.full(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), NAN)
    variant = WgmmaTf32() if form == "row-major-b" else WgmmaTf32(rows64="always")
    result, plan, reason = dispatch.matmul_fastmm(a, b, out, "tf32", force="wgmma_tf32", variants=(variant,))
    assert reason is None and result is out and not plan.staging, reason
    m = dict(plan.kernel.macros)
    assert m["A_MN"] == 1 and m["BM"] == 64 and plan.kernel.block == 256 and plan.swap_ab == (form != "m-contiguous-a")
    assert m.get("SPLIT", 0) == int(form == "row-major-b-split"), plan.describe()
    launch = emulated_gpu.launches[-1]
    assert launch.maps[0].spec.box == (32, 32, 1, 1)
    _check(out, a, b)


def test_forced_small_row_major_product_through_matmul_fastmm(emulated_gpu):
    """dispatch.matmul_fastmm with force= (the full path only), C given NaN-filled."""
    a, b, out = torch.randn(256, 64), torch.randn(64, 384), torch.full((256, 384), NAN)
    result, plan, reason = dispatch.matmul_fastmm(a, b, out, "tf32", force="wgmma_tf32")
    assert reason is None and result is out and plan.kernel.family == "wgmma_tf32" and plan.swap_ab
    _check(out, a, b)
    assert emulated_gpu.families == ["wgmma_tf32"]


# ---------------------------------------------------------------------------------------------
# staging both operands

def _offset_by_one(*shape):
    """A tensor whose data starts 4 bytes into its storage (4-byte aligned only)."""
    n = 1
    for d in shape:
        n *= d
    return torch.randn(n + 1)[1:].view(*shape)


def test_unaligned_operands_are_both_staged(emulated_gpu):
    """A at storage offset 1, B with an odd pitch (N = 257), K = 70: neither readable by a
    tensor map, both copied K-major (pad columns up to 72) before the launch."""
    a, b = _offset_by_one(300, 70), torch.randn(70, 257)
    result, plan, reason = dispatch.matmul_fastmm(a, b, None, "tf32", force="wgmma_tf32")
    assert reason is None and plan.kernel.family == "wgmma_tf32"
    assert plan.staging == (("a", 300, 72), ("bt", 257, 72)) and not plan.swap_ab
    _check(result, a, b)
    assert emulated_gpu.families == ["stage_kmajor", "stage_kmajor", "wgmma_tf32"]
    (src1, dst1, _), (src2, dst2, _), maps = (x.pointers for x in emulated_gpu.launches)
    assert (src1, src2) == (a.data_ptr(), b.data_ptr())
    assert maps[:2] == (dst1, dst2)  # the kernel reads the copies


def test_unaligned_operands_take_the_fast_path_with_their_copies(emulated_gpu, monkeypatch):
    monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    plan = _calls(emulated_gpu, lambda: (_offset_by_one(300, 70), torch.randn(70, 257)),
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
    "tf32x3-b-broadcast": (lambda: (torch.randn(4, Mb, Kb), torch.randn(1, Kb, Nb)), "tf32x3", ["a", "bt"]),
}


@pytest.mark.parametrize("case", list(BATCH_STAGED))
def test_batched_operands_are_staged_matrix_by_matrix(emulated_gpu, monkeypatch, case):
    """Copies of a batched operand: one K-major matrix per batch index it really has (a
    broadcast operand copied once), read through the map's batch dims."""
    make, precision, staged = BATCH_STAGED[case]
    monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    plan = _calls(emulated_gpu, make, precision=precision)
    assert [w for w, _, _ in plan.staging] == staged and plan.problem.batch_total > 1


def test_tf32x3_splits_both_operands_into_halves(emulated_gpu, monkeypatch):
    """tf32x3: both operands staged as big and small TF32 halves, four plain fp32 maps."""
    monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    plan = _calls(emulated_gpu, lambda: (torch.randn(200, 130), torch.randn(130, 260)), precision="tf32x3")
    assert [w for w, _, _ in plan.staging] == ["a", "bt"] and plan.precision_used == "tf32x3"
    assert all(dict(s.macros)["SPLIT"] == 1 for s in plan.stagers)


@pytest.mark.parametrize("a_layout", ["row-major", "m-contiguous", "unaligned-rows"])
def test_tf32x3_splitting_a_in_registers_stages_b_only(emulated_gpu, monkeypatch, a_layout):
    """X3_A_REGS (``WgmmaTf32(x3_a_regs=True)``): A reaches the kernel as fp32 through one plain
    map, in place where a map can read it, else through a K-major fp32 copy (an m-contiguous A,
    rows not 16-byte multiples), and the kernel splits it; B is staged in its halves. The full
    path, then the fast path's runner; every output right."""
    from fastmm.families import WgmmaTf32

    monkeypatch.setitem(FAMILIES, "wgmma_tf32", WgmmaTf32(x3_a_regs=True))
    monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    make = {"row-major": lambda: (torch.randn(200, 132), torch.randn(132, 260)),
            "m-contiguous": lambda: (torch.randn(132, 200).t(), torch.randn(132, 260)),
            "unaligned-rows": lambda: (torch.randn(200, 130), torch.randn(130, 260))}[a_layout]
    plan = _calls(emulated_gpu, make, precision="tf32x3")
    assert dict(plan.kernel.macros)["X3_A_REGS"] == 1 and plan.kernel.tile[0] == 128
    staged = {w: dict(s.macros)["SPLIT"] for (w, _, _), s in zip(plan.staging, plan.stagers)}
    assert staged == ({"bt": 1} if a_layout == "row-major" else {"a": 0, "bt": 1}), plan.describe()
    launch = emulated_gpu.launches[-1]
    assert len(launch.maps) == 3 + dict(plan.kernel.macros).get("TMA_STORE", 0) and not launch.maps[0].tf32


def test_encoded_maps_are_remembered_by_pointer_geometry_and_element_type(monkeypatch):
    """tensor_map.encode (the real one, its driver call counted instead): a map is encoded once
    per (pointer, geometry, TF32 or not), an equal MapSpec made apart (the full path's, the
    runner's) finds it, and any other field encodes a map of its own."""
    from fastmm.families import MapSpec
    from fastmm.runtime import tensor_map

    encoded = []
    monkeypatch.setattr(tensor_map, "_recent", {})
    monkeypatch.setattr(tensor_map, "encode_new", lambda ptr, spec, tf32=True: encoded.append((ptr, spec, tf32))
                        or len(encoded))
    spec = MapSpec((64, 128, 1, 1), (256, 32768, 32768), (32, 128, 1, 1))
    first = tensor_map.encode(4096, spec)
    assert tensor_map.encode(4096, MapSpec(spec.dims, spec.strides, spec.box), tf32=True) == first
    others = [tensor_map.encode(8192, spec), tensor_map.encode(4096, spec, tf32=False),
              tensor_map.encode(4096, MapSpec((64, 120, 1, 1), spec.strides, spec.box)),
              tensor_map.encode(4096, MapSpec(spec.dims, (512, 65536, 65536), spec.box)),
              tensor_map.encode(4096, MapSpec(spec.dims, spec.strides, (32, 64, 1, 1)))]
    assert len(set(others + [first])) == 6 and len(encoded) == 6
