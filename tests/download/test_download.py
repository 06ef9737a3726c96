"""`dsctl download` against the fake hub: faults, resume, verification, layouts, errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsctl import hub_download
from engine.checkpoint.check import check_checkpoint
from tests.download.conftest import REPO, SHARDS, run_download

FAST = ("--retry-wait", "0.01")


def repo_size(hub) -> int:
    return sum(len(d) for d in hub.files.values())


def assert_identical(hub, root: Path) -> None:
    for path, data in hub.files.items():
        assert (root / path).read_bytes() == data, path


def range_starts(hub, path: str) -> list[int]:
    return [start for p, start, status in hub.stats.gets if p == path and status in (200, 206)]


def test_survives_503s_and_cut_connections_by_resuming(hub, tmp_path):
    big = SHARDS[1]
    size = len(hub.files[big])
    cut = size * 4 // 10
    hub.faults.api_503 = 2
    hub.faults.status = {"config.json": [503, 502], SHARDS[0]: [503, 500, 503]}
    hub.faults.cuts = {big: [cut, cut, size // 10], SHARDS[2]: [1000, 50_000]}
    out = tmp_path / "out"
    r = run_download(REPO, "--local-dir", str(out), "--max-workers", "3", *FAST)
    assert r.exit_code == 0, r.output
    assert_identical(hub, out)
    # each cut resumed exactly where the previous response stopped (Range requests), never from 0
    assert range_starts(hub, big) == [0, cut, 2 * cut, 2 * cut + size // 10]
    assert hub.stats.served[big] == size
    assert hub.stats.total_served < 1.1 * repo_size(hub)
    assert not list((out / ".cache" / "dsctl" / "partial").rglob("*.incomplete"))
    assert check_checkpoint(out) == []


def test_interrupted_run_resumes_on_the_next_run(hub, tmp_path):
    big = SHARDS[2]
    size = len(hub.files[big])
    hub.faults.cuts = {big: [size // 2]}
    out = tmp_path / "out"
    first = run_download(REPO, "--local-dir", str(out), "--retries", "0", *FAST)
    assert first.exit_code != 0
    assert big in first.output and "gave up" in first.output
    assert not (out / big).exists()
    served_before = dict(hub.stats.served)
    second = run_download(REPO, "--local-dir", str(out), *FAST)
    assert second.exit_code == 0, second.output
    assert_identical(hub, out)
    # the second run fetched only the missing half of the interrupted shard and nothing else
    assert hub.stats.served[big] - served_before[big] == size - size // 2
    assert {p: n for p, n in hub.stats.served.items() if p != big} == \
        {p: n for p, n in served_before.items() if p != big}


def test_corrupted_transfer_is_detected_and_fetched_again(hub, tmp_path):
    hub.faults.corrupt_once = {SHARDS[0]}
    out = tmp_path / "out"
    r = run_download(REPO, "--local-dir", str(out), *FAST)
    assert r.exit_code == 0, r.output
    assert_identical(hub, out)
    assert hub.stats.served[SHARDS[0]] == 2 * len(hub.files[SHARDS[0]])
    assert "mismatch" in r.output


def _flip_byte(path: Path, offset: int) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x55
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # silent bit rot: same size, same mtime


def test_verify_flags_corrupted_shard_and_next_run_refetches_only_it(hub, tmp_path):
    out = tmp_path / "out"
    assert run_download(REPO, "--local-dir", str(out), *FAST).exit_code == 0
    bad = SHARDS[1]
    _flip_byte(out / bad, len(hub.files[bad]) - 7)  # in the tensor data: the header still parses
    served = dict(hub.stats.served)

    verify = run_download(REPO, "--local-dir", str(out), "--verify")
    assert verify.exit_code != 0
    error = verify.output.split("error:", 1)[1]
    assert bad in error and "sha256 mismatch" in error
    assert not any(s in error for s in (SHARDS[0], SHARDS[2], "config.json"))
    assert hub.stats.served == served  # --verify fetched no file

    again = run_download(REPO, "--local-dir", str(out), *FAST)
    assert again.exit_code == 0, again.output
    assert_identical(hub, out)
    delta = {p: hub.stats.served.get(p, 0) - served.get(p, 0) for p in hub.files}
    assert delta == {p: (len(hub.files[bad]) if p == bad else 0) for p in hub.files}
    assert run_download(REPO, "--local-dir", str(out), "--verify").exit_code == 0


def test_plain_run_notices_truncated_and_changed_files(hub, tmp_path):
    out = tmp_path / "out"
    assert run_download(REPO, "--local-dir", str(out), *FAST).exit_code == 0
    served = dict(hub.stats.served)
    with open(out / SHARDS[2], "r+b") as f:
        f.truncate(1000)
    (out / "config.json").write_bytes(b"{}" + hub.files["config.json"][2:])  # same size, new mtime
    r = run_download(REPO, "--local-dir", str(out), *FAST)
    assert r.exit_code == 0, r.output
    assert_identical(hub, out)
    refetched = {p for p in hub.files if hub.stats.served.get(p, 0) != served.get(p, 0)}
    assert refetched == {SHARDS[2], "config.json"}


def test_gives_up_after_retries_and_lists_the_file(hub, tmp_path):
    hub.faults.status = {"tokenizer_config.json": [503] * 10}
    r = run_download(REPO, "--local-dir", str(tmp_path / "out"), "--retries", "3", *FAST)
    assert r.exit_code == 1
    error = r.output.split("error:", 1)[1]
    assert "tokenizer_config.json" in error and "HTTP 503" in error
    assert f"dsctl download {REPO} --local-dir" in error
    assert [s for p, _, s in hub.stats.gets if p == "tokenizer_config.json"] == [503] * 4


def test_not_enough_disk_space_fails_before_fetching(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(hub_download, "free_bytes", lambda path: 1000)
    out = tmp_path / "out"
    r = run_download(REPO, "--local-dir", str(out), *FAST)
    assert r.exit_code != 0
    assert "not enough disk space" in r.output
    assert hub.stats.gets == []
    assert not out.exists()


def test_include_and_exclude_select_files(hub, tmp_path):
    out = tmp_path / "out"
    r = run_download(REPO, "--local-dir", str(out), "--include", "*.json", "--include", "sub/*",
                     "--exclude", "tokenizer*", *FAST)
    assert r.exit_code == 0, r.output
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and ".cache" not in p.parts)
    assert got == ["config.json", "model.safetensors.index.json", "sub/notes.txt"]


def test_default_target_is_the_hf_cache_layout(hub, tmp_path):
    from huggingface_hub import snapshot_download

    r = run_download(REPO, *FAST)
    assert r.exit_code == 0, r.output
    cache = Path(os.environ["HF_HUB_CACHE"])
    snap = Path(snapshot_download(REPO, cache_dir=cache, local_files_only=True))
    assert_identical(hub, snap)
    assert (snap / SHARDS[0]).is_symlink()
    assert check_checkpoint(snap) == []
    assert run_download(REPO, "--verify").exit_code == 0


def test_builtin_model_is_rejected(hub):
    r = run_download("tiny")
    assert r.exit_code != 0 and "built-in" in r.output
    assert hub.stats.api_calls == 0


def test_unknown_repo_is_a_clear_error(hub, tmp_path):
    r = run_download("acme/nope", "--local-dir", str(tmp_path / "x"), *FAST)
    assert r.exit_code != 0
    assert "acme/nope not found" in r.output


def test_checkpoint_problems_fail_the_download(hub, tmp_path):
    import json

    index = json.loads(hub.files["model.safetensors.index.json"])
    index["weight_map"]["model.ghost.weight"] = SHARDS[0]  # the hub's index names a tensor no shard has
    hub.files["model.safetensors.index.json"] = json.dumps(index).encode()
    r = run_download(REPO, "--local-dir", str(tmp_path / "out"), *FAST)
    assert r.exit_code == 1
    assert "model.ghost.weight" in r.output.split("error:", 1)[1]


@pytest.mark.parametrize("alias", ["deepseek-v3", "DeepSeek-R1"])
def test_alias_resolves_to_repo_id(alias):
    from dsctl.hub_repo import resolve_repo_id

    assert resolve_repo_id(alias).startswith("deepseek-ai/DeepSeek-")


def test_ctrl_c_keeps_the_partial_file_and_the_next_run_resumes(hub, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    big = SHARDS[1]
    size = len(hub.files[big])
    hub.faults.cuts = {big: [size // 3]}
    out = tmp_path / "out"
    proc = subprocess.Popen(  # the real CLI; a long backoff after the cut leaves time for Ctrl-C
        [sys.executable, "-m", "dsctl", "download", REPO, "--local-dir", str(out), "--retry-wait", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    partial = out / ".cache" / "dsctl" / "partial"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (
            [p for p in partial.glob(f"{big}.*.incomplete") if p.stat().st_size == size // 3]
            and all((out / p).is_file() for p in hub.files if p != big)):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, output
    assert "partial files are kept" in output
    assert not (out / big).exists()
    served = dict(hub.stats.served)
    r = run_download(REPO, "--local-dir", str(out), *FAST)
    assert r.exit_code == 0, r.output
    assert_identical(hub, out)
    assert hub.stats.served[big] - served[big] == size - size // 3
    assert range_starts(hub, big)[-1] == size // 3


def test_stalled_transfer_times_out_and_resumes(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "0.3")
    big = SHARDS[0]
    hub.faults.stalls = {big: [5000]}
    out = tmp_path / "out"
    r = run_download(REPO, "--local-dir", str(out), "--include", big, *FAST)
    assert r.exit_code == 0, r.output
    assert (out / big).read_bytes() == hub.files[big]
    assert "Timeout" in r.output
    assert range_starts(hub, big) == [0, 5000]


def test_permanent_http_error_is_not_retried(hub, tmp_path):
    hub.faults.status = {"README.md": [403, 403]}
    r = run_download(REPO, "--local-dir", str(tmp_path / "out"), *FAST)
    assert r.exit_code == 1
    assert "README.md: HTTP 403" in r.output.split("error:", 1)[1]
    assert [s for p, _, s in hub.stats.gets if p == "README.md"] == [403]


def test_a_file_locked_by_another_run_is_reported_not_corrupted(hub, tmp_path):
    import fcntl

    out = tmp_path / "out"
    lock = out / ".cache" / "dsctl" / "partial" / f"{SHARDS[0]}.lock"
    lock.parent.mkdir(parents=True)
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a concurrent `dsctl download` would
        r = run_download(REPO, "--local-dir", str(out), *FAST)
    assert r.exit_code == 1
    assert f"{SHARDS[0]}: another process is downloading" in r.output
    assert SHARDS[0] not in hub.stats.served
    assert run_download(REPO, "--local-dir", str(out), *FAST).exit_code == 0
    assert_identical(hub, out)
