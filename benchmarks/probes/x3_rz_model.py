#!/usr/bin/env python3
"""A CPU model of tf32x3 on wgmma with a tensor core that truncates (rounds toward zero) as it
accumulates: what the promotion interval does to the error of C and of C's column sums.

    python benchmarks/probes/x3_rz_model.py [--rows 2048] [--k 1024] [--cols 64]

No GPU. Each operand is split into TF32 halves rounded to nearest (as stage_kmajor and the
kernel's split do); each wgmma k8 instruction adds its 8 products (exact) to its fp32
accumulator and rounds the sum once, toward zero (the model; the tensor core's own alignment
and normalization are finer than this); the big products leave the tensor core every
``group`` k (PROMOTE_EVERY k-steps of 32) into an fp32 sum with Dekker's compensated add; the
small cross terms stay in their own accumulator. Against: the same with rounding to nearest,
and a sequential fp32 sum (round to nearest after each fma). A one-signed A (a ReLU output) makes
C's columns have a nonzero mean, so an error that leans toward zero adds up over the rows of a
column sum, where rounding to nearest averages out.

The model's numbers are a prediction to check on the GPU (`x3_bias_probe.py`), not a
measurement; it reproduced the H200's elementwise errors (1.3e-7 promoting every k-step,
2.0e-7 every 2; wgmma_tf32.X3_SHORT_K).
"""
from __future__ import annotations

import argparse

import numpy as np


def tf32(x: np.ndarray) -> np.ndarray:
    """fp32 to TF32 (10 mantissa bits), to nearest (ties away, as cvt.rna)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def toward_zero(x: np.ndarray) -> np.ndarray:
    """float64 to float32, toward zero."""
    y = x.astype(np.float32)
    over = np.abs(y.astype(np.float64)) > np.abs(x)
    y[over] = np.nextafter(y[over], np.float32(0))
    return y


def nearest(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def tf32x3(a: np.ndarray, w: np.ndarray, group: int, rnd) -> np.ndarray:
    ab, wb = tf32(a), tf32(w)
    asm, wsm = tf32(a - ab), tf32(w - wb)
    f = np.float64
    acc = np.zeros((a.shape[0], w.shape[1]), np.float32)
    err, small = np.zeros_like(acc), np.zeros_like(acc)
    for g in range(0, a.shape[1], group):
        step = np.zeros_like(acc)
        for i in range(g, min(g + group, a.shape[1]), 8):
            step = rnd(step.astype(f) + ab[:, i:i + 8].astype(f) @ wb[i:i + 8].astype(f))
            small = rnd(small.astype(f) + asm[:, i:i + 8].astype(f) @ wb[i:i + 8].astype(f)
                        + ab[:, i:i + 8].astype(f) @ wsm[i:i + 8].astype(f))
        s = acc + step
        err = err + (step - (s - acc))  # (fast two-sum: the add's rounding error joins small)
        acc = s
    return acc + (small + err)


def fp32_sequential(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    c = np.zeros((a.shape[0], w.shape[1]), np.float32)
    for i in range(a.shape[1]):
        c = (c.astype(np.float64) + a[:, i:i + 1].astype(np.float64) * w[i].astype(np.float64)).astype(np.float32)
    return c


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=64)
    o = ap.parse_args()
    rng = np.random.default_rng(0)
    print("A | form | rel err of C | rel err of C's column sums")
    for dist in ("normal", "relu"):
        a = rng.standard_normal((o.rows, o.k))
        a = (np.maximum(a, 0) if dist == "relu" else a).astype(np.float32)
        w = (rng.standard_normal((o.k, o.cols)) / np.sqrt(o.k)).astype(np.float32)
        ref = a.astype(np.float64) @ w.astype(np.float64)
        forms = {"fp32 sequential": lambda: fp32_sequential(a, w)}
        for group in (64, 32):
            forms[f"tf32x3 toward zero, every {group // 32}"] = lambda g=group: tf32x3(a, w, g, toward_zero)
        forms["tf32x3 to nearest, every 2"] = lambda: tf32x3(a, w, 64, nearest)
        for label, fn in forms.items():
            c = fn().astype(np.float64)
            cols = c.sum(0) - ref.sum(0)
            print(f"{dist} | {label} | {np.linalg.norm(c - ref) / np.linalg.norm(ref):.2e} | "
                  f"{np.linalg.norm(cols) / np.linalg.norm(ref.sum(0)):.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
