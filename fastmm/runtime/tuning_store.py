"""Tuned choices on disk: one JSON file per device key, mapping shape buckets to measured winners.

The key is the GPU's name, compute capability and driver version plus the NVRTC and fastmm
versions: a choice measured on one GPU model, driver, compiler or set of kernels says nothing
reliable about another. Each key gets its own file, named by a readable slug and a hash of the
key; a file whose recorded key is not the one asked for (copied from elsewhere) is ignored.

A tuning file decides which kernel runs, so it is read under the kernel cache's trust policy
(fastmm/runtime/cache.py): the tuning folder must be owned by this user or root and not writable by
group or others, and the file a regular file of the same kind (a symlink is judged by its target),
unless FASTMM_CACHE_TRUST_SHARED=1. A file that fails is ignored with one warning (the heuristics
choose; the next write replaces it where the folder is fine); a folder that fails is neither read
nor written (new records stay in memory, one warning). The folder is created 0o700, the file 0o600.

Reading never raises: a missing file holds nothing, and an unreadable or corrupt one is ignored
with one warning (the next write replaces it). Writes re-read the file under an exclusive flock,
merge, and write a private temporary file that is renamed over the target (atomic on POSIX), so
tuners in several processes lose no record and readers never see half a file. A folder that
cannot be written keeps new records in memory for this process, with one warning.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from .. import config
from .._version import __version__
from .cache import Untrusted, atomic_write, make_folder, open_folder

FORMAT = 1


class TuningWarning(UserWarning):
    """A tuning file could not be read or written; fastmm carries on without it."""


@dataclass(frozen=True)
class DeviceKey:
    """What a tuned choice is valid for."""

    name: str
    capability: tuple[int, int]
    driver: int  # cuDriverGetVersion, e.g. 13000
    nvrtc: tuple[int, int]
    fastmm: str

    @classmethod
    def for_device(cls, index: int) -> "DeviceKey":
        from .compiler import nvrtc_version
        from .device import device_identity

        name, capability, driver = device_identity(index)
        return cls(name, capability, driver, nvrtc_version(), __version__)

    def as_json(self) -> dict:
        return {"name": self.name, "capability": list(self.capability), "driver": self.driver,
                "nvrtc": list(self.nvrtc), "fastmm": self.fastmm}

    def file_name(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-") or "gpu"
        digest = hashlib.sha256(json.dumps(self.as_json(), sort_keys=True).encode()).hexdigest()[:16]
        return f"{slug}-sm{self.capability[0]}{self.capability[1]}-{digest}.json"


class TuningStore:
    """The tuned records of one device key in one folder, read once and kept in memory."""

    def __init__(self, folder: Path, key: DeviceKey):
        self.folder = Path(folder)
        self.key = key
        self.path = self.folder / key.file_name()
        self._records: dict[str, dict] | None = None
        self._guard = threading.Lock()
        self._warned: set[str] = set()

    def _warn(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(f"fastmm: {message}", TuningWarning, stacklevel=4)

    def _untrusted(self, exc: Untrusted) -> None:
        """One warning: the tuning folder or file fails the trust policy, its choices are ignored."""
        if exc.path == self.folder:
            what, then = "folder", "new ones are kept in memory for this process"
        else:
            what, then = "file", "the next tune replaces the file"
        self._warn("trust", f"tuning {what} {exc.path} is not trusted ({exc.why}): its tuned choices are ignored "
                   f"(the heuristics choose); {then}. Set {config.CACHE_TRUST_SHARED_ENV}=1 if you vouch for this "
                   f"shared folder.")

    def _read_file(self) -> dict[str, dict]:
        """The records in the file now: {} when it is missing, untrusted, unreadable, corrupt or
        another key's."""
        try:
            with open_folder(self.folder) as folder:
                blob = folder.read(self.path.name)
        except (FileNotFoundError, NotADirectoryError):  # nothing stored yet
            return {}
        except Untrusted as exc:
            self._untrusted(exc)
            return {}
        except OSError as exc:
            self._warn("read", f"tuning file {self.path} is unreadable ({exc}); ignoring it")
            return {}
        if blob is None:  # nothing stored yet
            return {}
        try:
            text = blob.decode("utf-8")
        except UnicodeDecodeError as exc:
            self._warn("read", f"tuning file {self.path} is unreadable ({exc}); ignoring it")
            return {}
        try:
            data = json.loads(text)
        except ValueError as exc:
            self._warn("read", f"tuning file {self.path} is corrupt ({exc}); ignoring it (the next tune replaces it)")
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("records"), dict):
            self._warn("read", f"tuning file {self.path} is not a fastmm tuning file of format {FORMAT}; ignoring it")
            return {}
        if data.get("device") != self.key.as_json():
            self._warn("read", f"tuning file {self.path} was written for {data.get('device')}, not for "
                       f"{self.key.as_json()}; ignoring it")
            return {}
        return {bucket: rec for bucket, rec in data["records"].items() if isinstance(rec, dict)}

    def records(self) -> dict[str, dict]:
        """Every stored record by bucket (read from disk on first use)."""
        with self._guard:
            if self._records is None:
                self._records = self._read_file()
            return dict(self._records)

    def get(self, bucket: str) -> dict | None:
        records = self._records if self._records is not None else self.records()
        return records.get(bucket)

    def put(self, bucket: str, record: dict) -> Path | None:
        """Store ``record`` for ``bucket``, keeping what other processes stored meanwhile. Returns
        the file, or None when it could not be written (the record then lives in memory only)."""
        with self._guard:
            try:
                make_folder(self.folder)
                with open_folder(self.folder) as folder, folder.lock(self.path.name + ".lock"):
                    merged = self._read_file()
                    merged[bucket] = record
                    blob = json.dumps({"format": FORMAT, "device": self.key.as_json(), "records": merged},
                                      indent=1, sort_keys=True)
                    atomic_write(self.path, blob.encode("utf-8"))
            except (Untrusted, OSError, TypeError, ValueError) as exc:
                if isinstance(exc, Untrusted):
                    self._untrusted(exc)
                else:
                    self._warn("write", f"could not save tuned choices to {self.path} ({exc}); keeping them in memory "
                               f"for this process. Set {config.CACHE_DIR_ENV} to a writable folder.")
                merged = dict(self._records if self._records is not None else self._read_file())
                merged[bucket] = record
                self._records = merged
                return None
            self._records = merged
            return self.path


_stores: dict[tuple[Path, DeviceKey], TuningStore] = {}
_stores_guard = threading.Lock()


def store_for(index: int) -> TuningStore:
    """The store of device ``index`` in the folder the environment names now (FASTMM_CACHE_DIR)."""
    key = _device_key(index)
    folder = config.tuning_dir()
    with _stores_guard:
        store = _stores.get((folder, key))
        if store is None:
            store = _stores[(folder, key)] = TuningStore(folder, key)
        return store


_keys: dict[int, DeviceKey] = {}


def _device_key(index: int) -> DeviceKey:
    key = _keys.get(index)
    if key is None:
        key = _keys[index] = DeviceKey.for_device(index)
    return key
