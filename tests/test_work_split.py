"""fastmm.families.work_split: the wave models of split-K and stream-K and the second passes
that complete their plans, checked against hand-computed cases and the facts measured on the
H200 (benchmarks/NOTES.md, DESIGN.md), not against a copy of the formulas."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastmm.families import SimtCpAsync
from fastmm.families.base import KernelConfig, StreamK
from fastmm.families.work_split import (MAX_SPLIT, MIN_KTILES_PER_SPLIT, effective_split, second_pass_config, split_cap,
                                        split_k_for, split_time, splitk_reduce_config, stream_k_fixup_config,
                                        stream_k_for)
from fastmm.problem import DeviceFacts, Problem

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
DEV = {arch: DeviceFacts.simulated_device(arch) for arch in ARCHS}
H200 = DEV["sm_90"]  # 132 SMs


# --- split_time: the wave model, in units of one whole tile's time ---------------------------------

def test_split_time_counts_waves_of_blocks_and_two_percent_per_extra_split():
    assert split_time(1, 1, 132) == 1.0  # one tile, one wave
    assert split_time(132, 1, 132) == 1.0  # a full wave
    assert split_time(133, 1, 132) == 2.0  # one more tile: a second wave
    assert split_time(133, 2, 132) == pytest.approx(3 / 2 * 1.02)  # 266 half tiles: 3 waves of half the time
    assert split_time(1, 4, 132) == pytest.approx(1 / 4 * 1.06)  # quarters, all in one wave


def test_largek_splits_66_ways_because_64_left_4_sms_idle():
    """largeK on the H200 (256 x 256 x 65536): 2 tiles of 128 x 256. 66 splits fill all 132 SMs,
    64 (the old cap) left 4 idle (NOTES run 12): the model ranks them so, and the cap allows it."""
    assert split_time(2, 66, 132) == pytest.approx(2.30 / 66)
    assert split_time(2, 66, 132) < split_time(2, 64, 132) < split_time(2, 67, 132)
    assert split_cap(2, 132) == 66 > MAX_SPLIT
    assert split_k_for(Problem.dense(256, 256, 65536), H200, 2, 8) == 66


def test_split_cap_is_max_split_or_the_splits_one_wave_holds():
    assert split_cap(2, 132) == 66 and split_cap(4, 264) == 66  # one wave's worth
    assert split_cap(64, 132) == MAX_SPLIT and split_cap(1000, 132) == MAX_SPLIT  # MAX_SPLIT below that
    assert split_cap(0, 132) == 132  # (no tiles: as for one)


# --- effective_split: block rows that get k-tiles, as split_range() deals them -------------------

@pytest.mark.parametrize("units,asked,rows", [
    (10, 4, 4),  # 3 k-tiles a row: 3, 3, 3, 1
    (10, 6, 5),  # 2 a row: the sixth row would get none
    (100, 64, 50),  # 2 a row: 50 rows
    (8192, 66, 66),  # largeK: 125 a row, the last row 67
    (5, 1, 1), (5, 0, 1), (0, 8, 1),  # nothing to split
])
def test_effective_split_counts_only_rows_that_get_work(units, asked, rows):
    assert effective_split(units, asked) == rows


# --- split_k_for: facts the model must reproduce ------------------------------------------------------

def test_a_single_tile_with_long_k_splits_into_exactly_one_wave():
    """One tile: each extra split shortens the wave more than its 2% costs, up to a full wave of
    blocks; past it a second wave starts. With two blocks per SM the wave is twice as wide (264
    asked; 32768 k-tiles dealt 125 a row reach 263 rows)."""
    p = Problem.dense(128, 128, 1 << 20)
    assert split_k_for(p, H200, 1, 32) == 132
    assert split_k_for(p, H200, 1, 32, blocks_per_sm=2) == 263 == effective_split(32768, 264)


def test_every_split_keeps_at_least_16_k_tiles():
    assert split_k_for(Problem.dense(128, 128, 8 * 16 * 10), H200, 1, 8) == 10
    assert split_k_for(Problem.dense(128, 128, 8 * 31), H200, 1, 8) == 1  # not two slices of 16


@pytest.mark.parametrize("tiles", [132, 264, 396, 2 * 132 + 1, 10_000])
def test_whole_waves_and_two_or_more_waves_never_split(tiles):
    assert split_k_for(Problem.dense(4096, 4096, 1 << 20), H200, tiles, 8) == 1


def test_a_wave_and_a_half_splits_to_fill_the_last_wave():
    """198 tiles on 132 SMs: 2 waves unsplit, 3 waves of half tiles split in two (1.53 of the
    unsplit time units): splitting pays."""
    assert split_time(198, 2, 132) < split_time(198, 1, 132)
    assert split_k_for(Problem.dense(4096, 4096, 65536), H200, 198, 8) > 1


def test_a_batch_never_splits():
    """The workspace holds the slices of one product."""
    for batch in (2, 7, 70_000):
        assert split_k_for(Problem.dense(64, 64, 1 << 20, batch=batch), H200, 1, 8) == 1


@settings(max_examples=300, deadline=None)
@given(K=st.integers(1, 1 << 22), batch=st.sampled_from([1, 1, 2, 7, 70_000]), arch=st.sampled_from(ARCHS),
       tiles=st.integers(1, 20_000), bk=st.sampled_from([8, 32]), blocks_per_sm=st.sampled_from([1, 2]))
def test_split_k_for_stays_within_its_limits_and_never_models_slower_than_no_split(K, batch, arch, tiles, bk,
                                                                                  blocks_per_sm):
    dev = DEV[arch]
    split = split_k_for(Problem.dense(64, 64, K, batch=batch), dev, tiles, bk, blocks_per_sm)
    k_tiles = -(-K // bk)
    slots = dev.sm_count * blocks_per_sm
    assert 1 <= split <= max(MAX_SPLIT, slots // tiles)  # MAX_SPLIT, or one wave's worth
    if split > 1:
        assert batch == 1 and tiles < 2 * slots and tiles % slots != 0
        assert k_tiles // split >= MIN_KTILES_PER_SPLIT
        per = -(-k_tiles // split)
        assert (split - 1) * per < k_tiles  # the last block row has work
        assert split_time(tiles, split, slots) < split_time(tiles, 1, slots)


# --- stream_k_for ------------------------------------------------------------------------------------

def test_stream_k_deals_the_last_partial_wave_of_8192x4096x6144_over_one_more_wave():
    """1024 tiles of 128 x 256 on 132 SMs: 7 whole waves (924 tiles), then the other 100 tiles'
    768 k-tiles each (76800) dealt 582 a block over 132 blocks (hand-computed)."""
    sk = stream_k_for(Problem.dense(8192, 4096, 6144), H200, 1024, 8, 128, 256)
    assert (sk.whole_tiles, sk.blocks, sk.iters, sk.k_tiles, sk.tiles) == (924, 132, 582, 768, 1024)
    assert sk.pieced_tiles == 100 and sk.segments == 2  # a stretch of 582 < 768 k-tiles spans two tiles at most
    assert sk.workspace_floats(128, 256) == 132 * 2 * 128 * 256


@pytest.mark.parametrize("M,N,K,tiles,why", [
    (8448, 4096, 6144, 1056, "whole waves: 1056 tiles = 8 x 132"),
    (4096, 4096, 1024, 512, "short K: 3 waves + 116 tiles of 128 k-tiles: pieces and traffic cost 513.8 > 0.985 x 512"),
    (2048, 2048, 2048, 128, "under one wave: split-K's ground"),
])
def test_stream_k_is_not_taken_where_it_cannot_pay(M, N, K, tiles, why):
    assert stream_k_for(Problem.dense(M, N, K), H200, tiles, 8, 128, 256) is None, why


def test_a_stream_k_kernel_slower_per_k_tile_is_taken_only_where_the_last_wave_costs_more():
    """iter_penalty 0.045 (grad_W's A in single floats, NOTES run 35). 14336 x 4096 x 2048: 1792
    tiles = 13 waves + 76 tiles of 256 k-tiles: stream-K (13 x 256 + 148) x 1.045 + 3 x 2 pieces'
    fill + 2 x 208 pieces x 128 KiB / 6 MB (9.1) = 3647.5 > 14 x 256 = 3584. 32000 x 1024 x 8192:
    7 waves + 76 tiles of 1024: (7168 + 590) x 1.045 + 6 + 9.1 = 8122 < 8 x 1024 = 8192 (and with
    the penalty modelled no 1.5% margin is asked: 8122 > 0.985 x 8192). Without the penalty both
    take stream-K (hand-computed). (One launch only here: the head form is the next test's.)"""
    up, head = Problem.dense(14336, 4096, 2048, a_t=True), Problem.dense(32000, 1024, 8192, a_t=True)
    assert stream_k_for(up, H200, 1792, 8, 128, 256, head=False) is not None
    assert stream_k_for(up, H200, 1792, 8, 128, 256, iter_penalty=0.045, head=False) is None
    sk = stream_k_for(head, H200, 1000, 8, 128, 256, iter_penalty=0.045, head=False)
    assert (sk.whole_tiles, sk.blocks, sk.iters) == (924, 132, 590)
    assert stream_k_for(head, H200, 1000, 8, 128, 256, iter_penalty=0.06, head=False) is None  # (7758 x 1.06 > 8192)


def test_a_slower_stream_k_kernel_takes_its_whole_waves_in_a_plain_launch_first():
    """The head form (NOTES run 36): the whole waves, rounded down to whole rows of tiles, in the
    plain kernel's own launch, the penalty only on the stretches, plus a seam of 0.05 of a tile.
    32000 x 1024 x 8192 (4 tiles a row): 924 tiles = 231 rows, then 76 tiles' 1024 k-tiles over
    132 blocks of 590: 7 x 1024 + 590 x 1.045 + 51.2 + 15.1 = 7850.8 against one launch's 8122.2.
    14336 x 4096 x 2048 (16 a row): 1716 whole tiles -> 107 rows = 1712 tiles (13 waves), 80 tiles
    of 256 k-tiles over 132 blocks of 156: 3328 + 163.0 + 12.8 + 6 + 9.3 = 3519.1 < 14 x 256, where
    one launch (3647.5) lost to the plain kernel (hand-computed)."""
    head = stream_k_for(Problem.dense(32000, 1024, 8192, a_t=True), H200, 1000, 8, 128, 256, iter_penalty=0.045)
    assert head == StreamK(0, 132, 590, 1024, 76, 231 * 128, 924)
    assert head.pieced_tiles == 76 and head.workspace_floats(128, 256) == 132 * 2 * 128 * 256
    up = stream_k_for(Problem.dense(14336, 4096, 2048, a_t=True), H200, 1792, 8, 128, 256, iter_penalty=0.045)
    assert up == StreamK(0, 132, 156, 256, 80, 107 * 128, 1712)
    # not asked for: one launch where it pays, else none
    one = stream_k_for(Problem.dense(32000, 1024, 8192, a_t=True), H200, 1000, 8, 128, 256, iter_penalty=0.045,
                       head=False)
    assert (one.whole_tiles, one.head_rows) == (924, 0)
    assert stream_k_for(Problem.dense(14336, 4096, 2048, a_t=True), H200, 1792, 8, 128, 256, iter_penalty=0.045,
                        head=False) is None


def test_without_a_penalty_stream_k_keeps_one_launch():
    # the seam makes the head form dearer than one launch whenever both kernels run a k-tile alike
    for M, N, K in ((8192, 4096, 6144), (32000, 1024, 8192), (14336, 4096, 2048), (8192, 2816, 1024)):
        tiles = -(-M // 128) * -(-N // 256)
        sk = stream_k_for(Problem.dense(M, N, K), H200, tiles, 8, 128, 256)
        assert sk is not None and sk.head_rows == 0 and sk.whole_tiles == tiles // 132 * 132, (M, N, K)


def test_the_head_form_leaves_fewer_tiles_than_blocks_to_the_stream_k_launch():
    """15723 x 39095 x 71341 on 34 SMs: 123 x 153 tiles, 553 waves of 34 (18802 tiles) round down
    to 122 rows (18666), which would leave 153 tiles to 34 blocks (stretches of more than a tile,
    over three tiles): not the head form (without that bound the model would take it here)."""
    p = Problem.dense(15723, 39095, 71341, a_t=True)
    sk = stream_k_for(p, dataclasses.replace(H200, sm_count=34), 123 * 153, 8, 128, 256, iter_penalty=0.045)
    assert sk is None or sk.head_rows == 0


def test_stream_k_needs_a_batch_of_1_and_k_tile_counts_within_32_bits():
    assert stream_k_for(Problem.dense(8192, 4096, 6144, batch=2), H200, 1024, 8, 128, 256) is None
    # a long K over broadcast (stride-0) operands: the last block's stretch would end past 2^31
    # k-tiles (the kernel counts in 32 bits)
    p = Problem(17152, 256, 128207976, (0, 1), (1, 0), (256, 1))
    assert stream_k_for(p, H200, 134, 8, 128, 256, head=False) is None
    assert 134 * -(-p.K // 8) < 2**31  # (tiles x k-tiles alone would have passed)
    # the head form's stream-K launch counts only its own 2 tiles' k-tiles (the plain launch
    # walks K per tile), so it stays in range and is taken (2 waves of tiles: 1.05 against 2)
    sk = stream_k_for(p, H200, 134, 8, 128, 256)
    assert (sk.head_tiles, sk.tiles) == (132, 2) and sk.blocks * sk.iters < 2**31


# --- the second passes ---------------------------------------------------------------------------------

def _cfg(**kw) -> KernelConfig:
    base = dict(family="simt_cp_async", source="simt_cp_async.cu", entry="e", macros=(), block=256,
                block_dims=(256, 1, 1), grid=(4, 1, 1), smem=0, tile=(128, 256, 8))
    return KernelConfig(**{**base, **kw})


def test_second_pass_config_completes_a_split_or_a_stream_k_plan_and_nothing_else():
    p = Problem.dense(1000, 1000, 65536)
    assert second_pass_config(p, H200, _cfg()) is None  # one slice: nothing to sum
    reduce = second_pass_config(p, H200, _cfg(grid=(4, 6, 1)))
    assert reduce.family == "splitk_reduce" and "sums the 6 partial slices" in dict(reduce.details)["order"]
    paired = second_pass_config(p, H200, _cfg(grid=(4, 6, 1), split_pair=True))
    assert "sums the 3 partial slices" in dict(paired.details)["order"]  # pairs add first: half the slices
    assert second_pass_config(p, H200, _cfg(grid=(4, 6, 1), split_fused=True)) is None  # the kernel sums
    sk = stream_k_for(Problem.dense(8192, 4096, 6144), H200, 1024, 8, 128, 256)
    fixup = second_pass_config(p, H200, _cfg(stream_k=sk))
    assert fixup.family == "stream_k_fixup" and fixup.grid == (32, 100, 1)  # 128 x 256 / 1024 per block, a row per tile


def test_splitk_reduce_uses_a_thread_per_output_up_to_four_blocks_per_sm():
    assert splitk_reduce_config(Problem.dense(100, 100, 1), H200, 2).grid == (40, 1, 1)  # 10000 / 256, rounded up
    assert splitk_reduce_config(Problem.dense(8192, 8192, 1), H200, 2).grid == (4 * 132, 1, 1)
    assert splitk_reduce_config(Problem.dense(0, 0, 1), H200, 2).grid == (1, 1, 1)


def test_stream_k_fixup_is_built_for_the_big_simt_tile():
    fam = SimtCpAsync()
    cfg = fam.configure(Problem.dense(8192, 4096, 6144), H200)
    assert cfg.stream_k is not None and cfg.tile[:2] == (128, 256)
    fix = stream_k_fixup_config(cfg)
    assert fix.tile[:2] == cfg.tile[:2] and fix.block_dims == (256, 1, 1) and fix.grid[1] == cfg.stream_k.pieced_tiles
