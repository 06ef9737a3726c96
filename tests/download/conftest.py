"""Fixtures for `dsctl download` tests: a tiny sharded checkpoint served by the fake hub."""

from __future__ import annotations

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from engine.errors import DsctlError
from tests.download.fake_hub import FakeHub

REPO = "acme/tiny-moe"
SHARDS = ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
          "model-00003-of-00003.safetensors")


def _safetensors_bytes(tensors: dict) -> bytes:
    from safetensors.numpy import save

    return save(tensors, metadata={"format": "pt"})


def make_repo_files(seed: int = 0) -> dict[str, bytes]:
    """A valid 3-shard safetensors checkpoint (random weights) plus the usual small files."""
    rng = np.random.default_rng(seed)
    files: dict[str, bytes] = {}
    weight_map = {}
    for i, shard in enumerate(SHARDS):
        tensors = {f"model.layers.{i}.mlp.w{j}.weight": rng.standard_normal((64, 256 + 64 * i), dtype=np.float32)
                   for j in range(4)}
        files[shard] = _safetensors_bytes(tensors)
        weight_map.update({name: shard for name in tensors})
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=2).encode()
    files["config.json"] = json.dumps({"model_type": "deepseek_v3", "hidden_size": 64}).encode()
    files["tokenizer_config.json"] = b'{"bos_token": "<s>"}\n'
    files["README.md"] = b"# tiny test repo\n" + bytes(rng.integers(97, 123, 3000, dtype=np.uint8))
    files["sub/notes.txt"] = b"nested file\n"
    return files


@pytest.fixture
def hub(monkeypatch, tmp_path):
    from huggingface_hub import constants

    files = make_repo_files()
    server = FakeHub(REPO, files, lfs=set(SHARDS)).start()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield server
    server.stop()


class Result:
    def __init__(self, exit_code: int, output: str):
        self.exit_code, self.output = exit_code, output


def run_download(*args: str) -> Result:
    """Invoke `dsctl download ...` in-process, mapping DsctlError to its exit code like dsctl.cli.main."""
    from dsctl import cmd_download

    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        pass

    cmd_download.register(app)
    result = CliRunner().invoke(app, ["download", *args])
    if isinstance(result.exception, DsctlError):
        return Result(result.exception.exit_code, result.output + f"\nerror: {result.exception}")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Result(result.exit_code, result.output)
