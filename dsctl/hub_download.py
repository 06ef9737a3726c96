"""`dsctl download` and `dsctl download --verify`: plan, fetch in parallel, verify, report.

A plain run lists the repo at one commit, skips files already verified, hashes
files that are present but not yet verified, fetches the rest (resuming partial
files, see hub_fetch), checks the safetensors checkpoint as a whole, and fails
listing every bad file. The next plain run re-fetches only those. `--verify`
fetches nothing: it re-hashes every local file against the hub.
"""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from huggingface_hub import hf_hub_url
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import build_hf_headers
from rich.console import Console
from rich.filesize import decimal as human
from rich.markup import escape
from rich.table import Table

import dsctl
from dsctl.hub_fetch import (
    TRANSIENT_STATUS,
    Cancelled,
    FetchError,
    RetryPolicy,
    Transfer,
    download_file,
    exclusive,
    make_client,
)
from dsctl.hub_layout import make_layout
from dsctl.hub_progress import ProgressView
from dsctl.hub_repo import HubError, RemoteFile, RepoListing, describe_hub_error, endpoint, list_repo, select
from dsctl.hub_verify import VerifiedRecord, file_matches
from engine.checkpoint.check import check_checkpoint
from engine.errors import DsctlError, UsageError


class DownloadFailed(DsctlError):
    """Some files are missing or wrong after the run (listed one per line)."""

    exit_code = 1


@dataclass
class DownloadRequest:
    model: str  # as typed, for messages
    repo_id: str
    revision: Optional[str] = None
    local_dir: Optional[Path] = None
    cache_dir: Optional[Path] = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    max_workers: int = 8
    token: Optional[str] = None
    policy: RetryPolicy = field(default_factory=RetryPolicy)

    def rerun_command(self) -> str:
        cmd = f"dsctl download {self.model}"
        if self.revision:
            cmd += f" --revision {self.revision}"
        if self.local_dir is not None:
            cmd += f" --local-dir {self.local_dir}"
        return cmd


@dataclass
class Outcome:
    file: RemoteFile
    status: str  # present | checked | downloaded | failed
    error: str = ""


@dataclass
class Report:
    listing: RepoListing
    root: Path
    outcomes: list[Outcome]
    fetched_bytes: int
    seconds: float
    checkpoint_problems: list[str]

    @property
    def bad(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "failed"]


def free_bytes(path: Path) -> int:
    """Free space on the filesystem that holds `path` (or its nearest existing parent)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _is_transport_error(exc: Exception) -> bool:
    """A network-level failure from whichever HTTP library this huggingface_hub uses."""
    for cls in type(exc).__mro__:
        root = cls.__module__.split(".")[0]
        if root in ("httpx", "httpx2") and cls.__name__ == "TransportError":
            return True
        if root == "requests" and cls.__name__ in ("ConnectionError", "Timeout"):
            return True
    return False


def _transient(exc: Exception) -> tuple[bool, Optional[float]]:
    if _is_transport_error(exc):
        return True, None
    response = getattr(exc, "response", None)
    if isinstance(exc, HfHubHTTPError) and response is not None and response.status_code in TRANSIENT_STATUS:
        try:
            return True, float(response.headers.get("Retry-After"))
        except (TypeError, ValueError):
            return True, None
    return False, None


# First contact with the hub (no API call has answered yet): an unknown host name or a refused / timed-out
# connection is almost always no network, a firewall or a wrong HF_ENDPOINT, which minutes of retries will
# not fix. A few quick tries within a short budget, then HubUnreachable says what to check. Once the hub
# has answered, connection errors get the full --retries (and file transfers always do: hub_fetch).
FIRST_CONTACT_TRIES = 3
FIRST_CONTACT_BUDGET_S = 20.0


class HubUnreachable(HubError):
    """No connection to the hub could be opened on the first contact."""


def _is_connect_error(exc: Exception) -> bool:
    """No connection could be opened (unknown host, refused, connect timeout, proxy): nothing reached the hub."""
    for cls in type(exc).__mro__:
        root = cls.__module__.split(".")[0]
        if root in ("httpx", "httpx2") and cls.__name__ in ("ConnectError", "ConnectTimeout", "ProxyError"):
            return True
        if root == "requests" and cls.__name__ == "ConnectionError":  # also its ConnectTimeout, ProxyError
            return True
    return False


def unreachable_message(exc: Exception) -> str:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return (f"cannot reach the hub at {endpoint()} ({reason}): check the network (DNS, proxy, firewall); "
            "if the hub is blocked here, set HF_ENDPOINT to a mirror you can reach; models already downloaded "
            "need no hub (HF_HUB_OFFLINE=1)")


def _api_caller(policy: RetryPolicy, log: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep) -> Callable:
    """Wrap hub API calls: transient errors retried with backoff (policy), except connection failures before
    the hub has answered once (see FIRST_CONTACT_TRIES)."""
    answered = False
    start: Optional[float] = None

    def call(fn):
        nonlocal answered, start
        failures = 0
        if start is None:
            start = clock()
        while True:
            try:
                out = fn()
            except Exception as exc:
                transient, retry_after = _transient(exc)
                failures += 1
                if not transient or failures > policy.retries:
                    raise
                delay = policy.delay(failures, retry_after)
                tries = policy.retries
                if not answered and _is_connect_error(exc):
                    if failures >= FIRST_CONTACT_TRIES or clock() - start + delay > FIRST_CONTACT_BUDGET_S:
                        raise HubUnreachable(unreachable_message(exc)) from None
                    tries = min(tries, FIRST_CONTACT_TRIES - 1)
                log(f"hub API: {str(exc).splitlines()[0] or type(exc).__name__}; retry {failures}/{tries} in "
                    f"{delay:.1f}s")
                sleep(delay)
            else:
                answered = True
                return out

    return call


def fetch_listing(req: DownloadRequest, console: Console) -> tuple[RepoListing, tuple[RemoteFile, ...]]:
    """The repo at one commit (all its files) and the files selected by --include/--exclude."""
    log = lambda msg: console.print(f"[yellow]{escape(msg)}[/]")  # noqa: E731
    try:
        listing = list_repo(req.repo_id, req.revision, req.token, call=_api_caller(req.policy, log))
    except HubUnreachable:
        raise
    except Exception as exc:
        msg = describe_hub_error(exc, req.repo_id, req.revision)
        if msg is None:
            if _is_connect_error(exc):
                raise HubUnreachable(unreachable_message(exc)) from None
            if not _transient(exc)[0]:
                raise
            msg = f"cannot reach the hub for {req.repo_id}: {exc}"
        raise HubError(msg) from None
    files = tuple(select(listing.files, req.include, req.exclude))
    if not files:
        raise UsageError(f"no file of {req.repo_id}@{listing.revision} matches --include/--exclude")
    return listing, files


def _weights_selected(all_files: tuple[RemoteFile, ...], selected: tuple[RemoteFile, ...]) -> bool:
    """True when the selection holds the whole safetensors checkpoint (config, index, every shard)."""
    chosen = {f.path for f in selected}
    needed = {f.path for f in all_files
              if f.path.endswith(".safetensors") and "/" not in f.path
              or f.path in ("config.json", "model.safetensors.index.json")}
    return any(p.endswith(".safetensors") for p in needed) and needed <= chosen


class _Runner:
    """Executes one plan: per-file work on a thread pool, progress, the verified record."""

    def __init__(self, req: DownloadRequest, listing: RepoListing, layout, record: VerifiedRecord,
                 view: ProgressView):
        self.req, self.listing, self.layout, self.view = req, listing, layout, view
        self.record = record
        self.stop = threading.Event()
        self._url = lambda f: hf_hub_url(listing.repo_id, f.path, revision=listing.commit, endpoint=endpoint())
        headers = build_hf_headers(token=req.token, library_name="dsctl", library_version=dsctl.__version__)
        self.headers = {**headers, "Accept-Encoding": "identity"}
        self.session = make_client(2 * max(1, req.max_workers))
        self.fetched = 0
        self._lock = threading.Lock()

    def _count(self, f: RemoteFile, n: int) -> None:
        if self.stop.is_set():
            raise Cancelled()
        if n > 0:  # negative n: bytes thrown away (corrupt transfer); they were transferred all the same
            with self._lock:
                self.fetched += n
        self.view.advance(f, n)

    def fetch(self, f: RemoteFile) -> Outcome:
        partial = self.layout.partial_path(f)
        t = Transfer(self.session, self._url(f), self.headers, self.req.policy, self.stop,
                     on_bytes=lambda n: self._count(f, n), on_retry=self.view.log)
        try:
            with exclusive(self.layout.lock_path(f)):
                self.view.start(f, partial.stat().st_size if partial.is_file() else 0)
                try:
                    download_file(t, f, partial)
                finally:
                    self.view.done(f)
                self.layout.install(f, partial)
        except FetchError as exc:
            return Outcome(f, "failed", str(exc))
        self.record.mark(f, self.layout.data_path(f), ok=True)
        return Outcome(f, "downloaded")

    def check_then_fetch(self, f: RemoteFile) -> Outcome:
        """A present but unverified file: keep it if its hash matches, else fetch it again."""
        data = self.layout.data_path(f)
        self.view.start(f, 0, checking=True)
        try:
            problem = file_matches(f, data, on_bytes=lambda n: self._check_progress(f, n))
        finally:
            self.view.done(f)
        if problem is None:
            self.record.mark(f, data, ok=True)
            self.layout.link(f)
            return Outcome(f, "checked")
        self.view.log(f"{f.path}: {problem}; fetching it again")
        self.record.mark(f, data, ok=False)
        self.layout.remove(f)
        self.view.grow(f.size)
        return self.fetch(f)

    def _check_progress(self, f: RemoteFile, n: int) -> None:
        if self.stop.is_set():
            raise Cancelled()
        self.view.advance(f, n)

    def run(self, work: list[tuple[Callable, RemoteFile]]) -> list[Outcome]:
        try:
            return _run_pool(self.req.max_workers, work, self.view, self.stop)
        finally:
            self.session.close()


def _run_pool(workers: int, work, view: ProgressView, stop: threading.Event) -> list[Outcome]:
    """Run fn(f) for each (fn, f) on a thread pool; on Ctrl-C, stop the workers and re-raise."""
    outcomes: list[Outcome] = []
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="dsctl-dl")
    try:
        futures = [pool.submit(fn, f) for fn, f in work]
        for fut in as_completed(futures):
            outcome = fut.result()
            outcomes.append(outcome)
            view.file_finished(outcome.status == "failed")
    except BaseException:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return outcomes


@dataclass
class Plan:
    present: list[RemoteFile] = field(default_factory=list)  # verified before, unchanged since
    to_check: list[RemoteFile] = field(default_factory=list)  # right size, never hashed
    to_fetch: list[RemoteFile] = field(default_factory=list)
    need: int = 0  # bytes still to transfer (partial files count as had)


def make_plan(files, layout, record: VerifiedRecord) -> Plan:
    plan = Plan()
    for f in files:
        data = layout.data_path(f)
        if record.is_verified(f, data):
            plan.present.append(f)
        elif data.is_file() and data.stat().st_size == f.size:
            plan.to_check.append(f)
        else:
            plan.to_fetch.append(f)
            partial = layout.partial_path(f)
            have = partial.stat().st_size if partial.is_file() else 0
            plan.need += f.size - (have if have <= f.size else 0)
    return plan


def _checkpoint_problems(listing: RepoListing, files, root: Path, outcomes: list[Outcome]) -> list[str]:
    if any(o.status == "failed" for o in outcomes) or not _weights_selected(listing.files, files):
        return []
    return check_checkpoint(root)


def download(req: DownloadRequest, console: Console) -> Report:
    """Fetch what is missing or wrong, verify everything; the caller reports (see report_or_raise)."""
    start = time.monotonic()
    listing, files = fetch_listing(req, console)
    layout = make_layout(req.repo_id, listing.revision, listing.commit, req.local_dir, req.cache_dir)
    record = VerifiedRecord(layout.record_path)
    plan = make_plan(files, layout, record)
    free = free_bytes(layout.space_dir)
    if plan.need > free:
        raise DsctlError(f"not enough disk space for {req.repo_id}: {human(plan.need)} still to download "
                         f"({len(plan.to_fetch)} files) but only {human(free)} free at {layout.space_dir}")
    layout.prepare()
    for f in plan.present:
        layout.link(f)
    console.print(f"{listing.repo_id} @ {listing.commit[:12]} -> {escape(str(layout.root))}\n"
                  f"{len(files)} files, {human(sum(f.size for f in files))}: {len(plan.present)} already verified, "
                  f"{len(plan.to_check)} to check, {len(plan.to_fetch)} to download ({human(plan.need)})")
    for f in plan.to_fetch:
        layout.remove(f)
    with ProgressView(console, plan.need, len(plan.to_check) + len(plan.to_fetch)) as view:
        runner = _Runner(req, listing, layout, record, view)
        work = [(runner.check_then_fetch, f) for f in plan.to_check] + [(runner.fetch, f) for f in plan.to_fetch]
        outcomes = [Outcome(f, "present") for f in plan.present] + runner.run(work)
    problems = _checkpoint_problems(listing, files, layout.root, outcomes)
    return Report(listing, layout.root, outcomes, runner.fetched, time.monotonic() - start, problems)


def verify(req: DownloadRequest, console: Console) -> Report:
    """Re-hash every selected local file against the hub (fetches nothing)."""
    start = time.monotonic()
    listing, files = fetch_listing(req, console)
    layout = make_layout(req.repo_id, listing.revision, listing.commit, req.local_dir, req.cache_dir)
    record = VerifiedRecord(layout.record_path)
    console.print(f"verifying {len(files)} files of {listing.repo_id} @ {listing.commit[:12]} "
                  f"in {escape(str(layout.root))}")
    stop = threading.Event()

    def progress(f: RemoteFile, n: int) -> None:
        if stop.is_set():
            raise Cancelled()
        view.advance(f, n)

    def check(f: RemoteFile) -> Outcome:
        path = layout.root / f.path  # through the snapshot link in the cache layout
        view.start(f, 0, checking=True)
        try:
            problem = file_matches(f, path, on_bytes=lambda n: progress(f, n))
        finally:
            view.done(f)
        record.mark(f, path, ok=problem is None)
        return Outcome(f, "checked") if problem is None else Outcome(f, "failed", problem)

    with ProgressView(console, sum(f.size for f in files), len(files), verb="verify") as view:
        outcomes = _run_pool(req.max_workers, [(check, f) for f in files], view, stop)
    problems = _checkpoint_problems(listing, files, layout.root, outcomes)
    return Report(listing, layout.root, outcomes, 0, time.monotonic() - start, problems)


def print_summary(report: Report, console: Console, verb: str) -> None:
    counts = {s: sum(o.status == s for o in report.outcomes) for s in ("present", "checked", "downloaded", "failed")}
    table = Table(title=f"{verb} summary", show_header=False, title_justify="left")
    table.add_row("repo", f"{report.listing.repo_id} @ {report.listing.commit}")
    table.add_row("directory", escape(str(report.root)))
    table.add_row("files", f"{len(report.outcomes)} ({counts['present']} already verified, {counts['checked']} "
                           f"checked, {counts['downloaded']} downloaded, {counts['failed']} bad)")
    rate = report.fetched_bytes / report.seconds if report.seconds > 0 else 0.0
    table.add_row("transferred", f"{human(report.fetched_bytes)} in {report.seconds:.1f}s ({human(int(rate))}/s)")
    ok = not report.bad and not report.checkpoint_problems
    table.add_row("result", "[green]OK[/]" if ok else "[red]FAILED[/]")
    console.print(table)


def report_or_raise(report: Report, req: DownloadRequest, console: Console, verb: str) -> None:
    """Print the summary; raise DownloadFailed listing every bad file and checkpoint problem."""
    print_summary(report, console, verb)
    bad = sorted(report.bad, key=lambda o: o.file.path)
    if not bad and not report.checkpoint_problems:
        return
    lines = [f"{verb} of {report.listing.repo_id} failed: {len(bad)} bad file(s), "
             f"{len(report.checkpoint_problems)} checkpoint problem(s)"]
    lines += [f"  - {o.file.path}: {o.error}" for o in bad]
    lines += [f"  - checkpoint: {p}" for p in report.checkpoint_problems]
    lines.append(f"run `{req.rerun_command()}` to fetch only the bad files again")
    raise DownloadFailed("\n".join(lines))
