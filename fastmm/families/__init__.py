"""Kernel families: for each, its source under ``cuda_src/``, what it can serve, and how to
launch it. One module per family, named as its source (``skinny.py`` <-> ``skinny.cu``); what
they share is in :mod:`.base`, the split-K / stream-K wave models and their second passes in
:mod:`.work_split`.

Pure Python (no torch, no CUDA): a family looks at a :class:`~fastmm.problem.Problem` and the
:class:`~fastmm.problem.DeviceFacts` and either rejects it with a reason a user can read, or
returns a :class:`KernelConfig` - the compile-time macros and the launch geometry. The choice
between families lives in :mod:`fastmm.plan`; launching in :mod:`fastmm.runtime`.

Adding a family: write ``cuda_src/<name>.cu`` (its entry takes FASTMM_PARAMS, common.cuh), write
``families/<name>.py`` (a frozen :class:`~.base.Family` subclass answering the base questions),
and add one line to :data:`FAMILIES` below (and its name to ``plan.PREFERENCE`` for the
precisions it serves).
"""
from __future__ import annotations

from .base import (DEFAULT_SMEM, LOAD_ELEM_FAST, LOAD_ELEM_K, LOAD_NAMES, LOAD_VEC_FAST, LOAD_VEC_K, MAX_GRID_Z,
                   SPLIT_FLAGS, Family, KernelConfig, StreamK, vec_ok)
from .kmajor_mma import KmajorMma
from .scalar import Scalar
from .simt_core import SimtCore
from .simt_cp_async import SimtCpAsync
from .simt_float4 import SimtFloat4
from .skinny import Skinny
from .skinny_kmajor import SkinnyKmajor
from .stage_kmajor import kmajor_batch, kmajor_source, row_copy_source, stage_kmajor_config, stage_rows_config
from .tf32_mma import Tf32Mma
from .wgmma_tf32 import MapSpec, WgmmaTf32
from .work_split import (MAX_SPLIT, second_pass_config, split_cap, split_k_for, splitk_reduce_config,
                         stream_k_fixup_config, stream_k_head_config)

#: The registry: every family by name, each a frozen instance with its measured defaults.
FAMILIES: dict[str, Family] = {f.name: f for f in (
    KmajorMma(),
    SkinnyKmajor(),
    Skinny(),
    WgmmaTf32(),
    Tf32Mma(),
    SimtCpAsync(),
    SimtFloat4(),
    Scalar(),
)}

__all__ = ["FAMILIES", "Family", "KernelConfig", "StreamK", "MapSpec", "KmajorMma", "Scalar", "SimtCore", "SimtCpAsync",
           "SimtFloat4", "Skinny", "SkinnyKmajor", "Tf32Mma", "WgmmaTf32", "DEFAULT_SMEM", "MAX_GRID_Z", "MAX_SPLIT", "SPLIT_FLAGS",
           "LOAD_VEC_FAST", "LOAD_VEC_K", "LOAD_ELEM_K", "LOAD_ELEM_FAST", "LOAD_NAMES", "vec_ok",
           "kmajor_batch", "kmajor_source", "row_copy_source", "stage_kmajor_config", "stage_rows_config",
           "second_pass_config", "split_cap",
           "split_k_for", "splitk_reduce_config", "stream_k_fixup_config", "stream_k_head_config"]
