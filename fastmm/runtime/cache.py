"""On-disk cache of compiled kernels: one file per kernel key.

File format: a header line ``FASTMM-CUBIN 2 <arch> <kernel key> <sha256 of payload> <payload
length>\\n`` followed by the cubin. A file is trusted only if the header parses, the arch and key
are the ones asked for, and length and hash match: truncated, empty, garbage, wrong-arch or
renamed files are recompiled and replaced, never loaded (loading a bad cubin can take the process
down).

Who may have written it. The header and hash guard against corruption, not against someone who
can write into the folder: a cubin loaded from here runs in this process. So an entry is loaded
only when nobody but this user or root can have written it:

- the folder (symlinks resolved: a folder that is a symlink is judged by its target) is owned by
  this user or root and is not writable by group or others (a sticky bit does not change that);
- the entry is a regular file (a symlinked entry is judged by the file it points to) owned by this
  user or root and not writable by group or others.

A folder owned by root (or this user) that this user cannot write qualifies: what an admin ships
as a precompiled cache. Its entries load; a kernel it lacks is compiled and kept in memory. A
folder that fails the checks is not read at all: one warning (the path and why), then kernels are
compiled and kept in memory. An entry that fails them is not loaded: one warning, the kernel is
compiled afresh and, where the folder can be written, the entry is replaced. The checks use
``fstat`` on the descriptors that are then read (the folder is opened once per lookup, entries are
opened relative to it, without blocking on a FIFO), so nothing can be swapped in between the check
and the read. ``FASTMM_CACHE_TRUST_SHARED=1`` turns the owner and mode checks off for a shared
cache the user vouches for; entries are then written readable by all (0o644). Where the platform
has no owners and modes (Windows) only the file-type checks apply.

Folders fastmm creates are 0o700; entries, temporary files and lock files are created 0o600
(0o644 for a trusted shared cache), temporary files with ``O_EXCL | O_NOFOLLOW`` (``mkstemp``),
lock files with ``O_NOFOLLOW``. Writes need no descriptor checks: what is written is this
process's own cubin, and whatever happens to it on disk is judged again when it is read.

Writes go to a private temporary name in the same folder and are then renamed over the target
with ``os.replace``: rename is atomic on POSIX, so a reader sees either the old file or the whole
new one, even with many processes writing the same key at once (a symlink or a foreign file under
the entry's name is replaced, not written through). A per-key ``flock`` makes the other processes
wait for the first compile instead of repeating it. A folder that cannot be created or opened
turns the cache into a memory-only one, with a single warning; a folder that cannot be written
(read-only, full) keeps what it holds readable and new kernels in memory, with a single warning.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import stat
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
    path: Path | None  # the cache file, or None when the kernel is kept in memory only (folder untrusted, unusable or read-only)


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


# --- trust: who can have written a folder or a file ------------------------------------------------

FOLDER_MODE = 0o700  #: folders fastmm creates
PRIVATE_MODE = 0o600  #: entries, tuning files, temporary and lock files fastmm creates
SHARED_MODE = 0o644  #: the same in a shared cache the user vouches for (FASTMM_CACHE_TRUST_SHARED=1)

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO under an entry's name must not hang the open
_O_NOCTTY = getattr(os, "O_NOCTTY", 0)  # nor a terminal device become the controlling one
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_PATH = getattr(os, "O_PATH", 0)  # Linux: a folder this user may search but not list still opens
#: files are opened relative to the descriptor of the checked folder where the platform can
_AT = os.open in os.supports_dir_fd and os.readlink in os.supports_dir_fd
#: POSIX owners and modes; elsewhere (Windows) only the file-type checks apply
_POSIX = hasattr(os, "geteuid")


class Untrusted(Exception):
    """A folder or file the trust policy refuses (see the module docstring)."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path}: {why}")
        self.path = Path(path)
        self.why = why


def file_mode() -> int:
    """The mode entries, tuning files and lock files are created with."""
    return SHARED_MODE if config.cache_trust_shared() else PRIVATE_MODE


def trust_problem(st: os.stat_result, folder: bool) -> str | None:
    """Why a folder (``folder=True``) or a file of this ``stat`` could hold what another user
    wrote, or None where only this user or root can have written it. Under
    FASTMM_CACHE_TRUST_SHARED=1 only the type is checked."""
    if folder and not stat.S_ISDIR(st.st_mode):
        return "not a folder"
    if not folder and not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if not _POSIX or config.cache_trust_shared():
        return None
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"owned by uid {st.st_uid}, not by you (uid {me}) or root"
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit]
    if writable:
        return f"writable by {' and '.join(writable)} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def make_folder(path: Path) -> None:
    """Create folder ``path`` and its missing parents, each 0o700 (less what the umask takes). An
    existing folder is left as it is: it is judged when opened."""
    path = Path(path)
    if os.path.isdir(path):
        return
    try:
        os.mkdir(path, FOLDER_MODE)
    except FileNotFoundError:
        if path.parent == path:
            raise
        make_folder(path.parent)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, FOLDER_MODE)
    except FileExistsError:  # made meanwhile (or not a folder: opening it says so)
        pass


def _resolved_note(path: Path) -> str:
    """' (resolved to X)' where a symlink on the way to ``path`` led elsewhere, for messages."""
    real = os.path.realpath(path)
    return f" (resolved to {real})" if real != os.path.abspath(path) else ""


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


class CheckedFolder:
    """A folder opened and checked against the trust policy (:func:`open_folder`). Its files are
    opened relative to the descriptor that was checked, so the folder cannot be swapped between
    the check and the use. A context manager: leaving it closes the descriptor."""

    def __init__(self, path: Path, fd: int | None):
        self.path = Path(path)
        self.fd = fd  # None where the platform has no *at calls: files are then opened by path
        self._at = fd is not None

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def __enter__(self) -> "CheckedFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self, name: str, flags: int, mode: int = 0o777) -> int:
        if not self._at:
            return os.open(self.path / name, flags, mode)
        if self.fd is None:
            raise ValueError(f"{self.path} was closed")
        return os.open(name, flags, mode, dir_fd=self.fd)

    def _link_note(self, name: str) -> str:
        """' (a symlink to X)' where ``name`` is a symlink, for messages."""
        try:
            target = os.readlink(name, dir_fd=self.fd) if self._at else os.readlink(self.path / name)
        except (OSError, ValueError):  # not a symlink (EINVAL), gone
            return ""
        return f" (a symlink to {target})"

    def read(self, name: str) -> bytes | None:
        """The contents of file ``name`` (a symlink is followed and the file it leads to judged) if
        it passes the trust policy; None where there is no such file (or a dangling symlink).
        Raises Untrusted (then nothing was read) or OSError."""
        try:
            fd = self._open(name, os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK | _O_NOCTTY)
        except FileNotFoundError:
            return None
        try:
            why = trust_problem(os.fstat(fd), folder=False)
            if why is not None:
                raise Untrusted(self.path / name, why + self._link_note(name))
            return _read_all(fd)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def lock(self, name: str):
        """An exclusive ``flock`` on the lock file ``name`` in this folder, between processes. The
        file is created with :func:`file_mode`, never through a symlink (``O_NOFOLLOW``); another
        user's lock file in a shared folder is locked read-only (flock needs no write access).
        A no-op where flock or the file is unavailable (Windows, a read-only folder, ENOLCK on
        some network file systems)."""
        try:
            import fcntl
        except ImportError:
            yield
            return
        fd = None
        base = _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK | _O_NOCTTY
        try:
            fd = self._open(name, os.O_RDWR | os.O_CREAT | base, file_mode())
        except PermissionError:
            with contextlib.suppress(OSError):
                fd = self._open(name, os.O_RDONLY | base)
        except OSError:  # a read-only or full folder, a symlink under the name (ELOOP), ...
            pass
        if fd is not None:
            try:
                regular = stat.S_ISREG(os.fstat(fd).st_mode)
            except OSError:
                regular = False
            if not regular:  # (a FIFO or a device planted under the name)
                os.close(fd)
                fd = None
        if fd is None:
            yield
            return
        try:
            with contextlib.suppress(OSError):  # e.g. ENOLCK on a network file system: go on without it
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock


def open_folder(path: Path, *, create: bool = False) -> CheckedFolder:
    """Open folder ``path`` (symlinks followed) and check what it resolves to against the trust
    policy; with ``create``, a missing folder is made first (0o700, parents too). Raises Untrusted,
    or OSError (FileNotFoundError where it is missing, NotADirectoryError under a file, ...)."""
    path = Path(path)
    if create:
        make_folder(path)
    if not _AT:
        why = trust_problem(os.stat(path), folder=True)
        if why is not None:
            raise Untrusted(path, why + _resolved_note(path))
        return CheckedFolder(path, None)
    fd = os.open(path, (_O_PATH or os.O_RDONLY) | _O_DIRECTORY | _O_CLOEXEC)
    try:
        why = trust_problem(os.fstat(fd), folder=True)
    except BaseException:
        os.close(fd)
        raise
    if why is not None:
        os.close(fd)
        raise Untrusted(path, why + _resolved_note(path))
    return CheckedFolder(path, fd)


@contextlib.contextmanager
def exclusive_file_lock(lock_path: Path):
    """An exclusive ``flock`` on ``lock_path`` (see :meth:`CheckedFolder.lock`: created with
    :func:`file_mode`, never through a symlink); a no-op where flock is unavailable."""
    lock_path = Path(lock_path)
    with CheckedFolder(lock_path.parent, None).lock(lock_path.name):
        yield


def atomic_write(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to a private temporary file next to ``path`` (``mkstemp``: created with
    O_EXCL | O_NOFOLLOW, mode 0o600), give it ``mode`` (default :func:`file_mode`), fsync it, and
    rename it over ``path``: readers see the old file or the whole new one. Raises OSError
    (nothing left behind)."""
    mode = file_mode() if mode is None else mode
    tmp = None
    try:
        # creating the temporary file can itself fail on a full disk (no free inode or block)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            if mode != PRIVATE_MODE and hasattr(os, "fchmod"):
                os.fchmod(fh.fileno(), mode)
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
        self._refused: str | None = None  # why nothing is read from or written to the folder
        self._read_only: str | None = None  # why new entries are not stored (what is there still loads)
        self._probed = False
        self._warned: set[str] = set()
        self._warn_guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self.compiles = 0  # compiles done by this process (tests and the CLI read it)

    def path_for(self, name: str, key: str) -> Path:
        return self.folder / f"{name}-{key[:32]}.cubin"

    # --- warnings: one of each kind per cache ---
    def _warn(self, kind: str, message: str) -> None:
        with self._warn_guard:
            if kind in self._warned:
                return
            self._warned.add(kind)
        warnings.warn(message, CacheWarning, stacklevel=5)

    def _refuse(self, why: str, untrusted: bool) -> None:
        """Nothing is read from or written to the folder from now on."""
        if untrusted:
            self._refused = f"folder {self.folder} is not trusted: {why}"
            self._warn("folder", f"fastmm: kernel cache folder {self.folder} is not trusted ({why}): nothing is loaded "
                       f"from it, and compiled kernels are kept in memory only. Make it yours and not writable by group "
                       f"or others (chmod go-w), set {config.CACHE_DIR_ENV} to a folder of your own, or set "
                       f"{config.CACHE_TRUST_SHARED_ENV}=1 if you vouch for this shared cache.")
        else:
            self._refused = f"folder {self.folder} is not usable: {why}"
            self._warn("folder", f"fastmm: kernel cache folder {self.folder} is not usable ({why}); compiled kernels "
                       f"are kept in memory only. Set {config.CACHE_DIR_ENV} to a writable folder.")

    def _degrade(self, why: str) -> None:
        """New entries are not stored from now on (what the folder holds still loads)."""
        self._read_only = f"folder {self.folder} cannot be written: {why}"
        self._warn("write", f"fastmm: kernel cache folder {self.folder} is not usable for new kernels ({why}); "
                   f"compiled kernels are kept in memory only. Set {config.CACHE_DIR_ENV} to a writable folder.")

    def _open_folder(self) -> CheckedFolder | None:
        """The cache folder, made where missing and checked; None (after one warning) where it is
        untrusted or cannot be opened."""
        if self._refused is not None:
            return None
        try:
            return open_folder(self.folder, create=True)
        except Untrusted as exc:
            self._refuse(exc.why, untrusted=True)
        except OSError as exc:
            self._refuse(str(exc), untrusted=False)
        return None

    def usable(self) -> bool:
        """Whether kernels compiled now are stored on disk. The first call makes the folder where
        missing, checks it and probes it with a file (one warning where it cannot be used)."""
        if not self._probed and self._refused is None and self._read_only is None:
            self._probed = True
            folder = self._open_folder()
            if folder is not None:
                with folder:
                    try:
                        with tempfile.NamedTemporaryFile(dir=self.folder, prefix=".probe-"):
                            pass
                    except OSError as exc:
                        self._degrade(str(exc))
        return self._refused is None and self._read_only is None

    def memory_only_reason(self) -> str | None:
        """Why a kernel compiled now would be kept in memory only, or None where it would be
        stored. Makes, writes and warns nothing (``explain`` shows it)."""
        if self._refused is not None or self._read_only is not None:
            return self._refused or self._read_only
        try:
            with open_folder(self.folder):
                pass
        except FileNotFoundError:  # made on first use
            return None
        except Untrusted as exc:
            return f"folder {self.folder} is not trusted: {exc.why}"
        except OSError as exc:
            return f"folder {self.folder} is not usable: {exc}"
        if hasattr(os, "geteuid") and not os.access(self.folder, os.W_OK):
            return f"folder {self.folder} is read-only"
        return None

    def _thread_lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    def _load(self, folder: CheckedFolder, name: str, arch: str, key: str) -> bytes | None:
        """The intact, trusted entry ``name`` of ``folder``, or None (an untrusted one: one warning)."""
        try:
            blob = folder.read(name)
        except Untrusted as exc:
            self._warn("entry", f"fastmm: kernel cache entry {exc.path} is not trusted ({exc.why}); it is not "
                       f"loaded: the kernel is compiled afresh (and stored in its place where the folder can be "
                       f"written). Set {config.CACHE_TRUST_SHARED_ENV}=1 if you vouch for this shared cache.")
            return None
        except OSError:  # unreadable (no permission, ...): as if missing
            return None
        return None if blob is None else decode(blob, arch, key)

    def read(self, path: Path, arch: str, key: str | None = None) -> bytes | None:
        """The cubin of the entry at ``path`` if its folder and itself pass the trust policy and it
        is intact for ``arch`` (and ``key``, when given); else None. Makes and warns nothing."""
        path = Path(path)
        try:
            with open_folder(path.parent) as folder:
                blob = folder.read(path.name)
        except (Untrusted, OSError):
            return None
        return None if blob is None else decode(blob, arch, key)

    def write(self, path: Path, arch: str, cubin: bytes, key: str = "-") -> bool:
        """Store an entry atomically. False (after one warning, the first time) where the folder
        cannot take it: the cache then stores nothing more."""
        if self._refused is not None or self._read_only is not None:
            return False
        try:
            atomic_write(path, encode(arch, cubin, key))
        except OSError as exc:
            self._degrade(f"writing {path.name} failed: {exc}")
            return False
        return True

    def _compile(self, compile_fn: Callable[[], bytes]) -> CacheResult:
        cubin = compile_fn()
        self.compiles += 1
        return CacheResult(cubin, "compiled", None)

    def get_or_compile(self, name: str, key: str, arch: str, compile_fn: Callable[[], bytes]) -> CacheResult:
        """The cubin for ``key``: from disk if a valid, trusted entry exists, else compiled (once
        across threads and processes) and stored where the folder allows."""
        with self._thread_lock(key):
            folder = self._open_folder()
            if folder is None:  # untrusted or unusable: memory only
                return self._compile(compile_fn)
            path = self.path_for(name, key)
            with folder:
                cubin = self._load(folder, path.name, arch, key)
                if cubin is not None:
                    return CacheResult(cubin, "disk", path)
                if self._read_only is not None:  # the entries there load, new ones stay in memory
                    return self._compile(compile_fn)
                with folder.lock(path.name + ".lock"):
                    cubin = self._load(folder, path.name, arch, key)  # another process may have written it meanwhile
                    if cubin is not None:
                        return CacheResult(cubin, "disk", path)
                    cubin = compile_fn()
                    self.compiles += 1
                    stored = self.write(path, arch, cubin, key)
                    return CacheResult(cubin, "compiled", path if stored else None)

    # --- maintenance (the `python -m fastmm cache` command) ---
    def entries(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return sorted(self.folder.glob("*.cubin"))

    def verify(self) -> list[tuple[Path, bool]]:
        """(entry, valid) for every entry: valid when it is a regular file the trust policy accepts,
        intact, and stored under the file name its key gives."""
        out = []
        for path in self.entries():
            try:
                blob = CheckedFolder(path.parent, None).read(path.name)
            except (Untrusted, OSError):  # untrusted, unreadable (permissions, a folder of that name, ...)
                out.append((path, False))
                continue
            named = parse_header(blob) if blob is not None else None
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
