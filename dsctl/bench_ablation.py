"""`dsctl bench ablation`: SGLang's DeepSeek ablation table, measured on this machine.

Each row of dsctl/ablation_grid.py runs `python -m dsctl bench offline` with that
row's flags in its own process, one after the other, so a crash, an out-of-memory
or a start-up refusal costs only its row: the row shows ❌ with the first line of
the error (the full output is kept in OUT_DIR/logs/). Flag combinations that the
engine's launch checks refuse (EngineArgs.validate(), engine.runtime.launch_checks.check_launch: the
parallel layout against this machine and the model) are marked ❌ with their message
without starting a process (the engine would refuse them the same way at start-up). The results go to
OUT_DIR/ablation.jsonl (one line per row) and OUT_DIR/ablation.png, and the table
is printed (dsctl/ablation_report.py). With --time-budget, a row still waiting when
the budget is spent is ❌ without starting, and a running row is stopped at the budget,
so a GPU job ends on time and still prints the table.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rich.console import Console

from dsctl.ablation_grid import Row
from dsctl.flags import non_server_groups, to_argv
from engine.errors import DsctlError


@dataclass
class Settings:
    input_len: Optional[int] = None  # None: bench offline's default for the device
    output_len: Optional[int] = None
    concurrency: Optional[int] = None
    repeats: int = 1
    row_timeout: float = 1800.0
    out_dir: Path = Path("bench-ablation")
    time_budget: Optional[float] = None  # seconds for the whole grid: rows not started by then are ❌


def over_budget(index: int, row: Row, settings: Settings, spent: float) -> Optional[RowResult]:
    """A row that is not started because --time-budget is spent (❌ with that reason)."""
    if settings.time_budget is None or spent < settings.time_budget:
        return None
    return RowResult(index, row.label, dict(row.state), to_argv(row.args, non_server_groups()), runnable=False,
                     reason=f"not started: the --time-budget of {settings.time_budget:.0f} s was spent")


@dataclass
class RowResult:
    index: int
    label: str
    features: dict[str, bool]
    flags: list[str]
    runnable: bool
    reason: Optional[str] = None
    seconds: float = 0.0
    log: str = ""
    result: dict = field(default_factory=dict)  # bench offline's JSON line when runnable


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b:?")


def failure_reason(returncode: int, output: str) -> str:
    """The first line of the error a failed `dsctl` child printed: its `error: ...` line (DsctlError), else
    the exception line that ends its last traceback, else how it died."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("error: "):
            return line[len("error: "):]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        for line in lines[starts[-1] + 1:]:
            if not line.startswith(" ") and _EXCEPTION_LINE.match(line):
                return line
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return lines[-1] if lines else f"exit status {returncode}"


def row_command(row: Row, settings: Settings, result_file: Path) -> list[str]:
    cmd = [sys.executable, "-m", "dsctl", "bench", "offline", *to_argv(row.args, non_server_groups())]
    for flag, value in (("--input-len", settings.input_len), ("--output-len", settings.output_len),
                        ("--concurrency", settings.concurrency)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + ["--repeats", str(settings.repeats), "--result-file", str(result_file)]


def run_command(cmd: list[str], log: Path, timeout: float) -> tuple[int, str, bool]:
    """Run cmd with its output in `log`; (exit status, output, timed out)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            rc, timed_out = proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            proc.kill()
            rc, timed_out = proc.wait(), True
    return rc, log.read_text(errors="replace"), timed_out


def _refused(index: int, row: Row) -> Optional[RowResult]:
    """A row known not to run here (a CUDA-only feature on a CPU), or whose flags the engine would refuse at
    start-up (checked here as the engine checks them): no process needed."""
    from engine.runtime.launch_checks import check_launch, launch_args  # lazy: imports torch; keeps dsctl --help fast

    reason = row.refusal
    if reason is None:
        try:
            check_launch(launch_args(row.args.validate()))  # what `bench offline` checks before loading weights
        except DsctlError as exc:
            reason = str(exc).splitlines()[0]
    if reason is None:
        return None
    return RowResult(index, row.label, dict(row.state), to_argv(row.args, non_server_groups()), runnable=False,
                     reason=reason)


def run_row(index: int, row: Row, settings: Settings, cmd: Optional[list[str]] = None) -> RowResult:
    """Run one row in its own process (cmd overrides the `bench offline` command, for tests)."""
    logs = settings.out_dir / "logs"
    result_file = logs / f"row-{index:02d}.json"
    result_file.unlink(missing_ok=True)
    cmd = cmd or row_command(row, settings, result_file)
    t0 = time.monotonic()
    rc, output, timed_out = run_command(cmd, logs / f"row-{index:02d}.log", settings.row_timeout)
    res = RowResult(index, row.label, dict(row.state), to_argv(row.args, non_server_groups()), runnable=False,
                    seconds=time.monotonic() - t0, log=str(logs / f"row-{index:02d}.log"))
    if timed_out:
        res.reason = f"timed out after {settings.row_timeout:.0f} s"
    elif rc != 0:
        res.reason = failure_reason(rc, output)
    elif not result_file.is_file():
        res.reason = "finished without writing a result"
    else:
        res.runnable, res.result = True, json.loads(result_file.read_text().splitlines()[-1])
    return res


def run_ablation(rows: list[Row], settings: Settings) -> list[RowResult]:
    """Every row in turn, with a progress bar on stderr."""
    # lazy: rich.progress costs ~4 ms; cmd_bench imports this module at dsctl --help
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    results = []
    start = time.monotonic()
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    with progress:
        task = progress.add_task("ablation", total=len(rows))
        for i, row in enumerate(rows, 1):
            progress.update(task, description=f"row {i}/{len(rows)}: {row.label}")
            spent = time.monotonic() - start
            res = _refused(i, row) or over_budget(i, row, settings, spent)  # refusals need no time: decided first
            if res is None:
                left = settings.time_budget - spent if settings.time_budget is not None else settings.row_timeout
                res = run_row(i, row, dataclasses.replace(settings, row_timeout=min(settings.row_timeout, left)))
            results.append(res)
            progress.advance(task)
            outcome = "ok" if res.runnable else f"not runnable: {res.reason}"
            progress.console.print(f"row {i}/{len(rows)} {row.label}: {outcome} ({res.seconds:.0f} s)",
                                   markup=False, highlight=False)
    return results
