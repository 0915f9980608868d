"""The on-disk kernel cache (fastmm.runtime.cache): hits and misses, corrupt entries, unusable
folders, the environment override, key contents, and many processes compiling one key at once.
A fake compile function (counting its calls) stands in for NVRTC except in the end-to-end tests.
"""
from __future__ import annotations

import errno
import hashlib
import multiprocessing
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest

import fastmm.runtime.cache as cache_module
from fastmm import config
from fastmm.explain import cache_state
from fastmm.plan import select
from fastmm.problem import DeviceFacts, Problem
from fastmm.runtime import launcher, sources
from fastmm.runtime.cache import CacheWarning, DiskCache, decode, default_cache, encode, kernel_key, parse_header
from fastmm.runtime.compiler import compile_cubin, nvrtc_version

ARCH = "sm_90"
NAME = "fake-sm_90"
KEY = hashlib.sha256(b"a kernel key").hexdigest()
PAYLOAD = b"\x7fELF" + bytes(range(256)) * 8  # a stand-in cubin, with newlines and zeros inside


class FakeCompiler:
    """compile_fn for get_or_compile: returns ``payload`` and counts its calls."""

    def __init__(self, payload: bytes = PAYLOAD):
        self.payload = payload
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.payload


def cache_warnings(record) -> list:
    return [w for w in record if issubclass(w.category, CacheWarning)]


def leftovers(folder: Path) -> list[str]:
    """Files a finished write must not leave behind (temporary names)."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".probe-"))


# --- miss, hit, file format ---------------------------------------------------------------------

def test_miss_compiles_and_stores_then_hit_loads_from_disk(tmp_path):
    fake = FakeCompiler()
    first = DiskCache(tmp_path).get_or_compile(NAME, KEY, ARCH, fake)
    assert (first.state, first.cubin, fake.calls) == ("compiled", PAYLOAD, 1)
    assert first.path == tmp_path / f"{NAME}-{KEY[:32]}.cubin" and first.path.is_file()
    assert decode(first.path.read_bytes(), ARCH) == PAYLOAD
    again = DiskCache(tmp_path).get_or_compile(NAME, KEY, ARCH, fake)  # a new process, in effect
    assert (again.state, again.cubin, again.path, fake.calls) == ("disk", PAYLOAD, first.path, 1)
    assert leftovers(tmp_path) == []


def test_same_cache_object_hits_on_the_second_call(tmp_path):
    cache, fake = DiskCache(tmp_path), FakeCompiler()
    assert cache.get_or_compile(NAME, KEY, ARCH, fake).state == "compiled"
    assert cache.get_or_compile(NAME, KEY, ARCH, fake).state == "disk"
    assert fake.calls == 1 and cache.compiles == 1


def test_missing_folder_is_created(tmp_path):
    folder = tmp_path / "x" / "y" / "z"
    res = DiskCache(folder).get_or_compile(NAME, KEY, ARCH, FakeCompiler())
    assert res.state == "compiled" and res.path.parent == folder and res.path.is_file()


def test_entry_round_trips_through_encode_and_decode():
    blob = encode(ARCH, PAYLOAD, KEY)
    assert blob.startswith(b"FASTMM-CUBIN 2 sm_90 " + KEY.encode() + b" ")
    assert decode(blob, ARCH) == PAYLOAD and decode(blob, ARCH, KEY) == PAYLOAD
    assert decode(blob, ARCH, "0" * 64) is None  # another kernel's entry
    assert decode(encode(ARCH, b""), ARCH) == b""


def test_header_is_magic_arch_key_digest_length():
    blob = encode(ARCH, PAYLOAD, KEY)
    head, sep, payload = blob.partition(b"\n")
    assert sep == b"\n" and payload == PAYLOAD
    assert head.split(b" ") == [b"FASTMM-CUBIN", b"2", ARCH.encode(), KEY.encode(),
                                hashlib.sha256(PAYLOAD).hexdigest().encode(), str(len(PAYLOAD)).encode()]
    assert parse_header(blob) == (ARCH, KEY)
    assert parse_header(encode(ARCH, PAYLOAD)) == (ARCH, "-")  # written without a key
    assert parse_header(CORRUPTIONS["older_format"](blob)) is None  # format 1: no key field
    assert parse_header(CORRUPTIONS["other_magic"](blob)) is None
    assert parse_header(b"") is None and parse_header(PAYLOAD) is None


# --- corrupt entries are recompiled and replaced ----------------------------------------------

def _flip_last_byte(blob: bytes) -> bytes:
    return blob[:-1] + bytes([blob[-1] ^ 0xFF])


CORRUPTIONS = {
    "truncated": lambda blob: blob[: len(blob) // 2],
    "truncated_by_one": lambda blob: blob[:-1],
    "empty": lambda blob: b"",
    "garbage": lambda blob: b"\x00\xffnot a cubin at all\n" * 50,
    "header_only": lambda blob: blob.partition(b"\n")[0] + b"\n",
    "no_newline": lambda blob: blob.partition(b"\n")[0],
    "wrong_arch_header": lambda blob: encode("sm_80", PAYLOAD),
    "flipped_payload_byte": _flip_last_byte,
    "extra_bytes": lambda blob: blob + b"\x00",
    "bad_length_field": lambda blob: blob.replace(b" %d\n" % len(PAYLOAD), b" x%d\n" % len(PAYLOAD), 1),
    "other_magic": lambda blob: blob.replace(b"FASTMM-CUBIN 2", b"FASTMM-CUBIN 0", 1),
    "older_format": lambda blob: b"FASTMM-CUBIN 1 %s %s %d\n" % (ARCH.encode(), blob.split(b" ")[4], len(PAYLOAD)) + PAYLOAD,
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_entry_is_recompiled_and_replaced(tmp_path, kind):
    fake = FakeCompiler()
    path = DiskCache(tmp_path).get_or_compile(NAME, KEY, ARCH, fake).path
    bad = CORRUPTIONS[kind](path.read_bytes())
    assert decode(bad, ARCH) is None  # the corruption is one decode must reject
    path.write_bytes(bad)
    res = DiskCache(tmp_path).get_or_compile(NAME, KEY, ARCH, fake)
    assert (res.state, res.cubin, fake.calls) == ("compiled", PAYLOAD, 2)
    assert decode(path.read_bytes(), ARCH) == PAYLOAD  # replaced by a good entry
    assert DiskCache(tmp_path).get_or_compile(NAME, KEY, ARCH, fake).state == "disk"
    assert fake.calls == 2 and leftovers(tmp_path) == []


def test_entry_copied_to_another_keys_name_is_not_loaded(tmp_path):
    """A valid cubin under the wrong name (renamed, copied) must not pass for the other kernel."""
    fake_a, fake_b = FakeCompiler(b"kernel A"), FakeCompiler(b"kernel B")
    cache = DiskCache(tmp_path)
    path_a = cache.get_or_compile(NAME, "a" * 64, ARCH, fake_a).path
    path_b = cache.path_for(NAME, "b" * 64)
    path_b.write_bytes(path_a.read_bytes())
    res = DiskCache(tmp_path).get_or_compile(NAME, "b" * 64, ARCH, fake_b)
    assert (res.state, res.cubin, fake_b.calls) == ("compiled", b"kernel B", 1)
    assert decode(path_b.read_bytes(), ARCH, "b" * 64) == b"kernel B"


def test_entry_for_another_arch_is_not_loaded(tmp_path):
    fake80, fake90 = FakeCompiler(b"cubin for sm_80"), FakeCompiler(b"cubin for sm_90")
    path = DiskCache(tmp_path).path_for(NAME, KEY)
    path.write_bytes(encode("sm_80", fake80.payload))  # same file name, header for another arch
    res = DiskCache(tmp_path).get_or_compile(NAME, KEY, "sm_90", fake90)
    assert (res.state, res.cubin, fake90.calls) == ("compiled", b"cubin for sm_90", 1)


def test_verify_flags_bad_entries_and_clear_removes_everything(tmp_path):
    cache = DiskCache(tmp_path)
    good = cache.get_or_compile(NAME, KEY, ARCH, FakeCompiler()).path
    other = cache.get_or_compile(NAME, "f" * 64, ARCH, FakeCompiler()).path
    other.write_bytes(_flip_last_byte(other.read_bytes()))
    assert dict(cache.verify()) == {good: True, other: False}
    renamed = cache.path_for(NAME, "d" * 64)  # an intact entry under another key's file name
    renamed.write_bytes(good.read_bytes())
    assert dict(cache.verify()) == {good: True, other: False, renamed: False}
    renamed.unlink()
    assert cache.clear() == 2
    assert cache.entries() == [] and list(tmp_path.glob("*.lock")) == []
    assert DiskCache(tmp_path / "never-made").entries() == []


# --- unusable folders degrade to memory with one warning --------------------------------------

def _assert_memory_only(cache: DiskCache) -> None:
    fake = FakeCompiler()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        results = [cache.get_or_compile(NAME, key, ARCH, fake) for key in (KEY, "e" * 64, KEY)]
    assert [(r.state, r.cubin, r.path) for r in results] == [("compiled", PAYLOAD, None)] * 3
    assert fake.calls == 3  # nothing was stored
    found = cache_warnings(record)
    assert len(found) == 1, [str(w.message) for w in found]
    text = str(found[0].message)
    assert str(cache.folder) in text and config.CACHE_DIR_ENV in text and "memory" in text


def test_read_only_folder_degrades_to_memory_with_one_warning(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as root: chmod 0o500 does not stop writes")
        _assert_memory_only(DiskCache(folder))
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o700)


def _refuse(*args, **kwargs):
    raise PermissionError(errno.EACCES, "Permission denied")


class _NoCreation:
    """``os`` as the cache sees it in a folder that refuses new files (simulated, so it also runs
    as root): opening with O_CREAT (a temporary file, an entry's lock) raises EACCES."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            _refuse()
        return os.open(path, flags, *args, **kwargs)


def test_folder_refusing_new_files_degrades_to_memory_with_one_warning(tmp_path, monkeypatch):
    """What a read-only folder does to the probe, simulated so it also runs as root."""

    monkeypatch.setattr(cache_module.tempfile, "NamedTemporaryFile", _refuse)
    monkeypatch.setattr(cache_module.tempfile, "mkstemp", _refuse)
    monkeypatch.setattr(cache_module, "os", _NoCreation())
    _assert_memory_only(DiskCache(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_cannot_be_written_still_serves_what_it_holds(tmp_path, monkeypatch):
    """A read-only folder (an admin's precompiled cache; simulated so it also runs as root): its
    entries load; a kernel it lacks is compiled and kept in memory, with one warning."""
    held = DiskCache(tmp_path).get_or_compile(NAME, KEY, ARCH, FakeCompiler(b"precompiled")).path
    before = sorted(p.name for p in tmp_path.iterdir())

    monkeypatch.setattr(cache_module, "os", _NoCreation())
    monkeypatch.setattr(cache_module.tempfile, "mkstemp", _refuse)
    cache, fake = DiskCache(tmp_path), FakeCompiler()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        hit = cache.get_or_compile(NAME, KEY, ARCH, fake)
        misses = [cache.get_or_compile(NAME, key, ARCH, fake) for key in ("e" * 64, "f" * 64)]
        again = cache.get_or_compile(NAME, KEY, ARCH, fake)
    assert (hit.state, hit.cubin, hit.path) == ("disk", b"precompiled", held) and again.state == "disk"
    assert [(r.state, r.cubin, r.path) for r in misses] == [("compiled", PAYLOAD, None)] * 2 and fake.calls == 2
    assert len(cache_warnings(record)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_folder_under_a_regular_file_degrades_to_memory_with_one_warning(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    _assert_memory_only(DiskCache(blocker / "cache"))


def test_failing_write_degrades_to_memory_with_one_warning(tmp_path, monkeypatch):
    """A full disk (simulated): the folder looked fine, but storing an entry fails."""

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_module.os, "fsync", no_space)
    cache = DiskCache(tmp_path)
    _assert_memory_only(cache)
    assert not cache.usable()
    assert cache.entries() == [] and leftovers(tmp_path) == []


# --- where the cache lives ----------------------------------------------------------------------

def test_env_override_is_honoured_by_default_cache(tmp_cache, tmp_path, monkeypatch):
    cache = default_cache()
    assert cache.folder == tmp_cache
    res = cache.get_or_compile(NAME, KEY, ARCH, FakeCompiler())
    assert res.path.parent == tmp_cache and res.path.is_file()
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv(config.CACHE_DIR_ENV, str(elsewhere))
    assert default_cache().folder == elsewhere  # re-read at run time
    assert default_cache() is default_cache()


def test_default_folder_follows_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.delenv(config.CACHE_DIR_ENV, raising=False)
    monkeypatch.setattr(cache_module, "_default", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert config.cache_dir() == tmp_path / "xdg" / "fastmm"
    assert default_cache().folder == tmp_path / "xdg" / "fastmm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert config.cache_dir() == tmp_path / "home" / ".cache" / "fastmm"


# --- the key -----------------------------------------------------------------------------------

def test_key_changes_with_every_input():
    digest, macros, nvrtc = "ab" * 32, (("WARPS_M", 2), ("BK", 8)), (13, 0)
    base = kernel_key(digest, macros, ARCH, nvrtc)
    assert kernel_key(digest, macros, ARCH, nvrtc) == base
    assert kernel_key(digest, tuple(reversed(macros)), ARCH, nvrtc) == base  # order carries no meaning
    variants = [
        kernel_key("cd" * 32, macros, ARCH, nvrtc),
        kernel_key(digest, (("WARPS_M", 1), ("BK", 8)), ARCH, nvrtc),
        kernel_key(digest, macros + (("STAGES", 3),), ARCH, nvrtc),
        kernel_key(digest, (), ARCH, nvrtc),
        kernel_key(digest, macros, "sm_80", nvrtc),
        kernel_key(digest, macros, ARCH, (13, 5)),
        kernel_key(digest, macros, ARCH, (12, 0)),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_key_changes_with_the_fastmm_version(monkeypatch):
    args = ("ab" * 32, (("BK", 8),), ARCH, (13, 0))
    before = kernel_key(*args)
    monkeypatch.setattr(cache_module, "__version__", "999.0.0")
    assert kernel_key(*args) != before


@pytest.fixture
def scratch_sources(tmp_path, monkeypatch):
    """A copy of cuda_src/ the source functions read instead of the real one."""
    copy = tmp_path / "cuda_src"
    shutil.copytree(sources.source_dir(), copy)
    monkeypatch.setattr(sources, "source_dir", lambda: copy)
    sources.read_source.cache_clear()
    sources.source_digest.cache_clear()
    yield copy
    sources.read_source.cache_clear()
    sources.source_digest.cache_clear()


def test_source_digest_changes_with_the_kernel_file_and_with_any_header(scratch_sources):
    def digest():
        sources.read_source.cache_clear()
        sources.source_digest.cache_clear()
        return sources.source_digest("scalar.cu")

    seen = [digest()]
    assert digest() == seen[0]
    for name in ("scalar.cu", "ptx.cuh", "common.cuh"):
        path = scratch_sources / name
        path.write_text(path.read_text() + "\n// edited\n")
        seen.append(digest())
    assert len(set(seen)) == len(seen)


def test_launcher_key_is_the_cache_key_of_source_macros_arch_and_nvrtc():
    cfg = select(Problem.dense(1024, 1024, 1024, precision="tf32"), DeviceFacts.simulated_device(ARCH)).kernel
    key = launcher.key_for(cfg, ARCH)
    # the kernel's own target: sm_90a for wgmma on an sm_90 device
    assert key == kernel_key(sources.source_digest(cfg.source), cfg.macros, cfg.target(ARCH), nvrtc_version())
    assert launcher.key_for(cfg, "sm_80") != key
    other = select(Problem.dense(1024, 1024, 1024, precision="tf32x3"), DeviceFacts.simulated_device(ARCH)).kernel
    assert launcher.key_for(other, ARCH) != key


# --- threads and processes ----------------------------------------------------------------------

def test_threads_asking_for_one_key_compile_it_once(tmp_path):
    cache, calls, results = DiskCache(tmp_path), [], []
    start = threading.Barrier(8)

    def slow_compile():
        calls.append(1)
        time.sleep(0.3)
        return PAYLOAD

    def worker():
        start.wait()
        results.append(cache.get_or_compile(NAME, KEY, ARCH, slow_compile))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(calls) == 1
    assert sorted(r.state for r in results) == ["compiled"] + ["disk"] * 7
    assert all(r.cubin == PAYLOAD for r in results)


def _compile_in_child(folder: str, log: str, start, results) -> None:
    """One of many processes asking for the same missing key at the same moment."""

    def slow_compile() -> bytes:
        with open(log, "a") as fh:  # O_APPEND: lines from several processes do not mix
            fh.write(f"{os.getpid()}\n")
        time.sleep(0.5)
        return PAYLOAD

    cache = DiskCache(Path(folder))
    start.wait(60)
    res = cache.get_or_compile(NAME, KEY, ARCH, slow_compile)
    results.put((os.getpid(), res.state, hashlib.sha256(res.cubin).hexdigest(), len(res.cubin)))


def test_sixteen_processes_compile_one_key_once(tmp_path):
    n = 16
    folder, log = tmp_path / "cache", tmp_path / "compiles.log"
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(n), ctx.Queue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a multi-threaded process (3.12+)
        procs = [ctx.Process(target=_compile_in_child, args=(str(folder), str(log), start, results)) for _ in range(n)]
        for p in procs:
            p.start()
    got = [results.get(timeout=120) for _ in range(n)]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert {(h, size) for _, _, h, size in got} == {(hashlib.sha256(PAYLOAD).hexdigest(), len(PAYLOAD))}
    assert sorted(state for _, state, _, _ in got) == ["compiled"] + ["disk"] * (n - 1)
    assert len(log.read_text().splitlines()) == 1  # compiled exactly once
    entries = sorted(folder.glob("*.cubin"))
    assert len(entries) == 1 and decode(entries[0].read_bytes(), ARCH) == PAYLOAD
    assert leftovers(folder) == []


# --- end to end with NVRTC ------------------------------------------------------------------------

def test_real_kernel_compiles_once_then_loads_from_disk(tmp_path):
    dev = DeviceFacts.simulated_device(ARCH)
    cfg = select(Problem.dense(1024, 1024, 1024, precision="tf32"), dev).kernel
    target = cfg.target(ARCH)  # sm_90a: the wgmma family
    key, name = launcher.key_for(cfg, ARCH), f"{cfg.family}-{target}"
    calls = []

    def nvrtc():
        calls.append(1)
        return compile_cubin(cfg.source, cfg.macros, target)

    first = DiskCache(tmp_path).get_or_compile(name, key, target, nvrtc)
    assert first.state == "compiled" and first.cubin[:4] == b"\x7fELF"
    second = DiskCache(tmp_path).get_or_compile(name, key, target, nvrtc)
    assert (second.state, second.cubin, second.path) == ("disk", first.cubin, first.path)
    assert len(calls) == 1


@pytest.mark.parametrize("arch", ["sm_75", "sm_90"])
def test_real_skinny_kernel_entry_names_its_arch_and_key(tmp_path, arch):
    dev = DeviceFacts.simulated_device(arch)
    plan = select(Problem.dense(16, 4096, 4096), dev)
    cfg = plan.kernel
    assert cfg.family == "skinny"
    key = launcher.key_for(cfg, arch)
    res = DiskCache(tmp_path).get_or_compile(f"{cfg.family}-{arch}", key, arch,
                                             lambda: compile_cubin(cfg.source, cfg.macros, arch))
    blob = res.path.read_bytes()
    assert blob.startswith(b"FASTMM-CUBIN 2 %s %s " % (arch.encode(), key.encode()))
    assert parse_header(blob) == (arch, key) and decode(blob, arch, key) == res.cubin
    assert res.path.name == f"skinny-{arch}-{key[:32]}.cubin"
    assert dict(DiskCache(tmp_path).verify()) == {res.path: True}
    # the split-K reduce of this plan is its own kernel with its own key (on sm_90 the skinny
    # kernel sums its own slices: no second kernel)
    if cfg.split_fused:
        assert plan.reduce is None and arch == "sm_90"
    else:
        assert plan.reduce is not None and launcher.key_for(plan.reduce, arch) != key


def test_explain_cache_state_follows_the_disk_cache(tmp_cache):
    plan = select(Problem.dense(512, 512, 512), DeviceFacts.simulated_device(ARCH))
    cfg = plan.kernel
    key = launcher.key_for(cfg, ARCH)
    path = default_cache().path_for(f"{cfg.family}-{ARCH}", key)
    assert cache_state(plan) == f"not compiled yet: the first call compiles it into {path}"
    default_cache().get_or_compile(f"{cfg.family}-{ARCH}", key, ARCH, lambda: compile_cubin(cfg.source, cfg.macros, ARCH))
    assert path.parent == tmp_cache
    assert cache_state(plan) == f"on disk, not loaded yet: {path}"
    path.write_bytes(b"")  # a corrupt file does not count as cached
    assert cache_state(plan).startswith("not compiled yet")
