"""engine.checkpoint.check: the local checkpoint completeness check shared with the loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.checkpoint.check import check_checkpoint, require_complete_checkpoint
from engine.errors import CheckpointError
from tests.download.conftest import SHARDS, make_repo_files


@pytest.fixture
def ckpt(tmp_path) -> Path:
    for path, data in make_repo_files(seed=3).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    return tmp_path


def test_complete_checkpoint_has_no_problems(ckpt):
    assert check_checkpoint(ckpt) == []
    require_complete_checkpoint(ckpt)


def test_single_file_checkpoint_without_index_is_valid(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text("{}")
    save_file({"w": np.random.default_rng(0).standard_normal((3, 5), dtype=np.float32)},
              str(tmp_path / "model.safetensors"))
    assert check_checkpoint(tmp_path) == []
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(tmp_path.joinpath("model.safetensors").stat().st_size - 4)
    assert [p for p in check_checkpoint(tmp_path) if "model.safetensors: truncated" in p]


def test_every_problem_is_listed(ckpt):
    (ckpt / "config.json").unlink()
    (ckpt / SHARDS[0]).unlink()
    size = (ckpt / SHARDS[1]).stat().st_size
    with open(ckpt / SHARDS[1], "r+b") as f:
        f.truncate(size - 100)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = SHARDS[2]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    problems = check_checkpoint(ckpt)
    assert problems == [
        "config.json is missing",
        f"{SHARDS[0]}: missing (named in model.safetensors.index.json)",
        f"{SHARDS[1]}: truncated ({size - 100} of {size} bytes)",
        f"{SHARDS[2]}: lacks tensor model.extra.weight (named in the index)",
    ]
    with pytest.raises(CheckpointError) as err:
        require_complete_checkpoint(ckpt)
    lines = str(err.value).splitlines()
    assert "4 problems" in lines[0]
    assert [line.strip("- ").strip() for line in lines[1:5]] == problems
    assert lines[-1].endswith(f"dsctl download <model> --local-dir {ckpt}")


def test_unreadable_header_and_bad_index(ckpt):
    (ckpt / SHARDS[2]).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    assert any(p.startswith(f"{SHARDS[2]}: unreadable safetensors header") for p in check_checkpoint(ckpt))
    (ckpt / "model.safetensors.index.json").write_text("{broken")
    problems = check_checkpoint(ckpt)
    assert len(problems) == 1 and "model.safetensors.index.json is unparseable" in problems[0]


def test_missing_index_and_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert check_checkpoint(tmp_path) == [
        "model.safetensors.index.json is missing (and there is no single model.safetensors)"]
    assert check_checkpoint(tmp_path / "nope") == [f"{tmp_path / 'nope'} is not a directory"]


def test_fix_hint_names_the_repo_for_hf_cache_snapshots(tmp_path):
    snap = tmp_path / "models--deepseek-ai--DeepSeek-V3" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    with pytest.raises(CheckpointError) as err:
        require_complete_checkpoint(snap)
    assert str(err.value).splitlines()[-1].endswith("dsctl download deepseek-ai/DeepSeek-V3")
