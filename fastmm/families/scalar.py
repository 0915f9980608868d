"""The scalar family (cuda_src/scalar.cu): one output per thread, 16x16 shared tiles, any
strides and offsets. The last resort, and the kernel for tiny products."""
from __future__ import annotations

from dataclasses import dataclass

from .base import Family, KernelConfig, grid_of, tiles_of


@dataclass(frozen=True)
class Scalar(Family):
    name, source, entry = "scalar", "scalar.cu", "fastmm_scalar"
    precisions = ("ieee", "tf32", "tf32x3")  # fp32 FMA is at least as accurate as any of them

    def configure(self, p, dev, option=None):
        tiles = tiles_of(p, 16, 16)
        return KernelConfig(self.name, self.source, self.entry, (), 256, (16, 16, 1),
                            grid_of(min(tiles, 2**31 - 1), p.batch_total), 0, (16, 16, 16),
                            (("loads", "single floats, any stride"), ("math", "fp32 FMA")))
