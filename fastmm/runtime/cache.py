"""On-disk cache of compiled kernels: one file per kernel key.

File format: a header line ``FASTMM-CUBIN 2 <arch> <kernel key> <sha256 of payload> <payload
length>\\n`` followed by the cubin. A file is trusted only if the header parses, the arch and key
are the ones asked for, and length and hash match: truncated, empty, garbage, wrong-arch or
renamed files are recompiled and replaced, never loaded (loading a bad cubin can take the process
down).

Writes go to a private temporary name in the same folder and are then renamed over the target
with ``os.replace``: rename is atomic on POSIX, so a reader sees either the old file or the whole
new one, even with many processes writing the same key at once. A per-key ``flock`` makes the
other processes wait for the first compile instead of repeating it. A folder that cannot be
created or written turns the cache into a memory-only one, with a single warning.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import config
from .._version import __version__

MAGIC = b"FASTMM-CUBIN 2"


class CacheWarning(UserWarning):
    """The disk cache could not be used; kernels are kept in memory only."""


@dataclass(frozen=True)
class CacheResult:
    cubin: bytes
    state: str  # "compiled" (now, by this process), "disk" (loaded from the cache file)
    path: Path | None  # the cache file, or None when the disk cache is unusable


def kernel_key(source_digest: str, macros: tuple[tuple[str, int], ...], arch: str,
               nvrtc: tuple[int, int]) -> str:
    """Hash of everything that changes the cubin: source text (and headers), template
    parameters, target arch, NVRTC version and fastmm version."""
    text = "|".join([source_digest, repr(tuple(sorted(macros))), arch, f"nvrtc{nvrtc[0]}.{nvrtc[1]}", __version__])
    return hashlib.sha256(text.encode()).hexdigest()


def encode(arch: str, cubin: bytes, key: str = "-") -> bytes:
    digest = hashlib.sha256(cubin).hexdigest()
    return b"%s %s %s %s %d\n" % (MAGIC, arch.encode(), key.encode(), digest.encode(), len(cubin)) + cubin


def parse_header(blob: bytes) -> tuple[str, str] | None:
    """(arch, key) named by an entry's header, or None if it is not a fastmm cache entry."""
    parts = blob.partition(b"\n")[0].split(b" ")
    if len(parts) != 6 or b" ".join(parts[:2]) != MAGIC:
        return None
    return parts[2].decode(errors="replace"), parts[3].decode(errors="replace")


def decode(blob: bytes, arch: str, key: str | None = None) -> bytes | None:
    """The cubin in ``blob`` if it is a complete, uncorrupted entry for ``arch`` (and ``key``,
    when given); else None."""
    head, sep, payload = blob.partition(b"\n")
    named = parse_header(blob)
    if not sep or named is None or named[0] != arch or (key is not None and named[1] != key):
        return None
    parts = head.split(b" ")
    try:
        length = int(parts[5])
    except ValueError:
        return None
    if length != len(payload) or hashlib.sha256(payload).hexdigest().encode() != parts[4]:
        return None
    return payload


@contextlib.contextmanager
def exclusive_file_lock(lock_path: Path):
    """An exclusive ``flock`` on ``lock_path`` (created if needed) between processes; a no-op
    where flock is unavailable (Windows, some network file systems)."""
    try:
        import fcntl
        fd = os.open(str(lock_path), os.O_CREAT | os.O_RDWR, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # e.g. ENOLCK on a network file system: go on without the lock
            pass
        yield
    finally:
        os.close(fd)  # closing releases the lock


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a private temporary file next to ``path``, fsync it, and rename it over
    ``path``: readers see the old file or the whole new one. Raises OSError (nothing left behind)."""
    tmp = None
    try:
        # creating the temporary file can itself fail on a full disk (no free inode or block)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


class DiskCache:
    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder is not None else config.cache_dir()
        self._usable: bool | None = None
        self._warned = False
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self.compiles = 0  # compiles done by this process (tests and the CLI read it)

    def path_for(self, name: str, key: str) -> Path:
        return self.folder / f"{name}-{key[:32]}.cubin"

    def _degrade(self, why: str) -> None:
        self._usable = False
        if not self._warned:
            self._warned = True
            warnings.warn(f"fastmm: kernel cache folder {self.folder} is not usable ({why}); "
                          f"compiled kernels are kept in memory only. Set {config.CACHE_DIR_ENV} to a writable folder.",
                          CacheWarning, stacklevel=4)

    def usable(self) -> bool:
        if self._usable is None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=self.folder, prefix=".probe-"):
                    pass
                self._usable = True
            except OSError as exc:
                self._degrade(str(exc))
        return bool(self._usable)

    def _thread_lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    @contextlib.contextmanager
    def _process_lock(self, path: Path):
        """Exclusive per-key lock between processes; a no-op where flock is unavailable."""
        with exclusive_file_lock(Path(str(path) + ".lock")):
            yield

    def read(self, path: Path, arch: str, key: str | None = None) -> bytes | None:
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        return decode(blob, arch, key)

    def write(self, path: Path, arch: str, cubin: bytes, key: str = "-") -> None:
        try:
            atomic_write(path, encode(arch, cubin, key))
        except OSError as exc:
            self._degrade(f"writing {path.name} failed: {exc}")

    def get_or_compile(self, name: str, key: str, arch: str, compile_fn: Callable[[], bytes]) -> CacheResult:
        """The cubin for ``key``: from disk if a valid entry exists, else compiled (once across
        threads and processes) and stored."""
        with self._thread_lock(key):
            if not self.usable():
                self.compiles += 1
                return CacheResult(compile_fn(), "compiled", None)
            path = self.path_for(name, key)
            cubin = self.read(path, arch, key)
            if cubin is not None:
                return CacheResult(cubin, "disk", path)
            with self._process_lock(path):
                cubin = self.read(path, arch, key)  # another process may have written it meanwhile
                if cubin is not None:
                    return CacheResult(cubin, "disk", path)
                cubin = compile_fn()
                self.compiles += 1
                if self._usable:
                    self.write(path, arch, cubin, key)
                return CacheResult(cubin, "compiled", path if self._usable else None)

    # --- maintenance (the `python -m fastmm cache` command) ---
    def entries(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return sorted(self.folder.glob("*.cubin"))

    def verify(self) -> list[tuple[Path, bool]]:
        out = []
        for path in self.entries():
            try:
                blob = path.read_bytes()
            except OSError:  # unreadable (permissions, a folder of that name, ...): not a valid entry
                out.append((path, False))
                continue
            named = parse_header(blob)
            # valid: intact, and stored under the file name its key gives
            ok = (named is not None and decode(blob, named[0], named[1]) is not None
                  and path.name.endswith(f"-{named[1][:32]}.cubin"))
            out.append((path, ok))
        return out

    def clear(self) -> int:
        n = 0
        for path in self.entries():
            with contextlib.suppress(OSError):
                path.unlink()
                n += 1
        for lock in self.folder.glob("*.lock") if self.folder.is_dir() else []:
            with contextlib.suppress(OSError):
                lock.unlink()
        return n


_default: DiskCache | None = None
_default_guard = threading.Lock()


def default_cache() -> DiskCache:
    """The process-wide cache for the folder the environment names now (re-read when it changes,
    so a test or a user can point FASTMM_CACHE_DIR elsewhere at run time)."""
    global _default
    with _default_guard:
        if _default is None or _default.folder != config.cache_dir():
            _default = DiskCache()
        return _default
