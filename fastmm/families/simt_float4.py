"""The float4 SIMT family (cuda_src/simt_float4.cu): register-staged shared-memory tiles, float4
global loads where the layout allows; any arch (the ieee path below sm_80)."""
from __future__ import annotations

from dataclasses import dataclass

from .simt_core import SimtCore


@dataclass(frozen=True)
class SimtFloat4(SimtCore):
    name, source, entry = "simt_float4", "simt_float4.cu", "fastmm_simt_float4"
