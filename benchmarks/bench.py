"""fastmm.matmul vs torch.matmul on the benchmark suite, side by side in one run.

    PYTHONPATH=. python3 benchmarks/bench.py [--json out.json] [--only square4k] [--precisions ieee,tf32]
    python3 benchmarks/bench.py --help

The suite is ../shared/bench_shapes.json beside the repo when present, else
benchmarks/bench_shapes.json (a copy; the GPU machine gets only the repo). The logic lives in
fastmm/benchmark.py so that an installed fastmm has it too (`python -m fastmm bench`).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, ahead of any installed fastmm

from fastmm.benchmark import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(prog="benchmarks/bench.py"))
