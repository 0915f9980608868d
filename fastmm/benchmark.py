"""Side-by-side benchmark of fastmm.matmul and torch.matmul (``python -m fastmm bench``,
``benchmarks/bench.py``).

For each shape of the suite (``bench_shapes.json``) and each precision, both libraries run in the
same process, interleaved sample by sample, on the same freshly random inputs:

- timing with CUDA events on the current stream; a few warm-up calls first (the first fastmm call
  compiles or loads its kernel); the median of at least ``--reps`` (10) timed samples, more for
  short calls, where a sample may hold several back-to-back calls (``inner``) so that it lasts long
  enough to be measured;
- shapes whose operands fit in L2 rotate among several input sets so that both libraries read
  from memory, not from a warm cache (``--rotate``);
- torch runs at the same precision: ``allow_tf32`` is True only for ``tf32``; ``tf32x3`` is
  compared with torch's full fp32 ("ieee");
- the relative Frobenius error of both results against a float64 product, computed outside the
  timed region;
- for the ``tiny`` shape, also the host time per call (wall clock over many calls, after a sync).

Everything here also runs on a CPU (``--device cpu``: fastmm then hands every call to
torch.matmul and time is wall clock), which is how the script itself is tested without a GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

PRECISIONS = ("ieee", "tf32", "tf32x3")
SHAPES_FILE = "bench_shapes.json"


# ---------------------------------------------------------------------------------------------
# the suite

def shapes_candidates() -> list[Path]:
    """Where the suite is looked for, first hit wins: the shared copy beside the repo, the
    repo's own copy, the copy inside an installed wheel."""
    pkg = Path(__file__).resolve().parent
    repo = pkg.parent
    return [repo.parent / "shared" / SHAPES_FILE, Path.cwd().parent / "shared" / SHAPES_FILE,
            repo / "benchmarks" / SHAPES_FILE, pkg / SHAPES_FILE]


def load_suite(path: str | os.PathLike | None = None) -> tuple[dict, Path]:
    if path is not None:
        p = Path(path)
        return json.loads(p.read_text()), p
    for p in shapes_candidates():
        if p.is_file():
            return json.loads(p.read_text()), p
    raise FileNotFoundError("no " + SHAPES_FILE + " found; looked at: " + ", ".join(map(str, shapes_candidates())))


#: How a row's operands are laid out (the ``layout`` key of the suite's ``model`` section; rows
#: of ``shapes`` say ``"a": "transposed view"`` instead): which operands are transposed views.
LAYOUTS = {
    "rowmajor": (False, False),
    "linear": (False, True),  # x @ W.t(), W stored [N, K] as nn.Linear keeps it: B K-contiguous
    "rowmajor_b": (False, False),  # grad_x = grad_y @ W: W read row-major
    "a_t": (True, False),  # grad_W = grad_y.t() @ x: A a transposed view
    "bmm": (False, False),
    "bmm_bt": (False, True),  # attention's Q @ K^T
}
LAYOUT_MARKS = {"linear": " W^T", "a_t": " A^T", "bmm_bt": " B^T"}


def layout_of(s: dict) -> str:
    return "a_t" if s.get("a") == "transposed view" else s.get("layout", "rowmajor")


def shape_label(s: dict) -> str:
    dims = f"{s['M']}x{s['N']}x{s['K']}"
    if s.get("batch", 1) != 1:
        dims = f"{s['batch']}x" + dims
    return dims + LAYOUT_MARKS.get(layout_of(s), "")


def flop_count(s: dict) -> int:
    return 2 * s.get("batch", 1) * s["M"] * s["N"] * s["K"]


def byte_floor(s: dict) -> int:
    """Bytes every implementation must move at least once: read A and B, write C (float32)."""
    return 4 * s.get("batch", 1) * (s["M"] * s["K"] + s["K"] * s["N"] + s["M"] * s["N"])


def scaled(s: dict, scale: float) -> dict:
    """The shape with M, N, K multiplied by ``scale`` (at least 1): for smoke runs on a CPU."""
    if scale == 1:
        return dict(s)
    out = dict(s)
    for k in ("M", "N", "K"):
        out[k] = max(1, int(round(s[k] * scale)))
    return out


# ---------------------------------------------------------------------------------------------
# inputs

class Inputs:
    """``sets`` independent random input sets (A, B and an output C each), kept in one buffer per
    operand with every set starting on a 256-byte boundary, so every set has the same alignment
    (and so gets the same plan) as a freshly allocated tensor."""

    def __init__(self, s: dict, sets: int, device: torch.device, seed: int = 0):
        self.shape = s
        batch = (s["batch"],) if s.get("batch", 1) != 1 else ()
        M, N, K = s["M"], s["N"], s["K"]
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        a_transposed, b_transposed = LAYOUTS[layout_of(s)]
        a_store = batch + ((K, M) if a_transposed else (M, K))
        b_store = batch + ((N, K) if b_transposed else (K, N))
        self.sets = sets
        self.a = [v.transpose(-1, -2) if a_transposed else v for v in self._views(a_store, sets, device, gen)]
        self.b = [v.transpose(-1, -2) if b_transposed else v for v in self._views(b_store, sets, device, gen)]
        self.c = self._views(batch + (M, N), sets, device, None)

    @staticmethod
    def _views(shape, sets, device, gen):
        numel = math.prod(shape)
        stride = -(-max(numel, 1) // 64) * 64
        if gen is None:
            buf = torch.full((stride * sets,), float("nan"), device=device)
        else:
            buf = torch.randn(stride * sets, device=device, generator=gen)
        return [buf[i * stride:i * stride + numel].view(shape) for i in range(sets)]


def input_sets(s: dict, l2_bytes: int, mode: str) -> int:
    """How many input sets to rotate through: enough to overflow L2 about 3 times over when the
    operands of one call fit in it (``mode`` "auto"), else one."""
    if mode == "off" or l2_bytes <= 0:
        return 1
    ws = byte_floor(s)
    if mode == "on" or ws < l2_bytes:
        return int(min(4096, max(2, math.ceil(3 * l2_bytes / ws))))
    return 1


# ---------------------------------------------------------------------------------------------
# measuring

class TorchPrecision:
    """torch.matmul at the precision fastmm is asked for: TF32 only for "tf32"."""

    def __init__(self, precision: str):
        self.allow = precision == "tf32"

    def __enter__(self):
        self.old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.allow
        return self

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.old


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fns: dict, reps: int, inner: int, device: torch.device, start: int = 0) -> dict[str, list[float]]:
    """Milliseconds per call of each function, ``reps`` samples of ``inner`` calls each. The
    functions take the index of the call (to rotate inputs) and are interleaved sample by sample,
    so a change of clock speed or temperature during the run hits all of them alike."""
    cuda = device.type == "cuda"
    samples: dict[str, list] = {name: [] for name in fns}
    k = start
    for _ in range(reps):
        for name, fn in fns.items():
            if cuda:
                t0 = torch.cuda.Event(enable_timing=True)
                t1 = torch.cuda.Event(enable_timing=True)
                t0.record()
                for j in range(inner):
                    fn(k + j)
                t1.record()
                samples[name].append((t0, t1))
            else:
                t0 = time.perf_counter()
                for j in range(inner):
                    fn(k + j)
                samples[name].append((time.perf_counter() - t0) * 1e3)
        k += inner
    if cuda:
        synchronize(device)
        return {name: [t0.elapsed_time(t1) / inner for t0, t1 in ev] for name, ev in samples.items()}
    return {name: [t / inner for t in ts] for name, ts in samples.items()}


def host_us_per_call(fns: dict, calls: int, rounds: int, device: torch.device) -> dict[str, float]:
    """Wall-clock microseconds per call over ``calls`` back-to-back calls (after a sync on both
    sides), best of ``rounds``, interleaved: the host cost of a call on a launch-bound shape."""
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            synchronize(device)
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i)
            synchronize(device)
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best


def rel_error(c: torch.Tensor, ref: torch.Tensor) -> float:
    denom = ref.norm().item()
    num = (c.double() - ref).norm().item()
    return num / denom if denom else num


def kernel_label(a, b, c, precision) -> tuple[str, float | None]:
    """The kernel fastmm plans for this call ("family BMxBNxBK", or torch and why) and the cost
    model's GPU time for that plan (fastmm.cost; None for torch), from one explain."""
    import fastmm

    try:
        exp = fastmm.explain(a, b, precision=precision, out=c)
    except Exception as exc:  # the label must never sink a benchmark row
        return f"? ({type(exc).__name__}: {exc})", None
    if exp.kernel is None:
        return "torch (" + str(exp.fallback) + ")", None
    tile = exp.launch.get("tile")
    return exp.kernel + (f" {tile[0]}x{tile[1]}x{tile[2]}" if tile else ""), exp.prediction.total_us


def bench_one(s: dict, precision: str, opts, device: torch.device, l2_bytes: int, ref_cache: dict) -> dict:
    """One row: fastmm and torch.matmul on shape ``s`` at ``precision``."""
    import fastmm

    row = {"name": s["name"], "shape": shape_label(s), "precision": precision, "M": s["M"], "N": s["N"],
           "K": s["K"], "batch": s.get("batch", 1), "layout": layout_of(s), "section": s.get("section", "shapes"),
           "flop": flop_count(s), "bytes_floor": byte_floor(s)}
    sets = input_sets(s, l2_bytes, opts.rotate)
    x = Inputs(s, sets, device, seed=opts.seed)
    row["input_sets"] = sets

    def run_fastmm(i):
        j = i % sets
        fastmm.matmul(x.a[j], x.b[j], out=x.c[j], precision=precision)

    def run_torch(i):
        j = i % sets
        torch.matmul(x.a[j], x.b[j], out=x.c[j])

    fns = {"fastmm": run_fastmm, "torch": run_torch}
    with TorchPrecision(precision), torch.no_grad():
        row["kernel"], row["predicted_us"] = kernel_label(x.a[0], x.b[0], x.c[0], precision)
        # correctness on the side (not timed): both results against float64
        if not opts.no_check:
            key = (s["name"], s["M"], s["N"], s["K"], s.get("batch", 1))
            ref = ref_cache.get(key)
            if ref is None:
                ref_cache.clear()  # one float64 reference at a time is enough (they are big)
                ref = ref_cache[key] = torch.matmul(x.a[0].double(), x.b[0].double())
            for name, fn in fns.items():
                x.c[0].fill_(float("nan"))
                fn(0)
                synchronize(device)
                row[f"err_{name}"] = rel_error(x.c[0], ref)
        for _ in range(opts.warmup):
            for fn in fns.values():
                fn(0)
        synchronize(device)
        # size a sample: several calls when one call is shorter than --min-sample-ms
        probe = measure(fns, 3, 1, device)
        est = max(statistics.median(v) for v in probe.values())
        inner = 1 if est <= 0 else int(min(opts.max_inner, max(1, math.ceil(opts.min_sample_ms / est))))
        per_sample = max(est * inner, 1e-6)
        reps = int(max(opts.reps, min(opts.max_reps, opts.budget_ms / 2 / per_sample)))
        times = measure(fns, reps, inner, device, start=3)
        for name, ts in times.items():
            med = statistics.median(ts)
            row[f"{name}_ms"] = med
            row[f"{name}_ms_min"] = min(ts)
            row[f"{name}_ms_max"] = max(ts)
            row[f"{name}_tflops"] = row["flop"] / (med * 1e-3) / 1e12 if med > 0 else float("nan")
            row[f"{name}_gbps"] = row["bytes_floor"] / (med * 1e-3) / 1e9 if med > 0 else float("nan")
        row["ratio"] = row["torch_ms"] / row["fastmm_ms"] if row["fastmm_ms"] > 0 else float("nan")
        row["reps"], row["inner"] = reps, inner
        if s.get("name") == "tiny" or "host overhead" in str(s.get("note", "")):
            x0 = {"fastmm": lambda i: fastmm.matmul(x.a[0], x.b[0], out=x.c[0], precision=precision),
                  "torch": lambda i: torch.matmul(x.a[0], x.b[0], out=x.c[0])}
            host = host_us_per_call(x0, opts.host_calls, 5, device)
            row["host_us_fastmm"], row["host_us_torch"] = host["fastmm"], host["torch"]
    return row


# ---------------------------------------------------------------------------------------------
# output

def _f(v, fmt) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def format_table(rows: list[dict]) -> str:
    head = ("shape", "name", "prec", "fastmm TF/s", "torch TF/s", "ratio", "err fastmm", "err torch", "fastmm kernel")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append((r["shape"], r["name"], r["precision"], "ERROR", "", "", "", "", r["error"][:80]))
            continue
        lines.append((r["shape"], r["name"], r["precision"], _f(r.get("fastmm_tflops"), ".2f"),
                      _f(r.get("torch_tflops"), ".2f"), _f(r.get("ratio"), ".3f"),
                      _f(r.get("err_fastmm"), ".1e"), _f(r.get("err_torch"), ".1e"), _clip(r.get("kernel", ""), 60)))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = "  ".join("{:<%d}" % w if i in (0, 1, 2, 8) else "{:>%d}" % w for i, w in enumerate(widths))
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*map(str, ln)) for ln in lines]
    host = [r for r in rows if "host_us_fastmm" in r]
    if host:
        out.append("")
        out.append("host time per call (wall clock, out= preallocated):")
        for r in host:
            ratio = r["host_us_fastmm"] / r["host_us_torch"] if r["host_us_torch"] else float("nan")
            out.append(f"  {r['shape']} {r['precision']}: fastmm {r['host_us_fastmm']:.1f} us, "
                       f"torch {r['host_us_torch']:.1f} us ({ratio:.2f}x torch)")
    sections: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        if r.get("ratio") and r["ratio"] > 0 and not math.isnan(r["ratio"]):
            sections.setdefault(r.get("section", "shapes"), {}).setdefault(r["precision"], []).append(r["ratio"])
    for section, by_prec in sections.items():
        out.append("")
        out.append(f"section {section}: geometric mean of fastmm/torch speed (lowest row): " + ", ".join(
            f"{p} {math.exp(sum(map(math.log, v)) / len(v)):.3f} ({min(v):.3f}; {len(v)} shapes)"
            for p, v in by_prec.items()))
    return "\n".join(out)


def write_plot(rows: list[dict], path: str) -> str:
    """A grouped bar chart (TFLOP/s, log scale) of fastmm vs torch per shape and precision."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot {path}: matplotlib is not installed (pip install matplotlib); no plot written"
    good = [r for r in rows if "fastmm_tflops" in r]
    if not good:
        return f"--plot {path}: no measured rows; no plot written"
    labels = [f"{r['name']}\n{r['precision']}" for r in good]
    xs = range(len(good))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * len(good)), 5.0))
    w = 0.4
    ax.bar([i - w / 2 for i in xs], [r["fastmm_tflops"] for r in good], w, label="fastmm")
    ax.bar([i + w / 2 for i in xs], [r["torch_tflops"] for r in good], w, label="torch.matmul")
    for i, r in enumerate(good):
        ax.annotate(f"{r['ratio']:.2f}x", (i, max(r["fastmm_tflops"], r["torch_tflops"])), ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("fastmm vs torch.matmul (label: fastmm speed / torch speed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


def environment(device: torch.device) -> dict:
    import fastmm

    env = {"fastmm": fastmm.__version__, "torch": torch.__version__, "python": sys.version.split()[0],
           "device": str(device), "date": datetime.datetime.now().isoformat(timespec="seconds")}
    for mod in ("cuda.core", "cuda.bindings"):
        try:
            env[mod] = __import__(mod, fromlist=["__version__"]).__version__
        except Exception as exc:
            env[mod] = f"unavailable ({type(exc).__name__})"
    try:
        from .runtime.compiler import nvrtc_version

        env["nvrtc"] = "%d.%d" % nvrtc_version()
    except Exception as exc:
        env["nvrtc"] = f"unavailable ({type(exc).__name__})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["capability"] = f"{props.major}.{props.minor}"
        env["sm_count"] = props.multi_processor_count
    return env


def l2_size(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 0)


# ---------------------------------------------------------------------------------------------
# command line

def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog, description="fastmm.matmul vs torch.matmul, side by side in one run, per shape and precision "
        "(TFLOP/s, ratio, chosen kernel, error vs float64).")
    ap.add_argument("--shapes", metavar="JSON", help="suite file (default: ../shared/bench_shapes.json beside the "
                    "repo, else benchmarks/bench_shapes.json, else the copy in the installed package)")
    ap.add_argument("--only", action="append", metavar="NAME", help="run only these shapes (by name; repeat or "
                    "separate with commas)")
    ap.add_argument("--precisions", default=None, help="comma-separated subset of ieee,tf32,tf32x3 (default: the "
                    "suite's list)")
    ap.add_argument("--section", choices=("all", "shapes", "model"), default="all",
                    help="the suite's headline shapes, its model section (nn.Linear's x @ W.t(), backward forms, "
                         "decode, attention bmm; each row's layout shown), or both (default)")
    ap.add_argument("--json", metavar="PATH", help="write the rows and the environment as JSON")
    ap.add_argument("--plot", metavar="PNG", help="write a bar chart (needs matplotlib)")
    ap.add_argument("--table-from", metavar="JSON", help="print the table of an earlier --json file and exit")
    ap.add_argument("--reps", type=int, default=10, help="least number of timed samples (default 10)")
    ap.add_argument("--max-reps", type=int, default=200, help="most timed samples for short calls (default 200)")
    ap.add_argument("--budget-ms", type=float, default=600.0,
                    help="timing budget per shape and precision, both libraries together (default 600)")
    ap.add_argument("--min-sample-ms", type=float, default=0.25,
                    help="calls shorter than this are timed several back to back per sample (default 0.25)")
    ap.add_argument("--max-inner", type=int, default=100, help="most calls in one timed sample (default 100)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls of each library first (default 3)")
    ap.add_argument("--rotate", choices=("auto", "on", "off"), default="auto",
                    help="rotate among input sets so operands are not L2-resident (auto: when one call's "
                    "operands fit in L2)")
    ap.add_argument("--host-calls", type=int, default=2000, help="calls per round for the host-overhead "
                    "measurement of the tiny shape (default 2000)")
    ap.add_argument("--no-check", action="store_true", help="skip the error vs float64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="torch device (default cuda; 'cpu' runs a smoke test of this "
                    "script, where fastmm hands every call to torch)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply M, N, K by this (smoke tests)")
    return ap


def selected_shapes(suite: dict, only, section: str = "all") -> list[dict]:
    """The suite's rows: its ``shapes`` (the headline suite), its ``model`` section (the products
    real models run, each with its layout), or both; ``only`` picks rows by name."""
    shapes = []
    if section in ("shapes", "all"):
        shapes += [dict(s, section="shapes") for s in suite["shapes"]]
    if section in ("model", "all"):
        shapes += [dict(s, section="model") for s in suite.get("model", [])]
    if not only:
        return shapes
    names = [n.strip() for item in only for n in item.split(",") if n.strip()]
    known = {s["name"] for s in shapes}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown shape name(s) {unknown}; the suite has {sorted(known)}")
    return [s for s in shapes if s["name"] in names]


def run(shapes: list[dict], precisions, opts, device: torch.device, out=sys.stdout) -> list[dict]:
    rows = []
    l2 = l2_size(device)
    refs: dict = {}
    todo = [(s, p) for s in shapes for p in precisions]
    t_start = time.perf_counter()
    for n, (s, p) in enumerate(todo, 1):
        s = scaled(s, opts.scale)
        t0 = time.perf_counter()
        try:
            row = bench_one(s, p, opts, device, l2, refs)
            msg = (f"fastmm {row['fastmm_tflops']:.2f} TFLOP/s, torch {row['torch_tflops']:.2f} TFLOP/s, "
                   f"ratio {row['ratio']:.3f}, {row['kernel']}")
        except Exception as exc:  # keep going: one broken row must not hide the others
            row = {"name": s["name"], "shape": shape_label(s), "precision": p, "error": f"{type(exc).__name__}: {exc}"}
            msg = "ERROR " + row["error"]
        if device.type == "cuda" and (n == len(todo) or todo[n][0] is not todo[n - 1][0]):
            refs.clear()
            torch.cuda.empty_cache()
        rows.append(row)
        print(f"[{n}/{len(todo)} {time.perf_counter() - t_start:6.1f}s] {s['name']} {shape_label(s)} {p}: {msg} "
              f"({time.perf_counter() - t0:.1f}s)", file=out, flush=True)
    return rows


def main(argv=None, prog: str | None = None) -> int:
    opts = build_parser(prog).parse_args(argv)
    if opts.table_from:
        data = json.loads(Path(opts.table_from).read_text())
        print(format_table(data["rows"]))
        return 0
    device = torch.device(opts.device or "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device is available to torch: nothing to benchmark (--device cpu runs a smoke test of the "
              "script itself)", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    suite, suite_path = load_suite(opts.shapes)
    precisions = [p.strip() for p in (opts.precisions.split(",") if opts.precisions else suite.get("precisions", PRECISIONS))]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad:
        raise SystemExit(f"unknown precision(s) {bad}; expected a subset of {list(PRECISIONS)}")
    shapes = selected_shapes(suite, opts.only, opts.section)
    env = environment(device)
    print(f"fastmm {env['fastmm']} vs torch {env['torch']} on {env.get('gpu', device)}; suite {suite_path}; "
          f"{len(shapes)} shapes x {len(precisions)} precisions", flush=True)
    rows = run(shapes, precisions, opts, device)
    print()
    print(format_table(rows))
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps({"environment": env, "suite": str(suite_path), "rows": rows,
                                               "options": vars(opts)}, indent=1, default=str))
        print(f"\nJSON written to {opts.json}")
    if opts.plot:
        print(write_plot(rows, opts.plot))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
