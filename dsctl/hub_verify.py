"""Check local files against the hub's sizes and hashes, and remember which ones passed.

LFS files are checked against their sha256, plain git files against their git
blob sha1 (sha1 of "blob <size>\\0" + content): both are the hub's own ids. A
small record (path -> digest, size, mtime) keeps files that already passed from
being hashed again on every plain run; `--verify` ignores it and hashes all.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

READ_CHUNK = 8 << 20


class Hasher:
    """Incremental sha256 / git-sha1 of a file of known size, with a byte count."""

    def __init__(self, algo: str, size: int):
        self.algo, self.size = algo, size
        self.reset()

    def reset(self) -> None:
        if self.algo == "sha256":
            self._h = hashlib.sha256()
        else:
            self._h = hashlib.sha1()
            self._h.update(b"blob %d\0" % self.size)
        self.count = 0

    def update(self, data: bytes) -> None:
        self._h.update(data)
        self.count += len(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def hash_prefix(f, path: Path, length: int, on_bytes: Callable[[int], None] = lambda n: None) -> Hasher:
    """A Hasher for f that has consumed the first `length` bytes of `path`."""
    h = Hasher(f.algo, f.size)
    with open(path, "rb") as src:
        while h.count < length:
            data = src.read(min(READ_CHUNK, length - h.count))
            if not data:
                break
            h.update(data)
            on_bytes(len(data))
    return h


def file_matches(f, path: Path, on_bytes: Callable[[int], None] = lambda n: None) -> Optional[str]:
    """None when path holds exactly f (size and hash), else what is wrong."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != f.size:
        return f"size {size}, hub says {f.size}"
    h = hash_prefix(f, path, size, on_bytes)
    if h.hexdigest() != f.digest:
        return f"{f.algo} mismatch (got {h.hexdigest()[:12]}…, hub says {f.digest[:12]}…)"
    return None


@dataclass(frozen=True)
class Stamp:
    digest: str
    size: int
    mtime_ns: int


class VerifiedRecord:
    """path -> Stamp of files whose hash matched; saved atomically after each change."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._data: dict[str, Stamp] = {}
        try:
            raw = json.loads(path.read_text())
            self._data = {k: Stamp(**v) for k, v in raw.items()}
        except (OSError, ValueError, TypeError):
            self._data = {}

    def is_verified(self, f, data_path: Path) -> bool:
        stamp = self._data.get(f.path)
        try:
            st = data_path.stat()
        except OSError:
            return False
        return stamp == Stamp(f.digest, st.st_size, st.st_mtime_ns) and st.st_size == f.size

    def mark(self, f, data_path: Path, ok: bool) -> None:
        with self._lock:
            if ok:
                st = data_path.stat()
                self._data[f.path] = Stamp(f.digest, st.st_size, st.st_mtime_ns)
            else:
                self._data.pop(f.path, None)
            self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({k: vars(v) for k, v in sorted(self._data.items())}, indent=0))
        os.replace(tmp, self.path)
