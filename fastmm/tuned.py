"""What tuning leaves for the planner: the shape bucket a problem falls in, and the measured choice
stored for a bucket.

Pure Python like :mod:`fastmm.plan`: fastmm.dispatch finds a stored record for a problem's bucket
(:mod:`fastmm.runtime.tuning_store`), turns it into a :class:`TunedChoice`, and hands it to
:func:`fastmm.plan.select`, which uses it where it still applies.
"""
from __future__ import annotations

from dataclasses import dataclass

from .families import vec_ok
from .problem import Problem

_LAYOUT_LETTER = {"row-major": "r", "column-major": "c", "strided": "s"}


def size_bucket(n: int) -> int:
    """The power of two at or above ``n`` (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def _vector_readable(p: Problem, which: str) -> bool:
    """Can the operand be read (or C written) with 16-byte vectors along its contiguous dim?"""
    rows, cols = {"a": (p.M, p.K), "b": (p.K, p.N), "c": (p.M, p.N)}[which]
    (s_row, s_col), batch, align = {
        "a": (p.a_strides, p.a_batch_strides, p.a_align), "b": (p.b_strides, p.b_batch_strides, p.b_align),
        "c": (p.c_strides, p.c_batch_strides, p.c_align)}[which]
    if s_col == 1:
        return vec_ok(cols, s_row, batch, align)
    if s_row == 1:
        return vec_ok(rows, s_col, batch, align)
    return False


def bucket_of(p: Problem) -> str:
    """The key tuned choices are stored under, e.g. ``tf32|a=r,b=c,c=r|vec=vvv|single|M4096|N4096|K8192``.

    Why these parts: the kernel that wins depends on
    - the precision (which families compute it at all);
    - each operand's layout and whether it can be moved with 16-byte vectors (pointer alignment,
      extents and strides multiples of 4 floats): these pick the load path inside a family and
      whether an operand is staged, which changes relative speed the most after the size;
    - batch > 1 or not: split-K is only possible for a single product (the batch size itself is
      left out so a workload with varying batch sizes does not tune each one);
    - M, N and K, each rounded up to a power of two: the tile choice follows the number of tiles
      per SM and the K depth, which change smoothly with the size, so one measurement serves
      every size within a factor of two. The boundaries also fall where the kernels switch: the
      skinny family's M <= 32 and its 8/16/32-row variants are powers of two.
    """
    layouts = ",".join(f"{w}={_LAYOUT_LETTER[p.layout_of(w)]}" for w in "abc")
    vectors = "".join("v" if _vector_readable(p, w) else "s" for w in "abc")
    batch = "batched" if p.batch_total > 1 else "single"
    return (f"{p.precision}|{layouts}|vec={vectors}|{batch}|"
            f"M{size_bucket(p.M)}|N{size_bucket(p.N)}|K{size_bucket(p.K)}")


@dataclass(frozen=True)
class TunedChoice:
    """A family and one of its options (see ``Family.options``), and where the choice came from
    (for explain), e.g. "1.21 ms vs 1.43 ms for the heuristic choice; tuned 2026-12-01 on 4096x4096x4096"."""

    family: str
    option: tuple[int, ...]
    provenance: str = ""

    def label(self) -> str:
        return f"{self.family} {self.option}"

    @classmethod
    def from_record(cls, record: dict) -> "TunedChoice | None":
        """The choice a stored record names, or None if the record is not well formed."""
        try:
            family, option = record["family"], tuple(record["option"])
            if not isinstance(family, str) or not all(type(x) is int for x in option):
                return None
            parts = []
            if isinstance(record.get("time_ms"), (int, float)):
                text = f"{record['time_ms']:.4g} ms"
                if isinstance(record.get("heuristic_ms"), (int, float)):
                    text += f" vs {record['heuristic_ms']:.4g} ms for the heuristic choice"
                parts.append(text)
            if record.get("tuned_at") or record.get("shape"):
                parts.append(f"tuned {record.get('tuned_at', '?')} on {record.get('shape', '?')}")
            return cls(family, option, "; ".join(parts))
        except (KeyError, TypeError, ValueError):
            return None
