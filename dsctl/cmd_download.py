"""`dsctl download MODEL`: fetch a checkpoint from the hub, resumably, and verify it.

MODEL is a registry alias (`deepseek-v3`, see `dsctl models`) or any org/name
repo id. The logic lives in dsctl/hub_download.py; this module only parses flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

HELP = (
    "Download a model from the Hugging Face hub (resumable, retried, verified).\n\n"
    "Interrupted downloads resume where they stopped; transient errors are retried with backoff. "
    "Every file is checked against the hub's size and sha256 (LFS) or git hash, and the safetensors "
    "checkpoint against model.safetensors.index.json. A failed check exits non-zero listing each bad "
    "file; the next plain run re-fetches only those.\n\n"
    "Without --local-dir the files go to the Hugging Face cache (HF_HOME / HF_HUB_CACHE), where "
    "`dsctl serve --model MODEL` finds them. Honours HF_ENDPOINT and HF_TOKEN."
)


def download_command(
    model: str = typer.Argument(..., help="Registry alias (see `dsctl models`) or an org/name hub repo id."),
    revision: Optional[str] = typer.Option(None, "--revision", "-r", help="Branch, tag or commit (default: main)."),
    local_dir: Optional[Path] = typer.Option(None, "--local-dir", help="Put the files here instead of the HF cache."),
    include: List[str] = typer.Option([], "--include", help="Only files matching this glob (repeatable)."),
    exclude: List[str] = typer.Option([], "--exclude", help="Skip files matching this glob (repeatable)."),
    max_workers: int = typer.Option(8, "--max-workers", min=1, help="Files fetched in parallel."),
    token: Optional[str] = typer.Option(None, "--token", help="Hub token (default: HF_TOKEN or the saved login)."),
    verify: bool = typer.Option(False, "--verify", help="Fetch nothing: re-hash every local file against the hub."),
    retries: int = typer.Option(20, "--retries", min=0,
                                help="Consecutive failed attempts (no new byte) before a file is given up."),
    retry_wait: float = typer.Option(1.0, "--retry-wait", min=0.0,
                                     help="First backoff in seconds; doubles per failure, capped at 60."),
) -> None:
    from dsctl import hub_download, hub_fetch, hub_repo  # lazy: huggingface_hub and httpx; keeps dsctl --help fast

    req = hub_download.DownloadRequest(
        model=model, repo_id=hub_repo.resolve_repo_id(model), revision=revision, local_dir=local_dir,
        include=tuple(include), exclude=tuple(exclude), max_workers=max_workers, token=token,
        policy=hub_fetch.RetryPolicy(retries=retries, wait=retry_wait),
    )
    console = Console(highlight=False)
    if verify:
        hub_download.report_or_raise(hub_download.verify(req, console), req, console, "verify")
    else:
        try:
            report = hub_download.download(req, console)
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: partial files are kept; run the same command to resume[/]")
            raise
        hub_download.report_or_raise(report, req, console, "download")


def register(app: typer.Typer) -> None:
    app.command("download", help=HELP)(download_command)
