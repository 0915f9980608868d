"""The steady-state path of fastmm.matmul (fastmm.fast_path: key_of, remember, launch) on the
emulated GPU (conftest.emulated_gpu, tests/emulation.py).

CPU tensors pass for CUDA ones on a simulated H200 and the kernels are emulated from their
arguments, reading and writing the tensors' memory through their data pointers. So the first call
of a layout (the full path, fastmm.dispatch) and every later one (the FastEntry that
fast_path.remember stored) both really compute C: they must be right, and queue the same
launches (pointers aside). The key must tell apart every layout whose plan differs: the same
shapes with other strides are another problem.
"""
from __future__ import annotations

import pytest
import torch

import fastmm
from fastmm import dispatch, fast_path
from conftest import relative_error

NAN = float("nan")


def _same_launches(first, later) -> None:
    """``later`` queues what ``first`` queued: the same kernels and arguments, except the data
    pointers (fresh tensors, a fresh workspace); a GEMM and its reduce share their workspace."""
    assert [x.rest for x in later] == [x.rest for x in first]
    if len(later) == 2 and later[1].family == "splitk_reduce":
        assert later[0].pointers[2] == later[1].pointers[0]


#: fp32 paths exactly, TF32 tensor cores within TF32's rounding (the emulated wgmma rounds its
#: inputs as the copy engine does)
TOL = {"ieee": 1e-6, "tf32": 1e-3}


def _check(c, a, b, precision="ieee") -> None:
    assert not torch.isnan(c).any(), "an element of C was not written"
    assert relative_error(c, a, b) <= TOL[precision]


def _entry(a, b, out, precision):
    return fast_path.ENTRIES.get(fast_path.key_of(a, b, out, precision))


SPLIT_SHAPES = [(16, 4096, 4096, "ieee", "skinny"), (16, 4096, 4096, "tf32", "skinny"),
                (64, 64, 16384, "ieee", "simt_cp_async"), (64, 64, 8192, "tf32", "tf32_mma"),
                (4096, 48, 8192, "tf32", "wgmma_tf32"),  # computed as C^T: 48 rows, K split over the SMs
                (700, 300, 6000, "tf32", "wgmma_tf32"),  # computed as C^T: 64-row tiles, K split in 4
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
    fused = exp.plan.kernel.split_fused  # the skinny and wgmma kernels sum their own slices (sm_90)
    assert fused == (family in ("skinny", "wgmma_tf32"))
    assert exp.kernel == family and (exp.plan.reduce is None) == fused and exp.plan.kernel.split_k > 1, str(exp)
    out = make_out()
    c = fastmm.matmul(a, b, precision=precision, out=out)
    assert out is None or c is out
    _check(c, a, b, precision)
    assert gpu.slow_calls == 1
    first = list(gpu.launches)
    assert gpu.families == [family] + ([] if fused else ["splitk_reduce"])
    entry = _entry(a, b, out, precision)
    assert isinstance(entry, fast_path.FastEntry) and entry.runner is not None  # the reduce pass or the counters
    for _ in range(3):
        a, b = torch.randn(M, K), torch.randn(K, N)
        out = make_out()
        gpu.clear()
        c = fastmm.matmul(a, b, precision=precision, out=out)
        assert out is None or c is out
        assert c.shape == (M, N) and (out is not None or c.is_contiguous())
        _check(c, a, b, precision)
        _same_launches(first, gpu.launches)
    assert gpu.slow_calls == 1  # every later call took the fast path


def test_a_one_launch_plan_is_a_fast_entry_of_one_plain_launch(emulated_gpu):
    gpu = emulated_gpu
    a, b = torch.randn(2, 96, 80), torch.randn(80, 72)  # N-D @ a matrix: folded into one (192, 72) product
    assert fastmm.explain(a, b, precision="ieee").plan.reduce is None
    _check(fastmm.matmul(a, b, precision="ieee"), a, b)
    first = list(gpu.launches)
    entry = _entry(a, b, None, "ieee")
    assert len(first) == 1 and entry.runner is None and entry.kernel is first[0].cfg
    assert entry.tail == first[0].args[3:]  # the arguments after the three pointers, as the full path passed them
    assert (entry.out_shape, entry.extents) == ((2, 96, 72), None)  # C allocated as matmul returns it
    a, b = torch.randn(2, 96, 80), torch.randn(80, 72)
    gpu.clear()
    c = fastmm.matmul(a, b, precision="ieee")
    assert c.shape == (2, 96, 72)
    _check(c, a, b)
    _same_launches(first, gpu.launches)
    assert gpu.slow_calls == 1


def test_a_vector_operand_gets_the_squeezed_result_from_the_fast_path(emulated_gpu):
    """1-D B: the kernel writes an (M, 1) matrix, the same memory as the (M,) result the entry
    allocates and returns."""
    a = torch.randn(300, 70)
    for _ in range(3):
        v = torch.randn(70)
        c = fastmm.matmul(a, v, precision="ieee")
        assert c.shape == (300,)
        _check(c, a, v)
    entry = _entry(a, v, None, "ieee")
    assert entry.out_shape == (300,) and c.is_contiguous()
    assert emulated_gpu.slow_calls == 1


def test_staged_plans_take_the_fast_path_and_copy_on_every_call(emulated_gpu):
    """A plan whose operand is copied first (here A, rows of 8191 floats, copied K-major for
    wgmma's tensor maps; a split-K plan): its stager is a kernel of the plan, so the steady state
    queues the copy and the GEMM (and its reduce) on every call, from the fast entry, reading
    each call's own A."""
    gpu = emulated_gpu
    a, b = torch.randn(64, 8191), torch.randn(8191, 1024)  # rows of A: 8191 floats, not 16-byte aligned
    plan = fastmm.explain(a, b, precision="tf32").plan
    assert plan.staging == (("a", 64, 8192),) and plan.kernel.split_k > 1, plan.describe()
    assert [k.family for k in plan.stagers] == ["stage_kmajor"]
    for _ in range(3):
        a = torch.randn(64, 8191)
        gpu.clear()
        _check(fastmm.matmul(a, b, precision="tf32"), a, b, "tf32")
        assert gpu.families == ["stage_kmajor", "wgmma_tf32"]  # (C^T on 64-row tiles, the split summed in the kernel)
        assert gpu.launches[0].pointers[0] == a.data_ptr()  # this call's A is copied
        # the GEMM reads the copy: as its B operand (C^T = B^T A^T: the tensor maps' pointers, B^T's then A's copy)
        assert gpu.launches[1].pointers[1] == gpu.launches[0].pointers[1]
        assert gpu.launches[1].pointers[0] == b.data_ptr()
    entry = _entry(a, b, None, "tf32")
    assert entry is not fast_path.NOT_FAST and entry is not None
    assert gpu.slow_calls == 1


def test_an_out_overlapping_an_input_is_not_written_by_the_split_k_fast_path(emulated_gpu):
    """A fast entry stored for an out apart from the inputs must not serve a later call (same
    key) whose out is A's memory: the full path computes aside, then copies."""
    M, N, K = 16, 4096, 4096  # M * K == M * N: A and out can be the same floats
    a, b, out = torch.randn(M, K), torch.randn(K, N), torch.full((M, N), NAN)
    fastmm.matmul(a, b, precision="ieee", out=out)
    key = fast_path.key_of(a, b, out, "ieee")
    assert fast_path.ENTRIES[key].runner is not None
    a2 = torch.randn(M, K)
    out2 = a2.view(M, N)
    assert fast_path.key_of(a2, b, out2, "ieee") == key
    expected = a2.double() @ b.double()
    assert fastmm.matmul(a2, b, precision="ieee", out=out2) is out2
    assert relative_error(out2, expected) <= 1e-6
    assert emulated_gpu.slow_calls == 2


# --- the key: every layout whose plan differs is another key ---------------------------------------

M_, N_, K_ = 96, 80, 72  # one launch of simt_cp_async (ieee)

OTHER_LAYOUTS = {
    # which operand gets other strides (same shape, same 16-byte alignment): (a, b, out) makers
    "a-transposed": lambda: (torch.randn(K_, M_).t(), torch.randn(K_, N_), None),
    "b-transposed": lambda: (torch.randn(M_, K_), torch.randn(N_, K_).t(), None),
    "a-row-pitch": lambda: (torch.randn(M_, K_ + 8)[:, :K_], torch.randn(K_, N_), None),
    "out-transposed": lambda: (torch.randn(M_, K_), torch.randn(K_, N_), torch.full((N_, M_), NAN).t()),
    "out-row-pitch": lambda: (torch.randn(M_, K_), torch.randn(K_, N_), torch.full((M_, N_ + 4), NAN)[:, :N_]),
}


@pytest.mark.parametrize("layout", list(OTHER_LAYOUTS))
def test_the_same_shapes_with_other_strides_are_planned_again_and_computed_right(emulated_gpu, layout):
    """Contiguous operands first (their entry is stored), then the same shapes with one operand
    strided otherwise: the key holds the strides, so that call plans its own layout (a key
    without them launched the contiguous plan on a transposed A: relative error 1.41), and the
    entry of each layout then serves its own later calls."""
    gpu = emulated_gpu
    with_out = layout.startswith("out")

    def contiguous():
        return torch.randn(M_, K_), torch.randn(K_, N_), torch.full((M_, N_), NAN) if with_out else None

    for make in (contiguous, OTHER_LAYOUTS[layout], contiguous, OTHER_LAYOUTS[layout]):
        a, b, out = make()
        c = fastmm.matmul(a, b, precision="ieee", out=out)
        assert out is None or c is out
        _check(c, a, b)
    assert gpu.slow_calls == 2  # each layout planned once, then served by its own entry
    assert len(fast_path.ENTRIES) == 2


def _at(shape, offset, fill=None):
    """A tensor of ``shape`` starting ``offset`` floats into its storage (offset 1: 4-byte aligned)."""
    n = shape[0] * shape[1]
    base = torch.randn(n + 4) if fill is None else torch.full((n + 4,), fill)
    return base[offset:offset + n].view(shape)


ALIGNMENTS = {
    # which operand moves 4 bytes off its 16-byte alignment: (a, b, out) makers for an offset
    "a": lambda o: (_at((K_, M_), o).t(), torch.randn(K_, N_), None),  # m-contiguous A: float4 along m
    "b": lambda o: (torch.randn(M_, K_), _at((K_, N_), o), None),  # float4 along n
    "out": lambda o: (torch.randn(M_, K_), torch.randn(K_, N_), _at((M_, N_), o, NAN)),  # float4 stores
}


@pytest.mark.parametrize("which", list(ALIGNMENTS))
def test_the_same_layout_at_another_pointer_alignment_is_planned_again(emulated_gpu, which):
    """16-byte aligned operands first (their plan loads and stores float4), then the same shapes
    and strides 4 bytes into the storage: the key holds each pointer's alignment, so that call
    gets a plan of single-float accesses (the emulated kernels check every vector's alignment)."""
    for offset in (0, 1, 0, 1):
        a, b, out = ALIGNMENTS[which](offset)
        c = fastmm.matmul(a, b, precision="ieee", out=out)
        _check(c, a, b)
    assert emulated_gpu.slow_calls == 2 and len(fast_path.ENTRIES) == 2
    at = {"a": 0, "b": 1, "out": 2}[which]
    vectors = {x.pointers[at] % 16 == 0: dict(x.cfg.macros) for x in emulated_gpu.launches}  # aligned -> macros
    mode = {"a": "A_MODE", "b": "B_MODE", "out": "C_VEC"}[which]
    assert vectors[True][mode] != vectors[False][mode]


def test_the_forced_family_and_precision_are_part_of_the_key(emulated_gpu, monkeypatch):
    gpu = emulated_gpu
    a, b = torch.randn(M_, K_), torch.randn(K_, N_)
    _check(fastmm.matmul(a, b, precision="ieee"), a, b)
    monkeypatch.setenv("FASTMM_KERNEL", "scalar")
    gpu.clear()
    _check(fastmm.matmul(a, b, precision="ieee"), a, b)
    assert gpu.families == ["scalar"]
    monkeypatch.delenv("FASTMM_KERNEL")
    gpu.clear()
    _check(fastmm.matmul(a, b, precision="tf32"), a, b, "tf32")
    assert gpu.families == ["wgmma_tf32"]  # (one 128 x 64 tile: faster than tf32_mma's, NOTES run 23)
    assert gpu.slow_calls == 3


def test_an_out_that_was_resized_leaves_no_entry(emulated_gpu):
    """The key holds out's shape before the call; an out that needed resizing must not leave an
    entry that writes M x N floats into the next out of that old shape."""
    a, b = torch.randn(M_, K_), torch.randn(K_, N_)
    for _ in range(2):
        small = torch.empty(0)
        assert fastmm.matmul(a, b, precision="ieee", out=small) is small
        assert small.shape == (M_, N_)
        _check(small, a, b)
    assert fast_path.ENTRIES == {} and emulated_gpu.slow_calls == 2


def test_forget_plans_drops_every_plan_and_entry(emulated_gpu):
    a, b = torch.randn(M_, K_), torch.randn(K_, N_)
    fastmm.matmul(a, b, precision="ieee")
    assert dispatch.PLANS.prepared and fast_path.ENTRIES
    fast_path.forget_plans()
    assert dispatch.PLANS.prepared == {} and fast_path.ENTRIES == {}
    _check(fastmm.matmul(a, b, precision="ieee"), a, b)
    assert emulated_gpu.slow_calls == 2


def test_the_entries_are_bounded(emulated_gpu, monkeypatch):
    """Past MAX_CACHED_SHAPES the entries (and the plans) are emptied and refilled: a workload of
    ever-new shapes does not grow them without end."""
    monkeypatch.setattr(dispatch, "MAX_CACHED_SHAPES", 3)
    b = torch.randn(K_, N_)
    for rows in range(40, 48):
        a = torch.randn(rows, K_)
        _check(fastmm.matmul(a, b, precision="ieee"), a, b)
        assert 1 <= len(fast_path.ENTRIES) <= 3 and 1 <= len(dispatch.PLANS.prepared) <= 3


# --- F.linear's own key (fast_path.linear_key: read from x, w and the bias, not from w.t()) ------

LM, LK, LN = 48, 72, 40  # x (LM, LK) @ w.t(), w (LN, LK): one launch of simt_cp_async (ieee), bias fused


def _linear_check(y, x, w, bias, precision="ieee") -> None:
    ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    assert not torch.isnan(y).any() and relative_error(y, ref) <= TOL[precision]


LINEAR_CHANGES = {
    # one thing the plan depends on changed at a time, shapes kept: (x, w, bias) makers
    "x-transposed": lambda: (torch.randn(LK, LM).t(), torch.randn(LN, LK), torch.randn(LN)),
    "x-row-pitch": lambda: (torch.randn(LM, LK + 8)[:, :LK], torch.randn(LN, LK), torch.randn(LN)),
    "x-alignment": lambda: (_at((LM, LK), 1), torch.randn(LN, LK), torch.randn(LN)),
    "w-stored-in-out": lambda: (torch.randn(LM, LK), torch.randn(LK, LN).t(), torch.randn(LN)),
    "w-row-pitch": lambda: (torch.randn(LM, LK), torch.randn(LN, LK + 4)[:, :LK], torch.randn(LN)),
    "w-alignment": lambda: (torch.randn(LM, LK), _at((LN, LK), 1), torch.randn(LN)),
    "bias-strided": lambda: (torch.randn(LM, LK), torch.randn(LN, LK), torch.randn(2 * LN)[::2]),
    "no-bias": lambda: (torch.randn(LM, LK), torch.randn(LN, LK), None),
}


@pytest.mark.parametrize("change", list(LINEAR_CHANGES))
def test_a_linear_layout_change_misses_the_linear_entry(emulated_gpu, change):
    """Contiguous x, w and bias first, then one of them laid out otherwise (or no bias): the
    linear key tells them apart, so each layout is planned once and then served by its own entry,
    computing right each time (an entry launched on the other layout reads the wrong floats, or
    misaligned vectors, which the emulated kernels catch)."""
    gpu = emulated_gpu

    def contiguous():
        return torch.randn(LM, LK), torch.randn(LN, LK), torch.randn(LN)

    keys = set()
    for make in (contiguous, LINEAR_CHANGES[change], contiguous, LINEAR_CHANGES[change]):
        x, w, bias = make()
        _linear_check(fastmm.linear(x, w, bias, precision="ieee"), x, w, bias)
        keys.add(fast_path.linear_key(x, w, bias, "ieee"))
    assert gpu.slow_calls == 2 and len(keys) == 2
    assert {type(fast_path.ENTRIES.get(k)) for k in keys} == {fast_path.FastEntry}


def test_a_linear_repeat_launches_on_ws_own_pointer(emulated_gpu):
    """The entry's launch takes w.t()'s pointer from w (the same): fresh x, w and bias each call,
    the first call's kernel and arguments, the new operands' pointers, and no other key made."""
    gpu = emulated_gpu
    x, w, bias = torch.randn(4, LM, LK), torch.randn(LN, LK), torch.randn(LN)
    _linear_check(fastmm.linear(x, w, bias, precision="ieee"), x, w, bias)
    first = list(gpu.launches)
    assert list(fast_path.ENTRIES) == [fast_path.linear_key(x, w, bias, "ieee")]
    for _ in range(3):
        x, w, bias = torch.randn(4, LM, LK), torch.randn(LN, LK), torch.randn(LN)
        gpu.clear()
        y = fastmm.linear(x, w, bias, precision="ieee")
        assert y.shape == (4, LM, LN)
        _linear_check(y, x, w, bias)
        _same_launches(first, gpu.launches)
        assert gpu.launches[0].pointers[:2] == (x.data_ptr(), w.data_ptr())
    assert gpu.slow_calls == 1 and len(fast_path.ENTRIES) == 1


def test_the_linear_key_holds_the_precision_and_the_switches(emulated_gpu, monkeypatch):
    gpu = emulated_gpu
    x, w, bias = torch.randn(LM, LK), torch.randn(LN, LK), torch.randn(LN)

    def run(precision="ieee"):
        gpu.clear()
        _linear_check(fastmm.linear(x, w, bias, precision=precision), x, w, bias, precision)
        return gpu.families

    first = run()
    assert run("tf32") != first and gpu.slow_calls == 2
    monkeypatch.setenv("FASTMM_KERNEL", "scalar")
    assert run() == ["scalar"] and gpu.slow_calls == 3
    monkeypatch.setenv("FASTMM_DISABLE", "1")
    assert run() == []  # torch computed it: the entries of the other keys were not used
    monkeypatch.delenv("FASTMM_KERNEL")
    assert run() == []
    monkeypatch.delenv("FASTMM_DISABLE")
    assert run() == first and gpu.slow_calls == 3  # the first entry again
    assert fast_path.linear_key(x, w, bias, "ieee")[0] == "linear"  # (never equal to a key_of key)


# ---------------------------------------------------------------------------------------------
# N-D operands whose rows merge only by a copy (torch.matmul's reshape)

def test_a_linear_on_rows_no_view_merges_runs_one_product_on_a_copy(emulated_gpu):
    """x of shape (L, B, K) as a seq-first view of a batch-first activation (nn.MultiheadAttention
    transposes so): its L * B rows merge only by a copy. One product over all rows reads W once,
    where a batch of L products of B rows re-read it L times (0.69x torch in tf32 on the H200's
    8192-token encoder step). The copy's own 2-D entry serves every later call; x is untouched."""
    gpu = emulated_gpu
    x_bf, w, bias = torch.randn(3, 40, LK), torch.randn(LN, LK), torch.randn(LN)
    x = x_bf.transpose(0, 1)  # (40, 3, LK), not foldable by a view
    x0 = x.clone()
    for call in range(3):
        gpu.clear()
        y = fastmm.linear(x, w, bias, precision="ieee")
        assert y.shape == (40, 3, LN) and y.is_contiguous()
        _linear_check(y, x, w, bias)
        (gemm,) = [launch for launch in gpu.launches if launch.family not in ("splitk_reduce",)]
        assert gemm.pointers[0] != x.data_ptr()  # the copy's rows, not x's
        assert torch.equal(x, x0)
    assert gpu.slow_calls == 1  # the first call planned the 2-D product; the others took its entry
    assert fast_path.ENTRIES[fast_path.linear_key(x, w, bias, "ieee")] is fast_path.FOLD_BY_COPY
    flat_key = fast_path.linear_key(x0.reshape(-1, LK), w, bias, "ieee")
    assert type(fast_path.ENTRIES.get(flat_key)) is fast_path.FastEntry


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_matmul_folds_rows_no_view_merges_by_a_copy_then_the_copys_entry_serves(emulated_gpu, precision):
    """fastmm.matmul(a, W) with a's batch dims transposed (a compiled backward hands a seq-first
    gradient over so): one 2-D product of all rows (as torch.matmul), launched on a fresh copy
    of a every call. The first call plans it, the second plans the copy's 2-D product once; from
    then on a call copies the rows and takes the copy's own entry (they planned again on every
    call before: ~100-250 us of host time each). With an out=, the full path every call, right
    into a NaN-filled out. a is never written."""
    gpu = emulated_gpu
    a = torch.randn(5, 24, 36).transpose(0, 1)  # (24, 5, 36)
    a0 = a.clone()
    w, v = torch.randn(36, 52), torch.randn(36)
    exp = fastmm.explain(a, w, precision=precision)
    assert (exp.shapes["M"], exp.shapes["batch"]) == (120, ())
    for call in range(4):
        gpu.clear()
        c = fastmm.matmul(a, w, precision=precision)
        assert c.shape == (24, 5, 52) and c.is_contiguous()
        _check(c.reshape(120, 52), a.reshape(120, 36), w, precision)
        assert gpu.launches and all(launch.pointers[0] != a.data_ptr() for launch in gpu.launches)
        assert gpu.slow_calls == min(call + 1, 2)  # (counted over the calls)
        assert torch.equal(a, a0)
    assert _entry(a, w, None, precision) is fast_path.FOLD_BY_COPY
    assert type(_entry(a0.reshape(120, 36), w, None, precision)) is fast_path.FastEntry
    for call in range(3):  # a matrix @ vector: (24, 5), the same route
        c = fastmm.matmul(a, v, precision=precision)
        assert c.shape == (24, 5) and gpu.slow_calls == 2 + min(call + 1, 2)
        torch.testing.assert_close(c, a @ v, rtol=1e-5 if precision == "ieee" else 3e-3,
                                   atol=1e-4 if precision == "ieee" else 3e-2)
    for call in range(2):
        gpu.clear()
        out = torch.full((24, 5, 52), NAN)
        assert fastmm.matmul(a, w, precision=precision, out=out) is out
        assert relative_error(out.reshape(120, 52), a.reshape(120, 36), w) <= (1e-6 if precision == "ieee" else 3e-3)
        assert gpu.slow_calls == 5 + call and all(launch.pointers[0] != a.data_ptr() for launch in gpu.launches)
    assert _entry(a, w, out, precision) is fast_path.NOT_FAST


def test_rows_no_view_merges_on_a_call_fastmm_does_not_serve_stay_torchs_own(emulated_gpu, monkeypatch):
    """The copy route is for calls fastmm served: a call that goes to torch (FASTMM_DISABLE, a
    mixed dtype, a 0-d operand) gets torch.matmul on the caller's own tensors, every time: its
    exact bits and its error words, never a copy's."""
    a = torch.randn(5, 33, 64).transpose(0, 1)  # (33, 5, 64): rows merge only by a copy
    v, w = torch.randn(64), torch.randn(64, 7)
    monkeypatch.setenv("FASTMM_DISABLE", "1")
    for _ in range(3):
        assert torch.equal(fastmm.matmul(a, v, precision="ieee"), torch.matmul(a, v))
        assert torch.equal(fastmm.matmul(a, w, precision="ieee"), torch.matmul(a, w))
    monkeypatch.delenv("FASTMM_DISABLE")
    for b in (w.double(), torch.tensor(2.0)):
        with pytest.raises(RuntimeError) as want:
            torch.matmul(a, b)
        for _ in range(2):
            with pytest.raises(RuntimeError) as got:
                fastmm.matmul(a, b, precision="ieee")
            assert str(got.value) == str(want.value)


@pytest.mark.parametrize("bias_shape", [(4, 36), (16, 1, 36), (4, 1), (36,), ()])
def test_a_linear_on_uncopyable_rows_keeps_f_linears_bias_broadcasting(emulated_gpu, bias_shape):
    """A bias that broadcasts over x's leading dims too (F.linear allows it), and a 1-D weight:
    the rows are still folded by a copy where the product allows it, and the result is F.linear's."""
    x = torch.randn(4, 16, 40).transpose(0, 1)  # (16, 4, 40): rows merge only by a copy
    w, bias = torch.randn(36, 40), torch.randn(bias_shape)
    torch.testing.assert_close(fastmm.linear(x, w, bias, precision="ieee"), torch.nn.functional.linear(x, w, bias),
                               rtol=1e-5, atol=1e-5)
    w1 = torch.randn(40)
    torch.testing.assert_close(fastmm.linear(x, w1, precision="ieee"), torch.nn.functional.linear(x, w1),
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# a Linear layer's backward: both products from one remembered entry

def _linear_step(x_shape, frozen):
    """A fresh fastmm.nn.Linear (LK -> LN) and x of ``x_shape``, forward then backward of a fresh
    g; returns (x, w, g, grads, the backward's launches). ``frozen``: "weight" (no grad_W, no
    bias grad) or "input" (no grad_x)."""
    gpu = fast_path_gpu[0]
    lin = fastmm.nn.Linear(LK, LN, precision="ieee")
    if frozen == "weight":
        lin.requires_grad_(False)
    x = torch.randn(x_shape, requires_grad=frozen != "input")
    y = lin(x)
    g = torch.randn(y.shape)
    gpu.clear()
    y.backward(g)
    grads = (x.grad, lin.weight.grad, lin.bias.grad)
    return x.detach(), lin.weight.detach(), g, grads, list(gpu.launches)


fast_path_gpu = []  # (the emulated GPU of the test running: _linear_step's)


@pytest.mark.parametrize("frozen", ["none", "weight", "input"])
@pytest.mark.parametrize("x_shape", [(LM, LK), (3, LM, LK)], ids=["2d", "3d"])
def test_a_linear_backward_repeat_launches_both_products_from_one_entry(emulated_gpu, frozen, x_shape):
    """Forward and backward of a fresh Linear of one layout, three times: from the second on,
    the backward takes both products from one LinearGradsEntry (one key, no views made, no
    full-path call), queuing the first backward's launches (the same kernels and arguments) on
    the new g, w and x, in place: grad_x on (g, w), grad_W on (g, x). The gradients are the
    formula's (fastmm.ops.linear_grads, product by product) bit for bit, and float64's."""
    fast_path_gpu[:] = [emulated_gpu]
    x, w, g, grads, first = _linear_step(x_shape, frozen)
    slow = emulated_gpu.slow_calls
    for _ in range(2):
        x, w, g, grads, launches = _linear_step(x_shape, frozen)
        assert emulated_gpu.slow_calls == slow
        _same_launches(first, launches)
        want = ([(g.data_ptr(), w.data_ptr())] if frozen != "input" else []) + \
               ([(g.data_ptr(), x.data_ptr())] if frozen != "weight" else [])
        assert [launch.pointers[:2] for launch in launches] == want
        key = fast_path.linear_grads_key(g, x, w, "ieee", frozen != "input", frozen != "weight",
                                         g.data_ptr(), x.data_ptr(), w.data_ptr())
        assert type(fast_path.ENTRIES.get(key)) is fast_path.LinearGradsEntry
        with torch.no_grad():
            formula = fastmm.ops.linear_grads(fastmm.ops._EAGER_MM["ieee"], x, w, g, frozen != "input",
                                              frozen != "weight") + (g.reshape(-1, LN).sum(0) if frozen != "weight" else None,)
        for got, ref in zip(grads, formula):
            assert (got is None) == (ref is None)
            if got is not None:
                assert torch.equal(got, ref)
        x64, w64, g64 = x.double(), w.double(), g.double()
        if frozen != "input":
            assert relative_error(grads[0], g64 @ w64) <= TOL["ieee"]
        if frozen != "weight":
            assert relative_error(grads[1], g64.reshape(-1, LN).t() @ x64.reshape(-1, LK)) <= TOL["ieee"]


def test_the_combined_linear_grads_entry_is_only_for_products_read_in_place(emulated_gpu):
    """After the formula's first backward of a layout, linear_backward keeps the two products'
    entries under one key only where both are one-launch entries reading g and x themselves: x's
    or g's rows that merge only by a copy (a seq-first view: grad_W's product reads the copy) or a
    product entry that is NOT_FAST make the key never fast; a product entry that is missing (the
    entries' bound or a tuned bucket dropped it between the two products) leaves the key unknown,
    to be decided by the next backward. (The emulation tracks no memory torch's own copies make,
    so a backward of such rows runs in tests/test_gpu_model_path.py.)"""
    w = torch.randn(LN, LK)
    entry = fast_path.FastEntry((1,), object(), (), torch.device("cpu"), 0, None, None)
    calls = []

    def formula():
        calls.append(1)
        return "grad_x", "grad_w"

    def backward(g, x, need_x=True, need_w=True):
        got = fast_path.linear_backward(g, x, w, "ieee", need_x, need_w, formula)
        key = fast_path.linear_grads_key(g, x, w, "ieee", need_x, need_w, g.data_ptr(), x.data_ptr(), w.data_ptr())
        return got, fast_path.ENTRIES.get(key)

    def with_products(g, x, grad_x=entry, grad_w=entry):
        fast_path.ENTRIES.clear()
        for k, e in ((fast_path.key_of(g, w, None, "ieee"), grad_x),
                     (fast_path.key_of(g.reshape(-1, LN).t(), x.reshape(-1, LK), None, "ieee"), grad_w)):
            if e is not None:
                fast_path.ENTRIES[k] = e

    x, g = torch.randn(3, 8, LK), torch.randn(3, 8, LN)
    with_products(g, x)
    assert backward(g, x) == (("grad_x", "grad_w"), fast_path.LinearGradsEntry(entry, entry)) and len(calls) == 1
    assert backward(g, x, need_w=False)[1] == fast_path.LinearGradsEntry(entry, None)
    assert backward(g, x, need_x=False)[1] == fast_path.LinearGradsEntry(None, entry)
    with_products(g, x, grad_w=fast_path.NOT_FAST)
    assert backward(g, x)[1] is fast_path.NOT_FAST
    with_products(g, x, grad_x=None)  # dropped between the products: decided next time
    assert backward(g, x)[1] is None
    with_products(g, x)
    assert backward(g, x)[1] == fast_path.LinearGradsEntry(entry, entry)
    x_seq = torch.randn(8, 3, LK).transpose(0, 1)  # (3, 8, LK), rows merge only by a copy
    with_products(g, x_seq)
    assert backward(g, x_seq)[1] is fast_path.NOT_FAST
    g_seq = torch.randn(8, 3, LN).transpose(0, 1)  # the input frozen: grad_W alone, g read by a copy
    with_products(g_seq, x)
    assert backward(g_seq, x, need_x=False)[1] is fast_path.NOT_FAST


def test_a_double_backward_after_a_remembered_one_records_its_products(emulated_gpu):
    """A backward with create_graph after the layout's entry exists: the formula runs, its
    products recording autograd (the remembered entry's launches record nothing), so second
    derivatives come out: d/dW of sum(v * grad_x) with grad_x = g @ W is g^T v."""
    lin = fastmm.nn.Linear(LK, LN, bias=False, precision="ieee")
    x = torch.randn(3, LM, LK, requires_grad=True)
    g = torch.randn(3, LM, LN)
    lin(x).backward(g)  # the first backward of the layout: the formula, then the entry
    lin(x).backward(g)  # served by the entry
    (grad_x,) = torch.autograd.grad(lin(x), x, g, create_graph=True)
    assert grad_x.requires_grad
    v = torch.randn(grad_x.shape)
    (second,) = torch.autograd.grad(grad_x, lin.weight, v)  # (v as given: memory the emulation reads)
    want = g.double().reshape(-1, LN).t() @ v.double().reshape(-1, LK)
    assert relative_error(second, want) <= TOL["ieee"]
