"""``python -m fastmm``: the main job, and a few maintenance commands.

    python -m fastmm                      # = check
    python -m fastmm check [--no-bench]   # GPU: self-check every kernel path, explain, short benchmark
                                          # no GPU: compile every family for every supported arch into
                                          # the cache, print the plans for simulated sm80 and sm90
    python -m fastmm bench [...]          # the benchmark suite (python -m fastmm bench --help)
    python -m fastmm cache list|verify|clear|precompile [--arch sm_90 ...]
    python -m fastmm explain M N K [--precision tf32] [--a-transposed] [--batch 4] [--simulate sm_80]
    python -m fastmm tune M N K [--precision tf32] [--a-transposed] [--batch 4] [--repeats 20] [--no-save]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

SUPPORTED_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
TOLERANCE = {"ieee": 1e-5, "tf32": 1e-3, "tf32x3": 1e-6}


def forced_paths():
    """(family, precision) pairs the self-check forces: each family at "ieee" where it computes
    it, else at each precision it computes (tf32_mma: tf32 and tf32x3)."""
    from .families import FAMILIES

    out = []
    for name, fam in FAMILIES.items():
        precs = ("ieee",) if "ieee" in fam.precisions else tuple(fam.precisions)
        out += [(name, p) for p in precs]
    return out


def _say(*args) -> None:
    print(*args, flush=True)


def gpu_reason() -> str | None:
    """None when a CUDA device is there for fastmm; else why not."""
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a CPU-only build"
        return "torch.cuda.is_available() is False: no CUDA device or driver"
    return None


# ---------------------------------------------------------------------------------------------
# compiling without a GPU (and `cache precompile`)

def representative_problems():
    """Problems whose plans cover every family and the main variants of each: large aligned,
    unaligned (no vector loads), A as a transposed view, a small one (smallest tiles), a tiny one
    (scalar), decode against nn.Linear's weight layout (x @ W.t(): B K-contiguous), at every
    precision."""
    from .problem import PRECISIONS, Problem

    out = []
    for prec in PRECISIONS:
        out += [Problem.dense(4096, 4096, 4096, prec), Problem.dense(4097, 4095, 4093, prec),
                Problem.dense(4096, 4096, 4096, prec, a_t=True), Problem.dense(256, 256, 256, prec),
                Problem.dense(16, 16, 16, prec), Problem.dense(16, 4096, 4096, prec),
                Problem.dense(256, 256, 65536, prec), Problem.dense(1, 4096, 4096, prec, b_t=True),
                Problem.dense(16, 4096, 4096, prec, b_t=True)]
    return out


def configs_for(dev, problems=None):
    """Distinct kernel configurations (by cache key) the dispatcher makes for ``dev``: its own
    choice and every family forced, for each problem."""
    from .families import FAMILIES
    from .plan import select
    from .runtime.launcher import key_for

    found = {}
    for p in problems or representative_problems():
        choices = [None] + [name for name, fam in FAMILIES.items() if fam.reject(p, dev) is None]
        for force in choices:
            try:
                plan = select(p, dev, force=force)
            except ValueError:  # the family cannot run this problem
                continue
            for cfg in plan.kernels():
                found.setdefault(key_for(cfg, dev.arch), cfg)
    return found


def progress_bar(stream=None, width: int = 30):
    """A callback for :func:`precompile`: a bar redrawn in place on a terminal; elsewhere (logs,
    pipes) one line per tenth of the way."""
    stream = stream if stream is not None else sys.stderr
    tty = hasattr(stream, "isatty") and stream.isatty()
    shown = set()

    def show(done: int, total: int, arch: str, what: str) -> None:
        filled = width * done // max(total, 1)
        text = f"  {arch} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what}"
        if tty:
            stream.write("\r" + text.ljust(width + 40)[: width + 60] + ("\n" if done == total else ""))
        else:
            step = (arch, 10 * done // max(total, 1))
            if step in shown and done != total:
                return
            shown.add(step)
            stream.write(text + "\n")
        stream.flush()

    return show


def precompile(devices, problems=None, out=_say, progress=None) -> int:
    """Compile (or find in the disk cache) the representative configurations for each device.
    Returns the number of failures. ``progress(done, total, arch, family)`` is called after each
    kernel (see :func:`progress_bar`)."""
    from .runtime.cache import default_cache
    from .runtime.compiler import compile_cubin

    cache = default_cache()
    failures = 0
    for dev in devices:
        t0 = time.perf_counter()
        configs = configs_for(dev, problems)
        states = {"compiled": 0, "disk": 0}
        families = sorted({cfg.family for cfg in configs.values()})
        for i, (key, cfg) in enumerate(configs.items()):
            if progress is not None and i == 0:
                progress(0, len(configs), dev.arch, "")
            try:
                target = cfg.target(dev.arch)
                res = cache.get_or_compile(cfg.family + "-" + target, key, target,
                                           lambda cfg=cfg, target=target: compile_cubin(cfg.source, cfg.macros, target))
                states[res.state] += 1
            except Exception as exc:
                failures += 1
                out(f"  FAILED {cfg.family} {dict(cfg.macros)} for {dev.arch}: {exc}")
            if progress is not None:
                progress(i + 1, len(configs), dev.arch, cfg.family)
        where = cache.folder if cache.usable() else "memory only"
        out(f"{dev.arch} ({dev.name}): {len(configs)} kernels of {len(families)} families ({', '.join(families)}): "
            f"{states['compiled']} compiled, {states['disk']} already cached, in {time.perf_counter() - t0:.1f} s -> {where}")
    return failures


def show_simulated_plans(archs=("sm_80", "sm_90"), out=_say) -> None:
    from .plan import select
    from .problem import DeviceFacts, Problem

    cases = [
        ("aligned 4096x4096x4096 ieee", Problem.dense(4096, 4096, 4096, "ieee")),
        ("aligned 4096x4096x4096 tf32", Problem.dense(4096, 4096, 4096, "tf32")),
        ("unaligned 4097x4095x4093 ieee", Problem.dense(4097, 4095, 4093, "ieee")),
        ("A transposed 2048x2048x2048 tf32x3", Problem.dense(2048, 2048, 2048, "tf32x3", a_t=True)),
        ("tiny 16x16x16 ieee", Problem.dense(16, 16, 16, "ieee")),
    ]
    for arch in archs:
        dev = DeviceFacts.simulated_device(arch)
        out(f"\n=== plans on a {dev.name} ({arch}, {dev.sm_count} SMs) ===")
        for title, p in cases:
            out(f"\n{title}:")
            out("  " + select(p, dev).describe().replace("\n", "\n  "))


# ---------------------------------------------------------------------------------------------
# the GPU self-check

def _cases(device):
    """(label, a, b) operands: awkward sizes, transposed views, storage offsets, a batch."""
    g = torch.Generator(device=device)
    g.manual_seed(1234)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=g)

    def offset(rows, cols, off):
        return rnd(rows * cols + off)[off:].view(rows, cols)

    return [
        ("1x1x1", rnd(1, 1), rnd(1, 1)),
        ("3x5x4", rnd(3, 4), rnd(4, 5)),
        ("17x19x23", rnd(17, 23), rnd(23, 19)),
        ("129x96x132 A^T view", rnd(132, 129).t(), rnd(132, 96)),
        ("257x129x193 B^T view", rnd(257, 193), rnd(129, 193).t()),
        ("130x68x36 offsets 1,3", offset(130, 36, 1), offset(36, 68, 3)),
        ("batch 3x65x33x47 (B broadcast)", rnd(3, 65, 47), rnd(47, 33)),
        ("1000x1000x1000", rnd(1000, 1000), rnd(1000, 1000)),
        ("4097x4095x4093", rnd(4097, 4093), rnd(4093, 4095)),
        ("16x1024x4096 skinny", rnd(16, 4096), rnd(4096, 1024)),
        ("64x72x16384 long K", rnd(64, 16384), rnd(16384, 72)),
    ]


def _rel_err(c, a, b) -> float:
    ref = torch.matmul(a.double(), b.double())
    denom = ref.norm().item()
    return (c.double() - ref).norm().item() / denom if denom else (c.double() - ref).norm().item()


def self_check(device, out=_say) -> int:
    """Force each kernel path on every case, and run the dispatcher's own choice at each
    precision; compare with float64. Returns the number of failures."""
    from . import dispatch
    from .families import FAMILIES
    from .plan import FamilyCannotRun
    from .problem import PRECISIONS
    from .runtime.device import device_facts

    facts = device_facts(device.index)
    cases = _cases(device)
    failures = 0
    runs = forced_paths() + [(None, prec) for prec in PRECISIONS]
    for fam, prec in runs:
        label = f"{fam or 'dispatcher'} @ {prec}"
        if fam is not None and facts.cc < FAMILIES[fam].min_cc:
            out(f"  skip {label:<28} needs sm{FAMILIES[fam].min_cc[0]}{FAMILIES[fam].min_cc[1]}+, device is {facts.arch}")
            continue
        tol = TOLERANCE[prec]
        worst, worst_case, bad, skipped = 0.0, "", [], 0
        t0 = time.perf_counter()
        for name, a, b in cases:
            try:
                shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
                c = torch.full(shape, float("nan"), device=device)
                with torch.no_grad():
                    _, plan, fallback = dispatch.matmul_fastmm(a, b, c, prec, force=fam)
                torch.cuda.synchronize(device)
                if fallback is not None:
                    bad.append(f"{name}: ran torch.matmul instead ({fallback})")
                    continue
                used = plan.kernel.family if plan is not None and plan.kernel is not None else "?"
                if fam is not None and used != fam:
                    bad.append(f"{name}: ran {used}, not {fam}")
                err = _rel_err(c, a, b)
                if not err <= tol:  # NaN fails too
                    bad.append(f"{name}: rel. error {err:.2e} > {tol:.0e} ({used})")
                if err > worst or err != err:
                    worst, worst_case = err, name
            except FamilyCannotRun:  # a forced family that does not take this shape
                skipped += 1
                continue
            except Exception as exc:
                bad.append(f"{name}: {type(exc).__name__}: {exc}")
        status = "ok  " if not bad else "FAIL"
        ran = len(cases) - skipped
        out(f"  {status} {label:<28} {ran - len(bad)}/{ran} cases" + (f" ({skipped} not applicable)" if skipped else "")
            + f", worst rel. error {worst:.1e} ({worst_case}), tolerance {tol:.0e}, {time.perf_counter() - t0:.1f} s")
        for line in bad:
            out(f"       {line}")
        failures += len(bad)
    return failures


def show_explains(device, out=_say) -> None:
    import fastmm

    g = torch.Generator(device=device)
    g.manual_seed(7)
    shapes = [((4096, 4096), (4096, 4096), "ieee", False), ((4096, 4096), (4096, 4096), "tf32", False),
              ((4097, 4093), (4093, 4095), "ieee", False), ((16, 4096), (4096, 4096), "ieee", False),
              ((1000, 1000), (1000, 1000), "tf32x3", True)]
    for sa, sb, prec, a_t in shapes:
        a = torch.randn(*sa, device=device, generator=g)
        if a_t:
            a = a.t().contiguous().t()  # same values, A as a transposed view
        b = torch.randn(*sb, device=device, generator=g)
        out("")
        out(str(fastmm.explain(a, b, precision=prec)))


def short_bench(device, out=_say) -> int:
    from . import benchmark

    shapes = [({"name": "square4k", "M": 4096, "N": 4096, "K": 4096}, ("ieee", "tf32", "tf32x3")),
              ({"name": "square1000", "M": 1000, "N": 1000, "K": 1000}, ("ieee",)),
              ({"name": "tiny", "M": 64, "N": 64, "K": 64, "note": "host overhead per call"}, ("ieee",))]
    opts = benchmark.build_parser().parse_args(["--budget-ms", "300", "--host-calls", "1000"])
    rows = []
    for s, precs in shapes:
        rows += benchmark.run([s], precs, opts, device, out=sys.stdout)
    out("")
    out(benchmark.format_table(rows))
    return sum("error" in r for r in rows)


def cmd_check(args) -> int:
    import fastmm

    _say(f"fastmm {fastmm.__version__}, torch {torch.__version__}, {_versions()}")
    reason = gpu_reason()
    if reason is not None:
        return check_without_gpu(reason, args)
    device = torch.device("cuda", args.device if args.device is not None else torch.cuda.current_device())
    torch.cuda.set_device(device)
    from .dispatch import runtime_reason as _runtime_reason
    from .runtime.device import device_facts

    facts = device_facts(device.index)
    _say(f"GPU: {device} = {facts.name}, {facts.arch}, {facts.sm_count} SMs, "
         f"{facts.smem_per_block_optin // 1024} KiB shared memory per block, {facts.l2_bytes >> 20} MiB L2")
    why = _runtime_reason()
    if why is not None:
        _say(f"fastmm cannot run its kernels here: {why}")
        return 1
    _say("\nself-check: every kernel path against a float64 reference")
    failures = self_check(device)
    if not args.no_explain:
        _say("\nwhat the dispatcher picks (fastmm.explain):")
        show_explains(device)
    bench_errors = 0
    if not args.no_bench:
        _say("\nshort benchmark, fastmm vs torch.matmul (full suite: python -m fastmm bench):")
        bench_errors = short_bench(device)
    _say("")
    if failures or bench_errors:
        _say(f"self-check FAILED: {failures} failing case(s), {bench_errors} benchmark error(s)")
        return 1
    _say("self-check passed")
    return 0


def check_without_gpu(reason: str, args) -> int:
    from .problem import DeviceFacts
    from .runtime.compiler import nvrtc_unavailable_reason, nvrtc_version

    _say(f"no GPU: {reason}. fastmm.matmul hands every call to torch.matmul here.")
    failures = 0
    if not args.no_compile:
        why = nvrtc_unavailable_reason()
        if why is not None:
            _say(f"cannot compile kernels: {why}")
            failures += 1
        else:
            major, minor = nvrtc_version()
            _say(f"compiling every kernel family with NVRTC {major}.{minor} for {', '.join(SUPPORTED_ARCHS)} "
                 "into the disk cache:")
            failures += precompile([DeviceFacts.simulated_device(a) for a in SUPPORTED_ARCHS])
    show_simulated_plans()
    _say("")
    if failures:
        _say(f"FAILED: {failures} kernel(s) did not compile")
        return 1
    _say("done (no GPU: kernels compiled and plans shown; run on a GPU for the self-check and benchmark)")
    return 0


def _versions() -> str:
    parts = []
    for mod in ("cuda.core", "cuda.bindings"):
        try:
            parts.append(f"{mod} {__import__(mod, fromlist=['__version__']).__version__}")
        except Exception as exc:
            parts.append(f"{mod} unavailable ({type(exc).__name__})")
    try:
        from .runtime.compiler import nvrtc_version

        parts.append("NVRTC %d.%d" % nvrtc_version())
    except Exception as exc:
        parts.append(f"NVRTC unavailable ({type(exc).__name__})")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# cache, explain, bench

def cmd_cache(args) -> int:
    from .runtime.cache import default_cache

    cache = default_cache()
    if args.action == "list":
        entries = cache.entries()
        total = 0
        for path in entries:
            size = path.stat().st_size
            total += size
            print(f"{size:>10,d} B  {path.name}")
        print(f"{len(entries)} entries, {total:,d} B in {cache.folder}")
        return 0
    if args.action == "verify":
        results = cache.verify()
        bad = [p for p, ok in results if not ok]
        for path, ok in results:
            print(f"{'ok ' if ok else 'BAD'}  {path.name}")
        if bad and args.delete_bad:
            kept = []
            for path in bad:
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:  # a folder of that name, no permission, ...
                    kept.append(f"{path.name} ({exc.strerror or exc})")
            print(f"deleted {len(bad) - len(kept)} bad entries (they are recompiled on next use)")
            if kept:
                print("could not delete: " + ", ".join(kept))
                return 1
        print(f"{len(results)} entries in {cache.folder}: {len(results) - len(bad)} valid, {len(bad)} bad")
        return 1 if bad and not args.delete_bad else 0
    if args.action == "clear":
        n = cache.clear()
        print(f"removed {n} entries from {cache.folder}")
        return 0
    # precompile
    from .problem import DeviceFacts

    if args.arch:
        archs = [a if a.startswith("sm_") else "sm_" + a.replace(".", "") for a in args.arch]
        unknown = [a for a in archs if a not in SUPPORTED_ARCHS]
        if unknown:
            print(f"unsupported arch {unknown}; choose from {list(SUPPORTED_ARCHS)}", file=sys.stderr)
            return 2
        devices = [DeviceFacts.simulated_device(a) for a in archs]
    else:
        reason = gpu_reason()
        if reason is not None:
            print(f"no GPU ({reason}): name the targets with --arch, e.g. --arch sm_90 (or --all)", file=sys.stderr)
            return 2
        from .runtime.device import device_facts

        devices = [device_facts(torch.cuda.current_device())]
    return 1 if precompile(devices, out=print, progress=progress_bar()) else 0


def _operands(args, device):
    """Uninitialised A (M x K) and B (K x N) laid out as the command line says (explain and tune
    read only their shapes, strides and alignment)."""
    batch = (args.batch,) if args.batch else ()
    a = torch.empty(batch + ((args.K, args.M) if args.a_transposed else (args.M, args.K)), device=device)
    b = torch.empty(batch + ((args.N, args.K) if args.b_transposed else (args.K, args.N)), device=device)
    return (a.transpose(-1, -2) if args.a_transposed else a), (b.transpose(-1, -2) if args.b_transposed else b)


def cmd_explain(args) -> int:
    from .precision import resolve_precision

    precision = resolve_precision(args.precision)
    if args.simulate is None and gpu_reason() is None:
        import fastmm

        a, b = _operands(args, torch.device("cuda", torch.cuda.current_device()))
        print(fastmm.explain(a, b, precision=precision))
        return 0
    from .plan import select
    from .problem import DeviceFacts, Problem

    arch = args.simulate or "sm_90"
    arch = arch if arch.startswith("sm_") else "sm_" + arch.replace(".", "")
    if arch not in SUPPORTED_ARCHS:
        print(f"unsupported arch {arch}; choose from {list(SUPPORTED_ARCHS)}", file=sys.stderr)
        return 2
    dev = DeviceFacts.simulated_device(arch)
    if args.simulate is None:
        print(f"(no GPU: {gpu_reason()}; showing the plan for a {dev.name}, {arch})")
    p = Problem.dense(args.M, args.N, args.K, precision, batch=args.batch or 1, a_t=args.a_transposed,
                      b_t=args.b_transposed)
    print(f"fastmm plan for {args.M}x{args.N}x{args.K}" + (f", batch {args.batch}" if args.batch else "")
          + f", precision {precision}, A {p.layout_of('a')}, B {p.layout_of('b')}, on {dev.name} ({arch}):")
    print(select(p, dev).describe())
    return 0


def cmd_tune(args) -> int:
    reason = gpu_reason()
    if reason is not None:
        print(f"no GPU ({reason}): tuning times kernels on a GPU", file=sys.stderr)
        return 2
    import fastmm

    device = torch.device("cuda", args.device if args.device is not None else torch.cuda.current_device())
    a, b = _operands(args, device)
    result = fastmm.tune(a, b, precision=args.precision, repeats=args.repeats, persist=not args.no_save)
    print(result)
    return 0 if result.best is not None else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fastmm",
        description="fastmm: torch.matmul for float32 CUDA tensors on its own NVRTC-compiled kernels. "
        "Without a command: 'check'.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m fastmm                    self-check (GPU) or compile + show plans (no GPU)\n"
        "  python -m fastmm bench --only square4k --precisions ieee,tf32\n"
        "  python -m fastmm explain 4097 4095 4093 --precision tf32\n"
        "  python -m fastmm cache precompile --arch sm_80 --arch sm_90")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser("check", help="the main job (default): self-check on a GPU; compile + plans without one",
                       description="On a GPU: force every kernel path (scalar, simt_float4, simt_cp_async, "
                       "tf32_mma at tf32 and tf32x3) and the dispatcher's own choice on awkward shapes, compare with "
                       "float64 (rel. Frobenius error: ieee <= 1e-5, tf32 <= 1e-3, tf32x3 <= 1e-6), print explain() "
                       "for a few shapes and a short benchmark; exit 1 if any check fails. Without a GPU: compile "
                       "every family for " + ", ".join(SUPPORTED_ARCHS) + " into the disk cache and print the plans "
                       "for simulated sm_80 and sm_90 devices.")
    c.add_argument("--no-bench", action="store_true", help="skip the short benchmark (GPU)")
    c.add_argument("--no-explain", action="store_true", help="skip the explain() examples (GPU)")
    c.add_argument("--no-compile", action="store_true", help="skip compiling (no GPU): only show the plans")
    c.add_argument("--device", type=int, default=None, help="CUDA device index (default: the current one)")

    sub.add_parser("bench", help="the benchmark suite vs torch.matmul (see: python -m fastmm bench --help)",
                   add_help=False)

    k = sub.add_parser("cache", help="list, verify, clear or fill the on-disk kernel cache",
                       description="The kernel cache folder is $FASTMM_CACHE_DIR, else $XDG_CACHE_HOME/fastmm, else "
                       "~/.cache/fastmm.")
    k.add_argument("action", choices=("list", "verify", "clear", "precompile"),
                   help="list: entries and sizes; verify: check every entry's header, length and hash; clear: delete "
                   "all entries; precompile: compile the common kernels for the current GPU or for --arch")
    k.add_argument("--arch", action="append", metavar="ARCH",
                   help="precompile for this arch (sm_75, sm_80, sm_86, sm_89, sm_90; repeatable) instead of the "
                   "current GPU")
    k.add_argument("--all", action="store_true", help="precompile for every supported arch")
    k.add_argument("--delete-bad", action="store_true", help="verify: delete entries that fail")

    e = sub.add_parser("explain", help="show the plan for an M x N x K product",
                       description="Print what fastmm would run for A (M x K) @ B (K x N): on a GPU through "
                       "fastmm.explain on real tensors of the current device; without one (or with --simulate) the "
                       "dispatcher's plan for a simulated device.")
    e.add_argument("M", type=int)
    e.add_argument("N", type=int)
    e.add_argument("K", type=int)
    e.add_argument("--precision", choices=("ieee", "tf32", "tf32x3"), default=None,
                   help="default: what PyTorch's float32 matmul setting says")
    e.add_argument("--a-transposed", action="store_true", help="A is a transposed view (column-major)")
    e.add_argument("--b-transposed", action="store_true", help="B is a transposed view (column-major)")
    e.add_argument("--batch", type=int, default=0, help="a leading batch dimension of this size")
    e.add_argument("--simulate", metavar="ARCH", default=None,
                   help="plan for a simulated device of this arch (sm_75 ... sm_90) even where a GPU is present")

    t = sub.add_parser("tune", help="time every candidate kernel for an M x N x K product and store the fastest",
                       description="fastmm.tune on the current GPU: check every (kernel family, tile, split-K) "
                       "candidate against float64, time the correct ones with CUDA events (L2 flushed before each "
                       "call, median of --repeats), print the table, and store the fastest for the shape bucket "
                       "(under the cache folder, tuning/), where later calls find it.")
    for name in ("M", "N", "K"):
        t.add_argument(name, type=int)
    t.add_argument("--precision", choices=("ieee", "tf32", "tf32x3"), default=None,
                   help="default: what PyTorch's float32 matmul setting says")
    t.add_argument("--a-transposed", action="store_true", help="A is a transposed view (column-major)")
    t.add_argument("--b-transposed", action="store_true", help="B is a transposed view (column-major)")
    t.add_argument("--batch", type=int, default=0, help="a leading batch dimension of this size")
    t.add_argument("--repeats", type=int, default=20, help="timed calls per candidate (median; default 20)")
    t.add_argument("--no-save", action="store_true", help="print the table only; store nothing")
    t.add_argument("--device", type=int, default=None, help="CUDA device index (default: the current one)")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # its own parser, its own --help
        from . import benchmark

        return benchmark.main(argv[1:], prog="python -m fastmm bench")
    args = build_parser().parse_args(argv)
    if args.command in (None, "check"):
        if args.command is None:
            args = build_parser().parse_args(["check"])
        return cmd_check(args)
    if args.command == "cache":
        if args.all:
            args.arch = list(SUPPORTED_ARCHS)
        return cmd_cache(args)
    if args.command == "explain":
        return cmd_explain(args)
    if args.command == "tune":
        return cmd_tune(args)
    raise AssertionError(args.command)
