#!/usr/bin/env python3
"""Do two NVRTC releases build the same kernels? No GPU needed. ptxas (inside NVRTC) allocates
registers and schedules its own way from one 13.x to the next (issue 16), and fastmm's timings
were measured under one of them, so a new torch that pins another NVRTC may run other code.

    # 1. in a venv with each NVRTC (e.g. pip install "nvidia-cuda-nvrtc==13.2.86.*"):
    python benchmarks/probes/nvrtc_sass_diff.py dump DIR --nvdisasm PATH
    # 2. compare two dumps:
    python benchmarks/probes/nvrtc_sass_diff.py compare DIR_OLD DIR_NEW

``dump`` compiles every kernel the planner picks for the bench suite's rows (model and shapes
sections; ieee, tf32, tf32x3; simulated sm_90 and sm_80) under the installed NVRTC and writes each
kernel's SASS (nvdisasm, from the nvidia-cuda-nvdisasm wheel: ``pip download nvidia-cuda-nvdisasm
--no-deps`` and unzip; its ``nvidia/cu13/bin/nvdisasm``) with the addresses stripped, and an index
of which rows run which kernels. ``compare`` prints, for each kernel whose SASS differs: the
instruction count, the highest register used, the math instructions (FFMA / HMMA / HGMMA), and
for the SIMT family the FFMAs whose uncached register sources share a bank (all three / two of
three; register n is in bank n % 2, the model NOTES run 34 used), then the rows it serves.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ARCHS = ("sm_90", "sm_80")
PRECISIONS = ("ieee", "tf32", "tf32x3")
MATH = ("FFMA", "HMMA", "HGMMA")


def dump(out: Path, nvdisasm: str) -> None:
    from cuda.bindings import nvrtc

    from fastmm.benchmark import LAYOUTS, layout_of, load_suite
    from fastmm.plan import select
    from fastmm.problem import DeviceFacts, Problem
    from fastmm.runtime.compiler import compile_cubin

    suite, _ = load_suite()
    index: dict[str, list[str]] = {}
    built: set[tuple[str, str]] = set()
    for arch in ARCHS:
        dev = DeviceFacts.simulated_device(arch)
        (out / arch).mkdir(parents=True, exist_ok=True)
        for row in suite["model"] + suite["shapes"]:
            a_t, b_t = LAYOUTS[layout_of(row)]
            for precision in PRECISIONS:
                problem = Problem.dense(row["M"], row["N"], row["K"], precision, batch=row.get("batch", 1),
                                        a_t=a_t, b_t=b_t)
                names = []
                for cfg in select(problem, dev).kernels():
                    target = cfg.target(arch)
                    digest = hashlib.sha1(repr((cfg.family, cfg.macros, target)).encode()).hexdigest()
                    name = f"{cfg.family}-{digest[:12]}"
                    if (arch, name) not in built:
                        cubin = out / arch / (name + ".cubin")
                        cubin.write_bytes(compile_cubin(cfg.source, cfg.macros, target))
                        text = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True,
                                              check=True).stdout
                        (out / arch / (name + ".sass")).write_text("\n".join(sass_lines(text)))
                        built.add((arch, name))
                    names.append(name)
                index[f"{arch} {row['name']} {precision}"] = names
    _, major, minor = nvrtc.nvrtcVersion()
    (out / "index.json").write_text(json.dumps({"nvrtc": f"{major}.{minor}", "index": index}, indent=1))
    print(f"NVRTC {major}.{minor}: {len(built)} kernels -> {out}")


def sass_lines(text: str) -> list[str]:
    """nvdisasm's instruction lines without their /*address*/ comments."""
    return [re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in text.splitlines()
            if re.match(r"\s+/\*[0-9a-f]+\*/", line)]


def opcode(line: str) -> str:
    words = line.split()
    return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")


def bank_conflicts(lines: list[str]) -> tuple[int, int]:
    """FFMAs whose sources not held in the operand reuse cache all share a register bank, and
    those where at least two do (bank = register number % 2)."""
    held = [None, None, None]  # the register each source slot kept with .reuse
    three = two = 0
    for line in lines:
        m = re.match(r"(?:@\S+\s+)?FFMA\s+R\d+,\s*(\S+?),\s*(\S+?),\s*(\S+?)\s*;?$", line)
        if not m:
            held = [None, None, None]
            continue
        sources = list(m.groups())
        regs = [s.replace(".reuse", "") for s in sources]
        banks = [int(r[1:]) % 2 for slot, r in enumerate(regs) if held[slot] != r and re.fullmatch(r"R\d+", r)]
        held = [r if ".reuse" in s else None for s, r in zip(sources, regs)]
        three += len(banks) == 3 and len(set(banks)) == 1
        two += banks.count(0) >= 2 or banks.count(1) >= 2
    return three, two


def summary(path: Path) -> tuple[list[str], int, int, int]:
    lines = path.read_text().splitlines()
    regs = [int(r) for line in lines for r in re.findall(r"\bR(\d+)\b", line)]
    math = sum(opcode(line).startswith(MATH) for line in lines)
    return lines, len(lines), (max(regs) + 1 if regs else 0), math


def compare(old: Path, new: Path) -> None:
    meta_old, meta_new = (json.loads((d / "index.json").read_text()) for d in (old, new))
    rows: dict[tuple[str, str], list[str]] = {}
    for key, names in meta_old["index"].items():
        arch, row, precision = key.split()
        for name in names:
            rows.setdefault((arch, name), []).append(f"{row}/{precision}")
    same = 0
    print(f"NVRTC {meta_old['nvrtc']} -> {meta_new['nvrtc']}")
    for (arch, name), served in sorted(rows.items()):
        a, b = summary(old / arch / (name + ".sass")), summary(new / arch / (name + ".sass"))
        if a[0] == b[0]:
            same += 1
            continue
        text = f"{arch} {name}: instructions {a[1]} -> {b[1]}, registers {a[2]} -> {b[2]}, math {a[3]} -> {b[3]}"
        if name.startswith("simt"):
            text += ", FFMA same-bank 3/2: {}/{} -> {}/{}".format(*bank_conflicts(a[0]), *bank_conflicts(b[0]))
        print(text + f"; {len(served)} rows: {', '.join(served[:4])}{' ...' if len(served) > 4 else ''}")
    print(f"identical: {same} of {len(rows)} kernels")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("--nvdisasm", required=True, help="nvdisasm from the nvidia-cuda-nvdisasm wheel")
    c = sub.add_parser("compare")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    o = ap.parse_args()
    if o.cmd == "dump":
        dump(o.out, o.nvdisasm)
    else:
        compare(o.old, o.new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
