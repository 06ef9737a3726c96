"""Where downloaded files go: a plain --local-dir, or the Hugging Face cache layout.

Local dir: files at <dir>/<path>; partial files and the verified record under
<dir>/.cache/dsctl/. Cache (the default, under HF_HUB_CACHE / HF_HOME): the
layout huggingface_hub itself writes and reads (blobs/<etag>,
snapshots/<commit>/<path> -> ../../blobs/<etag>, refs/<revision>), so
`snapshot_download(local_files_only=True)` and `dsctl serve` find the model.
A blob's partial file is blobs/<etag>.incomplete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from huggingface_hub import constants

from dsctl.hub_repo import RemoteFile


class LocalDirLayout:
    def __init__(self, root: Path):
        self.root = root
        self._state = root / ".cache" / "dsctl"
        self.record_path = self._state / "verified.json"

    def data_path(self, f: RemoteFile) -> Path:
        return self.root / f.path

    def partial_path(self, f: RemoteFile) -> Path:
        return self._state / "partial" / f"{f.path}.{f.etag[:16]}.incomplete"

    def lock_path(self, f: RemoteFile) -> Path:
        return self._state / "partial" / f"{f.path}.lock"

    def install(self, f: RemoteFile, partial: Path) -> None:
        dest = self.data_path(f)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, dest)

    def link(self, f: RemoteFile) -> None:
        """Nothing to link: the data is the file."""

    def remove(self, f: RemoteFile) -> None:
        self.data_path(f).unlink(missing_ok=True)

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def space_dir(self) -> Path:
        return self.root


class CacheLayout:
    def __init__(self, cache_dir: Path, repo_id: str, revision: str, commit: str):
        self.folder = "models--" + repo_id.replace("/", "--")
        self.storage = cache_dir / self.folder
        self.locks = cache_dir / ".locks" / self.folder  # where huggingface_hub keeps its own blob locks
        self.revision, self.commit = revision, commit
        self.root = self.storage / "snapshots" / commit
        self.record_path = self.storage / ".dsctl-verified.json"

    def data_path(self, f: RemoteFile) -> Path:
        return self.storage / "blobs" / f.etag

    def partial_path(self, f: RemoteFile) -> Path:
        return self.storage / "blobs" / f"{f.etag}.incomplete"

    def lock_path(self, f: RemoteFile) -> Path:
        return self.locks / f"{f.etag}.lock"

    def install(self, f: RemoteFile, partial: Path) -> None:
        os.replace(partial, self.data_path(f))
        self.link(f)

    def link(self, f: RemoteFile) -> None:
        pointer = self.root / f.path
        pointer.parent.mkdir(parents=True, exist_ok=True)
        blob = self.data_path(f)
        if pointer.is_symlink() or pointer.exists():
            if pointer.resolve() == blob.resolve():
                return
            pointer.unlink()
        try:
            os.symlink(os.path.relpath(blob, pointer.parent), pointer)
        except OSError:  # no symlinks on this filesystem: keep a copy
            shutil.copyfile(blob, pointer)

    def remove(self, f: RemoteFile) -> None:
        self.data_path(f).unlink(missing_ok=True)
        pointer = self.root / f.path
        if pointer.is_symlink() or pointer.exists():
            pointer.unlink()

    def prepare(self) -> None:
        """Create the snapshot and point refs/<revision> at the commit, as huggingface_hub does.

        Done first, so that an interrupted download is found (and reported incomplete) by the engine.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        if self.revision != self.commit:
            ref = self.storage / "refs" / self.revision
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(self.commit)

    @property
    def space_dir(self) -> Path:
        return self.storage


def make_layout(repo_id: str, revision: str, commit: str, local_dir: Optional[Path],
                cache_dir: Optional[Path] = None):
    if local_dir is not None:
        return LocalDirLayout(local_dir.expanduser().resolve())
    if cache_dir is None:
        cache_dir = Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)
    return CacheLayout(cache_dir.expanduser(), repo_id, revision, commit)
