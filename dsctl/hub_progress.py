"""Rich progress display for downloads and verification: bytes, rate, ETA, files done.

One overall bar plus one bar per file in flight. Methods are called from worker
threads; rich's Progress is thread-safe.
"""

from __future__ import annotations

import threading

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn


class ProgressView:
    def __init__(self, console: Console, total_bytes: int, total_files: int, verb: str = "download"):
        self.console = console
        self._progress = Progress(
            TextColumn("{task.description}", justify="left"),
            BarColumn(bar_width=30),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=not console.is_terminal,  # no frozen bars in logs; the summary follows anyway
        )
        self._verb, self._files, self._done, self._failed = verb, total_files, 0, 0
        self._lock = threading.Lock()
        self._tasks: dict[str, tuple[int, bool]] = {}  # path -> (task id, is a hash check)
        self._overall = self._progress.add_task(self._overall_text(), total=total_bytes)

    def _overall_text(self) -> str:
        failed = f", {self._failed} failed" if self._failed else ""
        return f"[bold]{self._verb}[/] {self._done}/{self._files} files{failed}"

    def __enter__(self) -> "ProgressView":
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def start(self, f, have: int, checking: bool = False) -> None:
        label = f"  {'check ' if checking else ''}{escape(_short(f.path))}"
        with self._lock:
            self._tasks[f.path] = (self._progress.add_task(label, total=f.size, completed=have), checking)

    def advance(self, f, n: int) -> None:
        task, checking = self._tasks.get(f.path, (None, False))
        if task is not None:
            self._progress.advance(task, n)
        if self._verb == "verify" or not checking:  # hashing a present file transfers nothing
            self._progress.advance(self._overall, n)

    def grow(self, n: int) -> None:
        """More bytes to transfer than planned (a present file failed its check)."""
        task = self._progress.tasks[self._overall]
        self._progress.update(self._overall, total=(task.total or 0) + n)

    def done(self, f) -> None:
        with self._lock:
            task, _ = self._tasks.pop(f.path, (None, False))
        if task is not None:
            self._progress.remove_task(task)

    def file_finished(self, failed: bool) -> None:
        with self._lock:
            self._done += 1
            self._failed += int(failed)
        self._progress.update(self._overall, description=self._overall_text())

    def log(self, message: str) -> None:
        self._progress.console.print(f"[yellow]{escape(message)}[/]", highlight=False)


def _short(path: str, width: int = 48) -> str:
    return path if len(path) <= width else "…" + path[-(width - 1):]
