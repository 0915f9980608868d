"""Who may have written what the caches load (fastmm/runtime/cache.py, fastmm/runtime/tuning_store.py).

A cubin from the kernel cache runs in this process and a tuning file picks the kernel, so neither
is loaded from a folder or file that someone other than this user (or root) could have written:
group- or other-writable folders (sticky or not), foreign owners, symlinks judged by their
targets. A root-owned read-only folder (an admin's precompiled cache) is the exception, and
FASTMM_CACHE_TRUST_SHARED=1 the opt-out. Every case asserts what was loaded: whether the compile
function ran and which bytes came back (a planted entry holds other bytes than the compiler
returns). The chown cases and the ones run as another user (a forked child that drops to uid
65534) need root and are skipped elsewhere.
"""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path

import pytest

import fastmm
import fastmm.runtime.cache as cache_module
from fastmm import config
from fastmm.runtime import tuning_store
from fastmm.runtime.cache import CacheWarning, DiskCache, decode, encode
from fastmm.runtime.tuning_store import DeviceKey, TuningStore, TuningWarning

pytestmark = pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX owners and modes")

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="chown and setuid need root")
OTHER_UID = 12345  # a user that is neither this one nor root
NOBODY = 65534  # the user the forked children become

ARCH = "sm_90"
NAME = "fake-sm_90"
KEY = hashlib.sha256(b"a kernel key").hexdigest()
COMPILED = b"\x7fELF compiled by this process"
PLANTED = b"\x7fELF planted in the cache folder"
TKEY = DeviceKey("NVIDIA Test GPU", (9, 0), 13000, (13, 0), fastmm.__version__)


@pytest.fixture(autouse=True)
def _no_shared_trust(monkeypatch):
    monkeypatch.delenv(config.CACHE_TRUST_SHARED_ENV, raising=False)


class FakeCompiler:
    def __init__(self, payload: bytes = COMPILED):
        self.payload = payload
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.payload


def plant(folder: Path, payload: bytes = PLANTED, key: str = KEY, mode: int = 0o600) -> Path:
    """A valid entry for ``key`` holding ``payload`` (not what the compiler returns)."""
    path = DiskCache(folder).path_for(NAME, key)
    path.write_bytes(encode(ARCH, payload, key))
    path.chmod(mode)
    return path


def fetch(cache_or_folder, key: str = KEY):
    """get_or_compile of ``key``: (result, compile calls, cache warnings)."""
    cache = cache_or_folder if isinstance(cache_or_folder, DiskCache) else DiskCache(cache_or_folder)
    fake = FakeCompiler()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        res = cache.get_or_compile(NAME, key, ARCH, fake)
    return res, fake.calls, [w for w in record if issubclass(w.category, CacheWarning)]


def assert_loaded(res, calls) -> None:
    assert (res.state, res.cubin, calls) == ("disk", PLANTED, 0)


def assert_refused(res, calls) -> None:
    assert (res.state, res.cubin, calls) == ("compiled", COMPILED, 1)


def private_folder(tmp_path: Path, name: str = "cache") -> Path:
    folder = tmp_path / name
    folder.mkdir(mode=0o700)
    folder.chmod(0o700)
    return folder


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# --- the folder ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [0o700, 0o755, 0o750, 0o500])
def test_a_folder_only_its_owner_can_write_is_loaded_from(tmp_path, mode):
    folder = private_folder(tmp_path)
    plant(folder)
    folder.chmod(mode)
    try:
        res, calls, warned = fetch(folder)
    finally:
        folder.chmod(0o700)
    assert_loaded(res, calls)
    assert warned == []


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o2775, 0o703])
def test_a_folder_writable_by_group_or_others_is_not_loaded_from(tmp_path, mode):
    folder = private_folder(tmp_path)
    entry = plant(folder)
    folder.chmod(mode)
    cache = DiskCache(folder)
    res, calls, warned = fetch(cache)
    assert_refused(res, calls)
    assert res.path is None  # memory only
    assert len(warned) == 1 and str(folder) in str(warned[0].message)
    # nothing is written into it either, and later calls stay in memory without another warning
    assert decode(entry.read_bytes(), ARCH, KEY) == PLANTED
    assert sorted(p.name for p in folder.iterdir()) == [entry.name]
    again, calls, warned = fetch(cache)
    assert_refused(again, calls)
    assert warned == [] and not cache.usable()
    assert cache.read(entry, ARCH, KEY) is None  # (what explain asks)


@needs_root
def test_a_folder_owned_by_another_user_is_not_loaded_from(tmp_path):
    folder = private_folder(tmp_path)
    plant(folder)
    os.chown(folder, OTHER_UID, OTHER_UID)
    res, calls, warned = fetch(folder)
    assert_refused(res, calls)
    assert res.path is None and len(warned) == 1


def test_a_folder_that_is_a_symlink_is_judged_by_its_target(tmp_path):
    target = private_folder(tmp_path, "real")
    plant(target)
    link = tmp_path / "cache"
    link.symlink_to(target)
    res, calls, _ = fetch(link)
    assert_loaded(res, calls)  # e.g. ~/.cache pointing at a scratch disk of one's own
    target.chmod(0o777)
    res, calls, warned = fetch(link)
    assert_refused(res, calls)
    assert res.path is None and len(warned) == 1


@needs_root
def test_a_folder_replaced_by_a_symlink_to_a_foreign_folder_is_refused_at_the_next_lookup(tmp_path):
    folder = private_folder(tmp_path)
    cache = DiskCache(folder)
    first, calls, _ = fetch(cache, "a" * 64)
    assert first.state == "compiled" and first.path is not None and calls == 1
    assert fetch(cache, "a" * 64)[0].state == "disk"
    # someone swaps the folder for a symlink to theirs, holding an entry for the next key
    theirs = private_folder(tmp_path, "theirs")
    plant(theirs, key="b" * 64)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    folder.rename(tmp_path / "moved")
    folder.symlink_to(theirs)
    res, calls, warned = fetch(cache, "b" * 64)
    assert_refused(res, calls)
    assert res.path is None and len(warned) == 1
    assert decode((theirs / DiskCache(theirs).path_for(NAME, "b" * 64).name).read_bytes(), ARCH, "b" * 64) == PLANTED


def test_a_folder_made_by_fastmm_is_0o700_with_its_parents_and_entries_and_locks_are_0o600(tmp_path, monkeypatch):
    old = os.umask(0)  # the modes must not depend on a permissive umask
    try:
        folder = tmp_path / "a" / "b" / "cache"
        seen = {}
        real_replace = os.replace

        class Os:  # os as the cache sees it: the temporary file's mode is noted before the rename
            def __getattr__(self, name):
                return getattr(os, name)

            @staticmethod
            def replace(src, dst, *args, **kwargs):
                seen[Path(dst).name] = mode_of(Path(src))
                return real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(cache_module, "os", Os())
        res, calls, warned = fetch(folder)
    finally:
        os.umask(old)
    assert res.state == "compiled" and res.path is not None and calls == 1 and warned == []
    assert [mode_of(p) for p in (tmp_path / "a", tmp_path / "a" / "b", folder)] == [0o700] * 3
    assert mode_of(res.path) == 0o600 and seen == {res.path.name: 0o600}
    locks = list(folder.glob("*.lock"))
    assert len(locks) == 1 and mode_of(locks[0]) == 0o600
    assert fetch(folder)[0].state == "disk"


# --- entries ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [0o600, 0o644, 0o400, 0o444])
def test_an_entry_only_its_owner_can_write_is_loaded(tmp_path, mode):
    folder = private_folder(tmp_path)
    plant(folder, mode=mode)
    res, calls, warned = fetch(folder)
    assert_loaded(res, calls)
    assert warned == []


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602, 0o660])
def test_an_entry_writable_by_group_or_others_is_recompiled_and_replaced(tmp_path, mode):
    folder = private_folder(tmp_path)
    entry = plant(folder, mode=mode)
    cache = DiskCache(folder)
    res, calls, warned = fetch(cache)
    assert_refused(res, calls)
    assert len(warned) == 1 and str(entry) in str(warned[0].message)
    # the folder is ours: the entry is replaced by a fresh, private one, which then loads
    assert res.path == entry and decode(entry.read_bytes(), ARCH, KEY) == COMPILED and mode_of(entry) == 0o600
    again, calls, warned = fetch(cache)
    assert (again.state, again.cubin, calls, warned) == ("disk", COMPILED, 0, [])


@needs_root
def test_an_entry_owned_by_another_user_is_recompiled_and_replaced(tmp_path):
    folder = private_folder(tmp_path)
    entry = plant(folder)
    os.chown(entry, OTHER_UID, OTHER_UID)
    res, calls, warned = fetch(folder)
    assert_refused(res, calls)
    assert len(warned) == 1
    assert os.stat(entry).st_uid == os.geteuid() and decode(entry.read_bytes(), ARCH, KEY) == COMPILED


def test_a_symlinked_entry_to_a_private_file_of_ours_is_loaded(tmp_path):
    folder = private_folder(tmp_path)
    elsewhere = private_folder(tmp_path, "elsewhere")
    target = plant(elsewhere)
    (folder / target.name).symlink_to(target)
    res, calls, warned = fetch(folder)
    assert_loaded(res, calls)
    assert warned == []


@pytest.mark.parametrize("target_kind", ["others_writable", "group_writable", "folder", "fifo", "dangling"])
def test_a_symlinked_entry_to_anything_else_is_not_loaded_and_the_target_is_left_alone(tmp_path, target_kind):
    folder = private_folder(tmp_path)
    elsewhere = private_folder(tmp_path, "elsewhere")
    name = DiskCache(folder).path_for(NAME, KEY).name
    target = elsewhere / "target"
    if target_kind in ("others_writable", "group_writable"):
        target = plant(elsewhere, mode=0o666 if target_kind == "others_writable" else 0o660)
    elif target_kind == "folder":
        target.mkdir()
    elif target_kind == "fifo":
        os.mkfifo(target)  # opening it for reading must not hang
    (folder / name).symlink_to(target)
    before = target.read_bytes() if target.is_file() else None
    res, calls, warned = fetch(folder)
    assert_refused(res, calls)
    assert len(warned) == (0 if target_kind == "dangling" else 1)  # a dangling link is a plain miss
    # the symlink itself was replaced by our entry: nothing was written through it
    assert not (folder / name).is_symlink() and decode((folder / name).read_bytes(), ARCH, KEY) == COMPILED
    if before is not None:
        assert target.read_bytes() == before
    assert target_kind != "dangling" or not target.exists()


@needs_root
def test_a_symlinked_entry_to_a_foreign_file_is_not_loaded(tmp_path):
    folder = private_folder(tmp_path)
    elsewhere = private_folder(tmp_path, "elsewhere")
    target = plant(elsewhere)
    os.chown(target, OTHER_UID, OTHER_UID)
    (folder / target.name).symlink_to(target)
    res, calls, warned = fetch(folder)
    assert_refused(res, calls)
    assert len(warned) == 1 and os.stat(target).st_uid == OTHER_UID  # left alone


def test_a_symlinked_lock_file_is_not_followed(tmp_path):
    folder = private_folder(tmp_path)
    victim = tmp_path / "victim"
    name = DiskCache(folder).path_for(NAME, KEY).name
    (folder / (name + ".lock")).symlink_to(victim)
    res, calls, warned = fetch(folder)
    assert (res.state, res.cubin, calls, warned) == ("compiled", COMPILED, 1, [])  # compiled, without the lock
    assert not victim.exists()  # O_NOFOLLOW: nothing was created through the link
    assert fetch(folder)[0].state == "disk"


def test_verify_reports_entries_that_would_not_be_loaded(tmp_path):
    folder = private_folder(tmp_path)
    good = plant(folder)
    shared = plant(folder, key="c" * 64, mode=0o666)
    assert dict(DiskCache(folder).verify()) == {good: True, shared: False}


# --- the opt-out --------------------------------------------------------------------------------------

def test_trust_shared_loads_from_a_shared_folder_and_writes_entries_others_can_read(tmp_path, monkeypatch):
    folder = private_folder(tmp_path)
    plant(folder, mode=0o666)
    folder.chmod(0o1777)
    if IS_ROOT:
        os.chown(folder, OTHER_UID, OTHER_UID)
    assert_refused(*fetch(folder)[:2])
    monkeypatch.setenv(config.CACHE_TRUST_SHARED_ENV, "1")
    res, calls, warned = fetch(folder)
    assert_loaded(res, calls)
    assert warned == []
    fresh, calls, _ = fetch(folder, "d" * 64)
    assert fresh.state == "compiled" and calls == 1 and mode_of(fresh.path) == 0o644
    lock = fresh.path.with_name(fresh.path.name + ".lock")
    assert mode_of(lock) == 0o644


def test_trust_shared_still_refuses_what_is_not_a_regular_file(tmp_path, monkeypatch):
    monkeypatch.setenv(config.CACHE_TRUST_SHARED_ENV, "1")
    folder = private_folder(tmp_path)
    os.mkfifo(DiskCache(folder).path_for(NAME, KEY))
    res, calls, _ = fetch(folder)
    assert_refused(res, calls)


# --- another user reading a root-owned cache (run as root, the child becomes uid 65534) ---------------

def _as_nobody(jobs, results) -> None:
    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        out = []
        for folder, key in jobs:
            res, calls, warned = fetch(Path(folder), key)
            out.append((res.state, res.cubin, calls, res.path is not None, len(warned)))
        results.put(out)
    except BaseException as exc:  # report instead of hanging the parent
        results.put(repr(exc))


def _run_as_nobody(jobs):
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a multi-threaded process (3.12+)
        proc = ctx.Process(target=_as_nobody, args=([(str(f), k) for f, k in jobs], results))
        proc.start()
    got = results.get(timeout=120)
    proc.join(60)
    assert proc.exitcode == 0 and not isinstance(got, str), got
    return got


@pytest.fixture
def world_reachable_tmp():
    """A folder under /tmp that uid 65534 can reach (pytest's tmp_path is 0o700)."""
    base = Path(tempfile.mkdtemp(prefix="fastmm-trust-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@needs_root
def test_a_root_owned_read_only_folder_serves_other_users(world_reachable_tmp):
    shipped = world_reachable_tmp / "precompiled"
    shipped.mkdir()
    plant(shipped, mode=0o644)  # what an admin ships: root:root 0o755 folder, 0o644 entries
    foreign = plant(shipped, key="e" * 64, mode=0o644)
    os.chown(foreign, OTHER_UID, OTHER_UID)
    shipped.chmod(0o755)
    open_to_all = world_reachable_tmp / "open"
    open_to_all.mkdir()
    plant(open_to_all, mode=0o644)
    open_to_all.chmod(0o777)
    before = sorted(p.name for p in shipped.iterdir())
    hit, miss, not_root, refused = _run_as_nobody([(shipped, KEY), (shipped, "f" * 64), (shipped, "e" * 64),
                                                  (open_to_all, KEY)])
    assert hit == ("disk", PLANTED, 0, True, 0)  # loaded from the admin's cache, no warning
    assert miss == ("compiled", COMPILED, 1, False, 1)  # compiled in memory: one warning (read-only)
    assert not_root[:4] == ("compiled", COMPILED, 1, False)  # an entry of a third user is not loaded
    assert not_root[4] == 2  # (warned: that entry, and the folder that cannot take the fresh one)
    assert refused == ("compiled", COMPILED, 1, False, 1)
    assert sorted(p.name for p in shipped.iterdir()) == before  # nothing written: no lock, no temp file


@needs_root
def test_another_users_own_read_only_folder_serves_them(world_reachable_tmp):
    theirs = world_reachable_tmp / "theirs"
    theirs.mkdir()
    plant(theirs)
    for p in (theirs, *theirs.iterdir()):
        os.chown(p, NOBODY, NOBODY)
    theirs.chmod(0o500)
    (hit,) = _run_as_nobody([(theirs, KEY)])
    assert hit == ("disk", PLANTED, 0, True, 0)


# --- explain ------------------------------------------------------------------------------------------

def test_explain_shows_an_untrusted_folder(tmp_cache):
    from fastmm.explain import cache_state
    from fastmm.plan import select
    from fastmm.problem import DeviceFacts, Problem
    from fastmm.runtime import launcher

    plan = select(Problem.dense(512, 512, 512), DeviceFacts.simulated_device(ARCH))
    cfg = plan.kernel
    key = launcher.key_for(cfg, ARCH)
    cache_module.default_cache().get_or_compile(f"{cfg.family}-{ARCH}", key, ARCH, lambda: b"\x7fELF a stand-in")
    assert cache_state(plan).startswith("on disk")
    assert cache_module.default_cache().memory_only_reason() is None
    tmp_cache.chmod(0o777)
    state = cache_state(plan)
    assert not state.startswith("on disk")  # the entry there would not be loaded
    assert "memory" in state and str(tmp_cache) in state and "compiles it into" not in state
    assert str(tmp_cache) in cache_module.DiskCache(tmp_cache).memory_only_reason()


# --- the tuning store ---------------------------------------------------------------------------------

def _tuning_record(family="simt_float4", option=(1, 2, 8), ms=1.0):
    return {"family": family, "option": list(option), "time_ms": ms}


def _get(store: TuningStore, bucket: str = "b"):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = store.get(bucket)
    return got, [w for w in record if issubclass(w.category, TuningWarning)]


def _stored(tmp_path: Path) -> Path:
    folder = tmp_path / "tuning"
    TuningStore(folder, TKEY).put("b", _tuning_record())
    assert TuningStore(folder, TKEY).get("b") == _tuning_record()
    return folder


def test_the_tuning_folder_is_made_0o700_and_its_file_0o600(tmp_path):
    old = os.umask(0)
    try:
        folder = _stored(tmp_path)
    finally:
        os.umask(old)
    assert mode_of(folder) == 0o700 and mode_of(folder / TKEY.file_name()) == 0o600


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_a_tuning_file_writable_by_others_is_ignored_with_one_warning_and_replaced(tmp_path, mode):
    folder = _stored(tmp_path)
    path = folder / TKEY.file_name()
    path.chmod(mode)
    store = TuningStore(folder, TKEY)
    got, warned = _get(store)
    assert got is None and len(warned) == 1 and str(path) in str(warned[0].message)
    assert _get(store, "other")[1] == []  # once
    assert store.put("c", _tuning_record("scalar", ())) == path
    assert mode_of(path) == 0o600 and TuningStore(folder, TKEY).records() == {"c": _tuning_record("scalar", ())}


@needs_root
def test_a_tuning_file_owned_by_another_user_is_ignored(tmp_path):
    folder = _stored(tmp_path)
    os.chown(folder / TKEY.file_name(), OTHER_UID, OTHER_UID)
    got, warned = _get(TuningStore(folder, TKEY))
    assert got is None and len(warned) == 1


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
def test_a_tuning_folder_writable_by_others_is_neither_read_nor_written(tmp_path, mode):
    folder = _stored(tmp_path)
    path = folder / TKEY.file_name()
    before = path.read_bytes()
    folder.chmod(mode)
    store = TuningStore(folder, TKEY)
    got, warned = _get(store)
    assert got is None and len(warned) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert store.put("c", _tuning_record()) is None
    assert store.get("c") == _tuning_record()  # kept in memory for this process
    assert path.read_bytes() == before and sorted(p.name for p in folder.iterdir() if p.suffix != ".lock") == [path.name]


def test_a_symlinked_tuning_file_is_judged_by_its_target(tmp_path):
    folder = _stored(tmp_path)
    path = folder / TKEY.file_name()
    target = private_folder(tmp_path, "elsewhere") / "tuned.json"
    shutil.move(path, target)
    path.symlink_to(target)
    assert _get(TuningStore(folder, TKEY))[0] == _tuning_record()
    target.chmod(0o666)
    got, warned = _get(TuningStore(folder, TKEY))
    assert got is None and len(warned) == 1


def test_trust_shared_reads_a_shared_tuning_folder(tmp_path, monkeypatch):
    folder = _stored(tmp_path)
    (folder / TKEY.file_name()).chmod(0o666)
    folder.chmod(0o777)
    assert _get(TuningStore(folder, TKEY))[0] is None
    monkeypatch.setenv(config.CACHE_TRUST_SHARED_ENV, "1")
    got, warned = _get(TuningStore(folder, TKEY))
    assert got == _tuning_record() and warned == []


def test_store_for_ignores_an_untrusted_tuning_file(tmp_cache, monkeypatch):
    """Through the lookup the api makes (tuning_store.store_for(index).get(bucket))."""
    monkeypatch.setattr(tuning_store, "_device_key", lambda index: TKEY)
    monkeypatch.setattr(tuning_store, "_stores", {})
    tuning_store.store_for(0).put("b", _tuning_record())
    monkeypatch.setattr(tuning_store, "_stores", {})  # a new process, in effect
    assert tuning_store.store_for(0).get("b") == _tuning_record()
    (config.tuning_dir() / TKEY.file_name()).chmod(0o646)
    monkeypatch.setattr(tuning_store, "_stores", {})
    got, warned = _get(tuning_store.store_for(0))
    assert got is None and len(warned) == 1


def test_trust_shared_is_read_from_the_environment(monkeypatch):
    for value, on in (("1", True), ("yes", True), (" on ", True), ("0", False), ("", False)):
        monkeypatch.setenv(config.CACHE_TRUST_SHARED_ENV, value)
        assert config.cache_trust_shared() is on, value
    monkeypatch.delenv(config.CACHE_TRUST_SHARED_ENV)
    assert config.cache_trust_shared() is False
