"""The package as users get it: a wheel built from the repo carries the kernel sources (the
top-level ``cuda_src/`` becomes ``fastmm/cuda_src/``), and fastmm installed from that wheel, away
from the repo, finds them and compiles from them; the command-line entry points work from the
installed copy; the sdist has everything a wheel needs.

The build backend (hatchling) is used from the environment when it is importable; otherwise it is
installed with pip into a temporary folder (this needs the package index). When it cannot be had
at all (no index, as on an offline GPU machine), these tests are skipped with the reason.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CUDA_SRC = REPO / "cuda_src"
TIMEOUT = 900

# Messages that mean "the backend could not be fetched" (no index, no network), not "the build broke".
_UNREACHABLE = ("Could not find a version that satisfies the requirement", "No matching distribution found",
                "Failed to establish a new connection", "Network is unreachable", "Temporary failure in name resolution",
                "No route to host", "Connection refused", "Read timed out", "ConnectTimeoutError", "ProxyError")


def _pip_env(extra_pythonpath: Path | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    env["PIP_DEFAULT_TIMEOUT"] = "30"  # fail reasonably fast where no index answers
    env["PIP_RETRIES"] = "1"
    env["PYTHONPATH"] = str(extra_pythonpath) if extra_pythonpath else ""
    return env


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, **kw)


def _tail(proc: subprocess.CompletedProcess, n: int = 4000) -> str:
    return (proc.stdout + "\n" + proc.stderr)[-n:]


@pytest.fixture(scope="module")
def backend(tmp_path_factory) -> Path | None:
    """A folder to put on PYTHONPATH so that ``import hatchling`` works (None: it already does)."""
    if _run([sys.executable, "-m", "pip", "--version"]).returncode != 0:
        pytest.skip("pip is not available in this environment")
    if importlib.util.find_spec("hatchling") is not None:
        return None
    target = tmp_path_factory.mktemp("backend")
    proc = _run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target), "hatchling>=1.18"],
                env=_pip_env())
    if proc.returncode != 0:
        text = _tail(proc)
        if any(marker in text for marker in _UNREACHABLE):
            pytest.skip("build backend hatchling is not installed and could not be obtained from the package index: "
                        + text.strip().splitlines()[-1])
        pytest.fail("installing hatchling failed:\n" + text)
    return target


@pytest.fixture(scope="module")
def wheel(backend, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out),
                 str(REPO)], env=_pip_env(backend))
    assert proc.returncode == 0, "pip wheel failed:\n" + _tail(proc)
    wheels = sorted(out.glob("fastmm-*.whl"))
    assert len(wheels) == 1, f"expected one fastmm wheel, got {wheels}\n{_tail(proc)}"
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed with ``pip install --no-deps --target``: a folder to put on PYTHONPATH."""
    target = tmp_path_factory.mktemp("site")
    proc = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                env=_pip_env())
    assert proc.returncode == 0, "pip install --target failed:\n" + _tail(proc)
    assert (target / "fastmm" / "__init__.py").is_file()
    return target


def _run_installed(installed: Path, args, tmp_path: Path, **env_extra) -> subprocess.CompletedProcess:
    """Python with only the installed copy of fastmm importable, from a folder outside the repo."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(installed)
    env["FASTMM_CACHE_DIR"] = str(tmp_path / "kernel-cache")
    env.update(env_extra)
    work = tmp_path / "elsewhere"
    work.mkdir(exist_ok=True)
    return _run([sys.executable, *args], cwd=work, env=env)


def _repo_version() -> str:
    scope: dict = {}
    exec((REPO / "fastmm" / "_version.py").read_text(), scope)
    return scope["__version__"]


# ---------------------------------------------------------------------------------------------

def test_wheel_carries_kernel_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = sorted(p.name for p in CUDA_SRC.glob("*.cu"))
    headers = sorted(p.name for p in CUDA_SRC.glob("*.cuh"))
    assert kernels, "no .cu files in cuda_src/"
    assert "ptx.cuh" in headers
    missing = [n for n in kernels + headers if f"fastmm/cuda_src/{n}" not in names]
    assert not missing, f"kernel sources missing from {wheel.name}: {missing}"
    for module in ("__init__.py", "__main__.py", "cli.py", "benchmark.py", "bench_shapes.json", "runtime/sources.py"):
        assert f"fastmm/{module}" in names, f"fastmm/{module} missing from {wheel.name}"
    assert not [n for n in names if n.startswith(("cuda_src/", "tests/", "benchmarks/"))], "stray top-level folders"
    assert not [n for n in names if n.endswith(".pyc") or "__pycache__" in n]


def test_wheel_metadata(wheel):
    version = _repo_version()
    assert wheel.name.startswith(f"fastmm-{version}-")
    zf = zipfile.ZipFile(wheel)
    meta = zf.read(f"fastmm-{version}.dist-info/METADATA").decode()
    for req in ("torch>=2.4", "cuda-core<2,>=1.2", "cuda-bindings<14,>=13", "nvidia-cuda-nvrtc<14,>=13", "packaging"):
        assert f"Requires-Dist: {req}" in meta, f"{req} not in the wheel's requirements:\n{meta}"
    assert "Requires-Python: >=3.10" in meta
    entry_points = zf.read(f"fastmm-{version}.dist-info/entry_points.txt").decode()
    assert "fastmm = fastmm.cli:main" in entry_points


def test_installed_wheel_finds_and_compiles_its_sources(installed, tmp_path):
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    compile_it = nvrtc_unavailable_reason() is None
    code = (
        "import pathlib, sys\n"
        "import fastmm\n"
        "from fastmm.runtime import sources, compiler\n"
        "target = pathlib.Path(sys.argv[1]).resolve()\n"
        "pkg, src = pathlib.Path(fastmm.__file__).resolve(), sources.source_dir().resolve()\n"
        "assert target in pkg.parents, f'fastmm imported from {pkg}, not from {target}'\n"
        "assert src == target / 'fastmm' / 'cuda_src', f'sources found at {src}'\n"
        "assert (src / 'ptx.cuh').is_file()\n"
        "if sys.argv[2] == '1':\n"
        "    cubin = compiler.compile_cubin('scalar.cu', (), 'sm_90')\n"
        "    assert len(cubin) > 1000, len(cubin)\n"
        "print('source_dir', src)\n"
    )
    proc = _run_installed(installed, ["-c", code, str(installed), "1" if compile_it else "0"], tmp_path)
    assert proc.returncode == 0, _tail(proc)
    assert f"source_dir {installed.resolve() / 'fastmm' / 'cuda_src'}" in proc.stdout
    if not compile_it:
        pytest.skip(f"sources found in the installed wheel; compile not tried: {nvrtc_unavailable_reason()}")


def test_installed_cli_help_and_explain(installed, tmp_path):
    proc = _run_installed(installed, ["-m", "fastmm", "--help"], tmp_path)
    assert proc.returncode == 0, _tail(proc)
    for command in ("check", "bench", "cache", "explain"):
        assert command in proc.stdout
    proc = _run_installed(installed, ["-m", "fastmm", "explain", "4097", "4095", "4093", "--precision", "tf32",
                                      "--simulate", "sm_80"], tmp_path)
    assert proc.returncode == 0, _tail(proc)
    assert "kernel: tf32_mma" in proc.stdout, proc.stdout
    proc = _run_installed(installed, ["-m", "fastmm", "explain", "64", "64", "64", "--precision", "tf32",
                                      "--simulate", "sm_75"], tmp_path)
    assert proc.returncode == 0, _tail(proc)
    assert "kernel: tf32_mma" not in proc.stdout and "rejected tf32_mma: needs sm80+" in proc.stdout, proc.stdout


def test_installed_bench_finds_its_suite(installed, tmp_path):
    """The benchmark runs from the installed copy (suite file shipped in the package); on a CPU
    (--device cpu) it exercises the whole script with fastmm handing calls to torch."""
    out = tmp_path / "bench.json"
    proc = _run_installed(installed, ["-m", "fastmm", "bench", "--device", "cpu", "--scale", "0.02", "--only",
                                      "tiny,batched,a_transposed", "--precisions", "ieee,tf32", "--budget-ms", "20",
                                      "--host-calls", "20", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, _tail(proc)
    assert f"suite {installed.resolve() / 'fastmm' / 'bench_shapes.json'};" in proc.stdout, proc.stdout
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [(r["name"], r["precision"]) for r in rows] == [
        ("batched", "ieee"), ("batched", "tf32"), ("a_transposed", "ieee"), ("a_transposed", "tf32"),
        ("tiny", "ieee"), ("tiny", "tf32")]
    for r in rows:
        assert "error" not in r, r
        assert r["fastmm_ms"] > 0 and r["torch_ms"] > 0 and r["reps"] >= 10
        assert r["err_fastmm"] < 1e-5 and r["err_torch"] < 1e-5
    assert "host_us_fastmm" in rows[-1]


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available(),
                    reason="with a GPU, `python -m fastmm` is the GPU self-check (benchmarks/run_gpu.sh runs it)")
def test_installed_main_job_without_gpu(installed, tmp_path):
    """`python -m fastmm` on a machine with no GPU: compiles every family for every supported
    arch into the cache and shows the plans for simulated sm_80 and sm_90; exit 0."""
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason() is not None:
        pytest.skip(nvrtc_unavailable_reason())
    proc = _run_installed(installed, ["-m", "fastmm"], tmp_path)
    assert proc.returncode == 0, _tail(proc)
    out = proc.stdout
    assert "no GPU" in out
    for arch in ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90"):
        assert f"\n{arch} (" in out, f"no progress line for {arch}:\n{out}"
    assert "FAILED" not in out
    assert "plans on a simulated A100 (sm_80" in out and "plans on a simulated H200 (sm_90" in out
    cache = tmp_path / "kernel-cache"
    entries = list(cache.glob("*.cubin"))
    for family in ("scalar", "simt_float4", "simt_cp_async", "tf32_mma"):
        for arch in ("sm_80", "sm_86", "sm_89", "sm_90"):
            assert any(p.name.startswith(f"{family}-{arch}-") for p in entries), f"no {family} cubin for {arch}"
    for arch in ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90"):  # skinny (and its split-K reduce) run on sm75 too
        for family in ("skinny", "splitk_reduce"):
            assert any(p.name.startswith(f"{family}-{arch}-") for p in entries), f"no {family} cubin for {arch}"
    assert not any(p.name.startswith(("simt_cp_async-sm_75", "tf32_mma-sm_75")) for p in entries)
    # the cache commands see what the main job wrote
    proc = _run_installed(installed, ["-m", "fastmm", "cache", "verify"], tmp_path)
    assert proc.returncode == 0, _tail(proc)
    assert f"{len(entries)} valid, 0 bad" in proc.stdout
    # a second run finds everything in the cache
    proc = _run_installed(installed, ["-m", "fastmm", "check", "--no-compile"], tmp_path)
    assert proc.returncode == 0, _tail(proc)


def test_sdist_has_sources_and_builds_a_complete_wheel(backend, tmp_path):
    """The sdist carries cuda_src/ and the suite file, and a wheel built from the unpacked sdist
    (what `pip install fastmm-x.tar.gz` does) still has the kernel sources inside the package."""
    env = _pip_env(backend)
    build = "import sys, hatchling.build as b; print(getattr(b, sys.argv[1])(sys.argv[2]))"
    dist = tmp_path / "dist"
    proc = _run([sys.executable, "-c", build, "build_sdist", str(dist)], cwd=REPO, env=env)
    assert proc.returncode == 0, _tail(proc)
    sdist = dist / proc.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
        root = names[0].split("/")[0]
        for p in sorted(CUDA_SRC.iterdir()):
            assert f"{root}/cuda_src/{p.name}" in names, f"cuda_src/{p.name} missing from the sdist"
        for rel in ("pyproject.toml", "README.md", "fastmm/__init__.py", "benchmarks/bench_shapes.json"):
            assert f"{root}/{rel}" in names, f"{rel} missing from the sdist"
        assert not [n for n in names if "/.ci-venv/" in n or n.endswith(".whl")]
        try:
            tf.extractall(tmp_path / "unpacked", filter="data")
        except TypeError:  # Python without extraction filters
            tf.extractall(tmp_path / "unpacked")
    proc = _run([sys.executable, "-c", build, "build_wheel", str(tmp_path / "w")], cwd=tmp_path / "unpacked" / root,
                env=env)
    assert proc.returncode == 0, _tail(proc)
    names = set(zipfile.ZipFile(tmp_path / "w" / proc.stdout.strip().splitlines()[-1]).namelist())
    assert "fastmm/cuda_src/ptx.cuh" in names
    assert all(f"fastmm/cuda_src/{p.name}" in names for p in CUDA_SRC.glob("*.cu"))


def test_readme_setup_is_what_ci_runs():
    """README's Set-up is two commands (main job, tests), each with its install step, and .ci/run
    runs the test command verbatim."""
    readme = (REPO / "README.md").read_text()
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("\n", 1)[1].strip() for b in setup.split("```")[1::2]]
    assert len(blocks) == 2 and all("\n" not in b for b in blocks), blocks
    main_job, tests = blocks
    assert main_job.startswith("pip install ") and main_job.endswith("python -m fastmm"), main_job
    assert tests.startswith("pip install ") and "[test]" in tests and tests.endswith("pytest"), tests
    ci = (REPO / ".ci" / "run").read_text()
    assert f"\n{tests}\n" in ci, f".ci/run does not run the README's test command {tests!r}"
    assert os.access(REPO / ".ci" / "run", os.X_OK)
