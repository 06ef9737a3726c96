"""Resumable, retrying HTTP download of one hub file into a partial file.

huggingface_hub (2.x) downloads each file into a process-unique temporary file
that it deletes on failure, so an interrupted run starts over. Here the partial
file has a fixed name: every attempt (within a run or after Ctrl-C and a re-run)
continues from its current size with an HTTP Range request, and transient errors
(5xx, 408, 429, resets, timeouts) are retried with capped exponential backoff.
The bytes are hashed while they stream, so a finished file is verified without
reading it again.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import httpx

from dsctl.hub_repo import RemoteFile
from dsctl.hub_verify import Hasher, hash_prefix

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 20  # consecutive failed attempts without any new byte before giving up
    wait: float = 1.0  # first backoff, doubled after each failure
    max_wait: float = 60.0
    corrupt_retries: int = 2  # complete transfers whose hash is wrong, refetched from scratch

    def delay(self, failures: int, retry_after: Optional[float] = None) -> float:
        base = min(self.max_wait, self.wait * 2 ** max(failures - 1, 0))
        base *= random.uniform(0.75, 1.0)
        if retry_after is not None:
            base = max(base, min(retry_after, self.max_wait))
        return base


class TransientError(Exception):
    """Worth retrying: the next attempt resumes from the partial file."""

    def __init__(self, message: str, retry_after: Optional[float] = None):
        super().__init__(message)
        self.retry_after = retry_after


class FetchError(Exception):
    """This file cannot be fetched (permanent HTTP error, retries exhausted, hash never matches)."""


class Cancelled(Exception):
    """The run was interrupted (Ctrl-C); the partial file is kept for the next run."""


@dataclass
class Transfer:
    """Context of one file's download; `on_bytes(n)` reports progress, `on_retry(msg)` logs retries."""

    session: object  # an httpx.Client that follows redirects (make_client)
    url: str
    headers: dict
    policy: RetryPolicy
    stop: threading.Event
    on_bytes: Callable[[int], None]
    on_retry: Callable[[str], None]


def _retry_after(response) -> Optional[float]:
    try:
        return float(response.headers.get("Retry-After"))
    except (TypeError, ValueError):
        return None


def _content_range_start(response) -> Optional[int]:
    value = response.headers.get("Content-Range", "")
    try:
        return int(value.split()[1].split("-")[0])
    except (IndexError, ValueError):
        return None


def _check_status(response, have: int) -> bool:
    """True when the body continues the partial file, False when it restarts at byte 0."""
    status = response.status_code
    if status == 206:
        if _content_range_start(response) != have:
            raise TransientError(f"server answered Range {have}- with {response.headers.get('Content-Range')!r}")
        return True
    if status == 200:
        return have == 0
    response.read()
    if status == 416:
        raise TransientError("range not satisfiable: partial file is stale, restarting it")
    if status in TRANSIENT_STATUS:
        raise TransientError(f"HTTP {status}", _retry_after(response))
    raise FetchError(_http_error(response))


def _http_error(response) -> str:
    """The hub's own explanation (X-Error-Code / X-Error-Message headers) of a permanent HTTP error."""
    code, message = response.headers.get("X-Error-Code"), response.headers.get("X-Error-Message")
    hint = {401: " (pass --token or set HF_TOKEN)", 403: " (gated or private: accept the terms, check the token)"}
    text = f"HTTP {response.status_code}"
    if code or message:
        text += f" {': '.join(x for x in (code, message) if x)}"
    return text + hint.get(response.status_code, "")


def _attempt(t: Transfer, partial: Path, hasher: Hasher, received: list) -> None:
    """One GET from the partial file's size to the end; appends and hashes as it goes."""
    have = hasher.count
    headers = dict(t.headers)
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        with t.session.stream("GET", t.url, headers=headers) as response:
            if not _check_status(response, have):
                hasher.reset()
                with open(partial, "r+b") as out:
                    out.truncate(0)
                t.on_bytes(-have)  # the server ignored Range: those bytes come again
            with open(partial, "ab") as out:
                for chunk in response.iter_bytes():  # no chunk_size: a buffered tail would be lost on a cut
                    if t.stop.is_set():
                        raise Cancelled()
                    out.write(chunk)
                    hasher.update(chunk)
                    received[0] += len(chunk)
                    t.on_bytes(len(chunk))
    except httpx.TransportError as exc:
        raise TransientError(f"{type(exc).__name__}: {exc or 'connection lost'}") from None


def _sleep(t: Transfer, seconds: float) -> None:
    if t.stop.wait(seconds):
        raise Cancelled()


@contextlib.contextmanager
def exclusive(lock_path: Path):
    """Hold an advisory flock on lock_path (kept on disk), so two runs never write one file at once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        try:
            if fcntl is not None:  # not POSIX: no locking
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise FetchError("another process is downloading this file right now") from None
        yield


def download_file(t: Transfer, f: RemoteFile, partial: Path) -> None:
    """Bring `partial` to f's full size with f's digest (resuming), or raise FetchError/Cancelled.

    The caller holds `exclusive(...)` for this file."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.touch(exist_ok=True)
    hasher: Optional[Hasher] = None
    failures = corrupt = 0
    while True:
        have = partial.stat().st_size
        if hasher is None or hasher.count != have:
            hasher = hash_prefix(f, partial, have) if have <= f.size else None
        if have >= f.size:
            if hasher is not None and hasher.hexdigest() == f.digest:
                return
            corrupt += 1
            partial.write_bytes(b"")
            hasher = None
            t.on_bytes(-have)
            if corrupt > t.policy.corrupt_retries:
                raise FetchError(f"content never matched the hub's size and {f.algo} "
                                 f"after {corrupt} full transfers")
            t.on_retry(f"{f.path}: {f.algo} or size mismatch after transfer, fetching it again")
            continue
        received = [0]
        try:
            _attempt(t, partial, hasher, received)
            if hasher.count < f.size:
                raise TransientError(f"stream ended at {hasher.count} of {f.size} bytes")
        except TransientError as exc:
            failures = 1 if received[0] else failures + 1
            if failures > t.policy.retries:
                raise FetchError(f"gave up after {failures} failed attempts: {exc}") from None
            delay = t.policy.delay(failures, exc.retry_after)
            t.on_retry(f"{f.path}: {exc}; retry {failures}/{t.policy.retries} in {delay:.1f}s "
                       f"(resuming at {partial.stat().st_size} bytes)")
            _sleep(t, delay)


def make_client(connections: int):
    """An httpx client for file transfers: follows the hub's CDN redirects (dropping the token
    on the way, as httpx does across origins); read timeout HF_HUB_DOWNLOAD_TIMEOUT (default 30 s)."""
    read = float(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT") or 30)
    return httpx.Client(follow_redirects=True, timeout=httpx.Timeout(read, connect=min(read, 20.0)),
                        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))
