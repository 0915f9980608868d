"""The SIMT family's tiles of 16 x 8 outputs a thread besides its largest two (fastmm/families/
simt_cp_async.py) on a real GPU, against float64 (skipped without CUDA):
- the 64-wide ones (NARROW_TILE_OPTIONS): products of at most 64 columns with an m-contiguous A
  (attention's dV = P^T dO, dK = dS^T Q) or k-contiguous rows of A (P.V, dQ);
- the 64-row ones (HALF_TILE_OPTIONS): products whose last tile of rows is at most 64 rows
  (decode with 33-64 sequences, a few hundred tokens), against nn.Linear's W^T and a row-major B.
- the largest tile's single-float C stored through shared memory (C_STAGED: N % 4 != 0).
Every tile is run (the tuner may take any), over edges of M, N and K, batched, split (a reduce
pass or the fused sum), into NaN-filled outputs. (Products of K <= 256 and few outputs run the
scalar kernel whatever the variant: not here.)"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fastmm import dispatch
from fastmm.families import SimtCpAsync
from fastmm.families.simt_cp_async import HALF_TILE_OPTIONS, NARROW_TILE_OPTIONS
from fastmm.problem import Problem
from conftest import relative_error

pytestmark = pytest.mark.cuda

TOL = 1e-5


@dataclass(frozen=True)
class OneTile(SimtCpAsync):
    """simt_cp_async planned with one option, as a tuned choice would give it."""

    option: tuple = NARROW_TILE_OPTIONS[0]

    def configure(self, p, dev, option=None):
        return super().configure(p, dev, self.option)


def needs_sm80():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("simt_cp_async needs sm80+")


def check_tile(a, b, tile, split, a_mode):
    """``a @ b`` on tile ``tile`` (split-K allowed or not) into a NaN-filled out: planned
    with A copied in ``a_mode``, every output written, within TOL of float64, inputs unchanged."""
    a0, b0 = a.clone(), b.clone()
    out = torch.full(a.shape[:-1] + b.shape[-1:], float("nan"), device="cuda")
    fam = OneTile(option=tile + (split,))
    _, plan, reason = dispatch.matmul_fastmm(a, b, out, "ieee", force="simt_cp_async", variants=(fam,))
    assert reason is None and plan.kernel.family == "simt_cp_async", reason
    m = dict(plan.kernel.macros)
    assert (m["WARPS_M"], m["WARPS_N"], m["THREAD_M"]) == tile and m["A_MODE"] == a_mode
    assert not torch.isnan(out).any()
    err = relative_error(out, a.double() @ b.double())
    if out.numel() < 64 and err > TOL:
        err = relative_error(out, a, b, scale="abs")
    assert err <= TOL, (err, plan.describe())
    assert torch.equal(a, a0) and torch.equal(b, b0)


@pytest.mark.parametrize("split", (0, 1))
@pytest.mark.parametrize("tile", NARROW_TILE_OPTIONS)
@pytest.mark.parametrize("M, N, K, batch", [(512, 64, 512, 8), (384, 48, 300, 3), (4, 64, 300, 2), (260, 1, 301, 1),
                                            (1024, 61, 1024, 1), (128, 64, 4096, 1), (1000, 64, 7, 5)])
def test_narrow_tiles_match_float64(tile, split, M, N, K, batch):
    needs_sm80()
    a = torch.randn(batch, K, M, device="cuda").transpose(1, 2)  # m-contiguous A, as P^T is
    b = torch.randn(batch, K, N, device="cuda")
    check_tile(a, b, tile, split, a_mode=0)


@pytest.mark.parametrize("b_t", (False, True))
@pytest.mark.parametrize("split", (0, 1))
@pytest.mark.parametrize("tile", NARROW_TILE_OPTIONS)
@pytest.mark.parametrize("M, N, K, batch", [(512, 64, 512, 8), (384, 48, 300, 3), (4, 64, 300, 2), (260, 1, 301, 1),
                                            (1000, 61, 1024, 1), (129, 64, 4096, 1), (1000, 64, 7, 5)])
def test_narrow_tiles_with_a_k_contiguous_a_match_float64(tile, split, b_t, M, N, K, batch):
    """A's rows k-contiguous (attention's P.V, dQ): A copied in single floats along k, its 16
    copies a thread row-chained (AsyncTile::ROW_CHAIN), with a loop of its own for tiles wholly
    inside M; partial tiles of M (and of N) exercise the predicated chain."""
    needs_sm80()
    a = torch.randn(batch, M, K, device="cuda")
    b = torch.randn(batch, N, K, device="cuda").transpose(1, 2) if b_t else torch.randn(batch, K, N, device="cuda")
    check_tile(a, b, tile, split, a_mode=2)


def test_the_heuristic_runs_the_narrow_tile_on_attention_dv():
    needs_sm80()
    p = torch.softmax(torch.randn(128, 512, 512, device="cuda"), -1)
    g = torch.randn(128, 512, 64, device="cuda")
    import fastmm

    c = fastmm.matmul(p.transpose(1, 2), g, precision="ieee")
    plan = fastmm.explain(p.transpose(1, 2), g, precision="ieee").plan
    m = dict(plan.kernel.macros)
    assert (m["WARPS_M"], m["WARPS_N"], m["THREAD_M"]) == (2, 1, 16)
    assert relative_error(c, p.transpose(1, 2).double() @ g.double()) <= TOL


def test_the_heuristic_runs_the_narrow_tile_on_attention_pv():
    """P.V (A's rows k-contiguous, M a multiple of 128): the 128 x 64 tile with A's single-float
    copies chained, into a NaN-filled out, against float64."""
    needs_sm80()
    import fastmm

    p = torch.softmax(torch.randn(128, 512, 512, device="cuda"), -1)
    v = torch.randn(128, 512, 64, device="cuda")
    out = torch.full((128, 512, 64), float("nan"), device="cuda")
    fastmm.matmul(p, v, out=out, precision="ieee")
    m = dict(fastmm.explain(p, v, precision="ieee").plan.kernel.macros)
    assert (m["WARPS_M"], m["WARPS_N"], m["THREAD_M"], m["A_MODE"]) == (2, 1, 16, 2)
    assert not torch.isnan(out).any()
    assert relative_error(out, p.double() @ v.double()) <= TOL


@pytest.mark.parametrize("split", (0, 1))
@pytest.mark.parametrize("tile", HALF_TILE_OPTIONS)
@pytest.mark.parametrize("M, N, K, batch", [(64, 4096, 4096, 1), (33, 1000, 1100, 1), (1, 256, 300, 2),
                                            (300, 700, 1100, 1), (129, 129, 4096, 1), (17, 2051, 64, 3),
                                            (64, 255, 7, 1)])
def test_half_tiles_match_float64(tile, split, M, N, K, batch):
    """x @ W.t() (A's rows and B both k-contiguous, B's single-float copies row-chained on the 64 x
    256 tile): partial tiles of M, N and K, batched."""
    needs_sm80()
    a = torch.randn(batch, M, K, device="cuda")
    b = torch.randn(N, K, device="cuda").t()
    check_tile(a if batch > 1 else a[0], b, tile, split, a_mode=2)


@pytest.mark.parametrize("split", (0, 1))
@pytest.mark.parametrize("a_t", (False, True))
@pytest.mark.parametrize("M, N, K", [(64, 4096, 1024), (300, 700, 1100), (48, 260, 2049)])
def test_half_tiles_with_a_row_major_b_match_float64(a_t, split, M, N, K):
    """B row-major (grad_x = grad_y @ W), A k- or m-contiguous (float4 along m, or single floats
    where M % 4 != 0), on every half tile that is offered for those load modes (the 64 x 128 one
    is not with a k-contiguous A: it spills there)."""
    needs_sm80()
    a = torch.randn(K, M, device="cuda").t() if a_t else torch.randn(M, K, device="cuda")
    b = torch.randn(K, N, device="cuda")
    fam = SimtCpAsync()
    p = Problem.dense(M, N, K, "ieee", a_t=a_t)
    tiles = fam.half_tiles(p)
    assert (1, 4, 16) in tiles and ((1, 2, 16) in tiles) == a_t
    for tile in tiles:
        check_tile(a, b, tile, split, a_mode=fam.load_modes(p)[0])


#: products with N % 4 != 0 on the largest tile (128 x 256): C stored in single floats through
#: the pipeline's shared buffers (C_STAGED, sm_90), over edges of M, N and K, W^T / row-major B /
#: A^T, a batch, stream-K (8192 x 8191 x 2048 leaves a partial last wave)
STAGED_C = [(300, 301, 70, "row", 1), (129, 257, 33, "w_t", 1), (1000, 1001, 1003, "a_t", 1),
            (8, 4095, 64, "w_t", 1), (260, 3, 300, "row", 1), (257, 1023, 129, "w_t", 3)]


@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("M, N, K, layout, batch", STAGED_C + [(8192, 8191, 2048, "row", 1)])
def test_single_float_c_through_shared_memory_matches_float64(M, N, K, layout, batch, bias):
    """Every output of the staged store written once (NaN-filled out), within TOL of float64,
    with the epilogue (a bias over C's columns) applied as it leaves shared memory."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the planner stages C on sm_90 (measured there)")
    lead = (batch,) if batch > 1 else ()
    a = torch.randn(*lead, K, M, device="cuda").transpose(-1, -2) if layout == "a_t" else torch.randn(*lead, M, K, device="cuda")
    b = torch.randn(N, K, device="cuda").t() if layout == "w_t" else torch.randn(K, N, device="cuda")
    a0, b0 = a.clone(), b.clone()
    big = M * N * K > 2**36  # the heuristic's own plan (stream-K) for the large one
    variants = () if big else (OneTile(option=SimtCpAsync.tile_options[0] + (0,)),)
    if bias:
        d = torch.randn(N, device="cuda")
        out, plan, reason = dispatch.matmul_fused(a, b, d, 1.0, 1.0, "ieee", force="simt_cp_async", variants=variants)
        ref = a.double() @ b.double() + d.double()
    else:
        out = torch.full(lead + (M, N), float("nan"), device="cuda")
        _, plan, reason = dispatch.matmul_fastmm(a, b, out, "ieee", force="simt_cp_async", variants=variants)
        ref = a.double() @ b.double()
    assert reason is None, reason
    assert dict(plan.kernel.macros).get("C_STAGED") == 1 and plan.kernel.tile[:2] == (128, 256), plan.describe()
    assert ("stream_k" in plan.kernel.entry) == big
    assert not torch.isnan(out).any()
    err = relative_error(out, ref)
    assert err <= TOL, (err, plan.describe())
    assert torch.equal(a, a0) and torch.equal(b, b0)
