"""What a hub repo holds: the commit a revision points to and each file's size and hash.

Uses huggingface_hub's HfApi (model_info for the commit, list_repo_tree for the
files), so HF_ENDPOINT and HF_TOKEN are honoured. The expected hash of a file is
the LFS sha256 for LFS files and the git blob sha1 for plain ones: both are what
the hub itself uses as the file's ETag.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from huggingface_hub import HfApi, constants, errors
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import filter_repo_objects, get_session

from engine.checkpoint.registry import lookup
from engine.errors import DsctlError, UsageError


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    algo: str  # "sha256" (LFS) or "git-sha1" (plain git blob)
    digest: str

    @property
    def etag(self) -> str:
        """The hub's ETag for this file (the blob name in the HF cache)."""
        return self.digest


@dataclass(frozen=True)
class RepoListing:
    repo_id: str
    revision: str  # as asked (branch, tag or commit)
    commit: str
    files: tuple[RemoteFile, ...]


class HubError(DsctlError):
    """The hub refused or could not answer (unknown repo, gated, network gone)."""


def endpoint() -> str:
    """HF_ENDPOINT as it is now (huggingface_hub reads it only once, at import)."""
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def resolve_repo_id(model: str) -> str:
    """A registry alias or an org/name -> hub repo id; built-in models are rejected."""
    entry = lookup(model)
    if entry is not None:
        if entry.builtin:
            raise UsageError(
                f"{model!r} is a built-in synthetic model: it is generated locally on first use "
                "and has nothing to download (use it directly, e.g. `dsctl generate --model tiny`)"
            )
        return entry.repo_id
    parts = model.split("/")
    if len(parts) == 2 and all(parts):
        return model
    raise UsageError(f"unknown model {model!r}: not a registry alias (see `dsctl models`) and not an org/name repo id")


def _to_remote(entry) -> RemoteFile:
    """A huggingface_hub RepoFile -> RemoteFile (LFS sha256 when LFS, else the git blob id)."""
    lfs = getattr(entry, "lfs", None)
    if lfs is not None:
        sha256 = lfs["sha256"] if isinstance(lfs, dict) and "sha256" in lfs else lfs.sha256
        return RemoteFile(entry.path, int(entry.size), "sha256", str(sha256).lower())
    return RemoteFile(entry.path, int(entry.size), "git-sha1", str(entry.blob_id).lower())


CONNECT_TIMEOUT_S = 10.0  # first contact: a black-holed address fails in seconds, not at the OS's ~2 minutes


def _connect_timeout(seconds: float):
    """A timeout that bounds only opening the connection (reads take as long as they take), in the form the
    HTTP library under huggingface_hub takes (httpx / httpx2 Timeout, or a requests (connect, read) pair)."""
    module = type(get_session()).__module__.split(".")[0]
    if module == "requests":
        return (seconds, None)
    return importlib.import_module(module).Timeout(None, connect=seconds)


def list_repo(repo_id: str, revision: Optional[str], token: Optional[str],
              call: Callable = lambda fn: fn()) -> RepoListing:
    """The commit and files of repo_id@revision. `call` wraps each API call (retries)."""
    api = HfApi(endpoint=endpoint(), token=token)
    rev = revision or "main"
    info = call(lambda: api.model_info(repo_id, revision=rev, timeout=_connect_timeout(CONNECT_TIMEOUT_S)))
    commit = info.sha or rev
    entries = call(lambda: list(api.list_repo_tree(repo_id, revision=commit, recursive=True)))
    files = tuple(sorted((_to_remote(e) for e in entries if isinstance(e, RepoFile)), key=lambda f: f.path))
    return RepoListing(repo_id, rev, commit, files)


def select(files: Sequence[RemoteFile], include: Sequence[str], exclude: Sequence[str]) -> list[RemoteFile]:
    """Files matching any --include glob (all when none) and no --exclude glob."""
    return list(filter_repo_objects(files, allow_patterns=list(include) or None,
                                    ignore_patterns=list(exclude) or None, key=lambda f: f.path))


def describe_hub_error(exc: Exception, repo_id: str, revision: Optional[str]) -> Optional[str]:
    """A one-line operator message for a huggingface_hub error, or None when not one of its errors."""
    if isinstance(exc, errors.GatedRepoError):
        return f"{repo_id} is gated: accept its terms on the hub and pass --token (or set HF_TOKEN)"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return f"repo {repo_id} not found on {endpoint()} (or it is private: pass --token or set HF_TOKEN)"
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"revision {revision!r} not found in {repo_id}"
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set: cannot reach the hub"
    if isinstance(exc, errors.HfHubHTTPError):
        return f"hub request failed: {str(exc).splitlines()[0]}"
    return None
