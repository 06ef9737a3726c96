"""Local checkpoint completeness check, shared by `dsctl download --verify` and the loader.

`check_checkpoint` reads only config.json, the shard index and each shard's
safetensors header (never the tensor data), so it is fast even for a 690 GB
checkpoint. It returns human-readable problems; `require_complete_checkpoint`
turns them into one `CheckpointError` that lists them all.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Optional

from safetensors import safe_open

from engine.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_LISTED_TENSORS = 20  # per shard; the rest are summarised in one line
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(header dict, file size the header implies). Raises ValueError when the header is unreadable."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("too short to hold a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise ValueError(f"header length {n} is implausible")
        raw = f.read(n)
    if len(raw) < n:
        raise ValueError(f"header cut short ({len(raw)} of {n} bytes)")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, IndexError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r} has no valid data_offsets") from None
    return header, 8 + n + end


def shard_problems(path: Path) -> tuple[list[str], Optional[set[str]]]:
    """Problems of one safetensors file, and its tensor names (None when unreadable)."""
    name = path.name
    try:
        _, expected = read_safetensors_header(path)
    except (OSError, ValueError) as exc:
        return [f"{name}: unreadable safetensors header: {exc}"], None
    size = path.stat().st_size
    if size < expected:
        return [f"{name}: truncated ({size} of {expected} bytes)"], None
    if size > expected:
        return [f"{name}: {size - expected} unexpected trailing bytes ({size} bytes, header says {expected})"], None
    try:
        with safe_open(str(path), framework="numpy") as f:
            keys = set(f.keys())
    except Exception as exc:  # safetensors raises its own error types
        return [f"{name}: unreadable by safetensors: {exc}"], None
    return [], keys


def _config_problems(ckpt: Path) -> list[str]:
    cfg = ckpt / "config.json"
    if not cfg.is_file():
        return ["config.json is missing"]
    try:
        json.loads(cfg.read_text())
    except (OSError, ValueError) as exc:
        return [f"config.json is unreadable: {exc}"]
    return []


def _load_index(ckpt: Path) -> tuple[list[str], Optional[dict[str, str]]]:
    try:
        weight_map = json.loads((ckpt / INDEX_NAME).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{INDEX_NAME} is unparseable: {type(exc).__name__}: {exc}"], None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return [f"{INDEX_NAME} has no valid weight_map (tensor name -> shard file)"], None
    return [], weight_map


def _missing_tensor_lines(shard: str, missing: list[str]) -> list[str]:
    lines = [f"{shard}: lacks tensor {t} (named in the index)" for t in missing[:MAX_LISTED_TENSORS]]
    if len(missing) > MAX_LISTED_TENSORS:
        lines.append(f"{shard}: lacks {len(missing) - MAX_LISTED_TENSORS} more tensors named in the index")
    return lines


def check_checkpoint(path) -> list[str]:
    """Every problem that stops `path` from loading; an empty list means complete."""
    ckpt = Path(path)
    if not ckpt.is_dir():
        return [f"{ckpt} is not a directory"]
    problems = _config_problems(ckpt)
    if not (ckpt / INDEX_NAME).is_file():
        if (ckpt / SINGLE_NAME).is_file():
            return problems + shard_problems(ckpt / SINGLE_NAME)[0]
        return problems + [f"{INDEX_NAME} is missing (and there is no single {SINGLE_NAME})"]
    index_problems, weight_map = _load_index(ckpt)
    if weight_map is None:
        return problems + index_problems
    by_shard: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(tensor)
    for shard in sorted(by_shard):
        file = ckpt / shard
        if not file.is_file():
            problems.append(f"{shard}: missing (named in {INDEX_NAME})")
            continue
        bad, keys = shard_problems(file)
        problems += bad
        if keys is not None:
            problems += _missing_tensor_lines(shard, sorted(t for t in by_shard[shard] if t not in keys))
    return problems


def _repo_from_cache_path(ckpt: Path) -> Optional[str]:
    """`org/name` when ckpt is a Hugging Face cache snapshot (models--org--name/snapshots/<sha>)."""
    parts = ckpt.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/", 1)
    return None


def fix_hint(ckpt: Path, model: Optional[str] = None) -> str:
    """The command that repairs ckpt (re-fetches only the bad files)."""
    cached = _repo_from_cache_path(ckpt)
    if cached is not None:
        return f"dsctl download {model or cached}"
    return f"dsctl download {model or '<model>'} --local-dir {ckpt}"


def require_complete_checkpoint(path, model: Optional[str] = None) -> None:
    """Raise CheckpointError listing every problem of the checkpoint at `path`, if any."""
    ckpt = Path(path)
    problems = check_checkpoint(ckpt)
    if not problems:
        return
    lines = [f"checkpoint {ckpt} is incomplete or damaged ({len(problems)} problem"
             f"{'s' if len(problems) > 1 else ''}):"]
    lines += [f"  - {p}" for p in problems]
    lines.append(f"fix it with: {fix_hint(ckpt, model)}")
    raise CheckpointError("\n".join(lines))
