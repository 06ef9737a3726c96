"""Benchmark prompts: random (fixed or ranged lengths), ShareGPT conversations, or a JSONL file.

Each request carries its prompt, the number of prompt tokens (tokenizer count or
estimate; the server's usage field wins when it reports one) and the number of
tokens to ask for (max_tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from dsctl.bench_serving.tokens import TokenCounter, estimate_tokens
from engine.errors import UsageError

# Without a tokenizer, random prompts are made of common words (about one token each).
_WORDS = ("the of and to in is was for on are with as by at from that this have one which you were his her "
          "they had not but what all when there can more some time into them two then other about many out "
          "these so would make like him has look write see number way could people than first water been call "
          "who oil its now find long down day did get come made may part over new sound take only little work "
          "know place year live back give most very after thing our just name good sentence man think say great "
          "where help through much before line right too mean old any same tell boy follow came want show also "
          "around form three small set put end does another well large must big even such because turn here why "
          "ask went men read need land different home us move try kind hand picture again change off play spell "
          "air away animal house point page letter mother answer found study still learn should world").split()


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int


def _lengths(rng, n: int, length: int, ratio: float) -> np.ndarray:
    low = max(1, int(length * ratio))
    return rng.integers(low, max(low, length) + 1, size=n)


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    tok: Optional[TokenCounter]) -> list[BenchRequest]:
    """Prompts of random tokens; lengths uniform in [len * range_ratio, len] (ratio 1: exactly len)."""
    if not 0.0 <= range_ratio <= 1.0:
        raise UsageError("--random-range-ratio must be within [0, 1]")
    rng = np.random.default_rng(seed)
    in_lens, out_lens = _lengths(rng, n, input_len, range_ratio), _lengths(rng, n, output_len, range_ratio)
    out = []
    for i in range(n):
        if tok is not None:
            ids = rng.integers(0, tok.vocab_size, size=int(in_lens[i])).tolist()
            prompt = tok.decode(ids)
            plen = tok.count(prompt)
        else:
            prompt = " ".join(rng.choice(_WORDS, size=int(in_lens[i])).tolist())
            plen = int(in_lens[i])
        out.append(BenchRequest(prompt, plen, int(out_lens[i])))
    return out


def _count(text: str, tok: Optional[TokenCounter]) -> int:
    return tok.count(text) if tok is not None else estimate_tokens(text)


def _pick(items: list[BenchRequest], n: int, seed: int, what: str) -> list[BenchRequest]:
    if not items:
        raise UsageError(f"{what} has no usable entry")
    order = np.random.default_rng(seed).permutation(len(items))
    return [items[order[i % len(items)]] for i in range(n)]


def sharegpt_requests(path: Path, n: int, seed: int, tok: Optional[TokenCounter],
                      output_len: Optional[int] = None) -> list[BenchRequest]:
    """First human turn as the prompt; the reply's length as max_tokens (unless output_len is given)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read ShareGPT file {path}: {exc}") from None
    items = []
    for entry in data if isinstance(data, list) else []:
        turns = (entry.get("conversations") or entry.get("conversation") or []) if isinstance(entry, dict) else []
        if len(turns) < 2 or not all(isinstance(t, dict) and "value" in t for t in turns[:2]):
            continue
        prompt, reply = str(turns[0]["value"]), str(turns[1]["value"])
        plen, olen = _count(prompt, tok), output_len or _count(reply, tok)
        if plen >= 4 and olen >= 4:
            items.append(BenchRequest(prompt, plen, olen))
    return _pick(items, n, seed, f"ShareGPT file {path}")


def jsonl_requests(path: Path, n: int, seed: int, tok: Optional[TokenCounter]) -> list[BenchRequest]:
    """One JSON object per line: {"prompt": str, "output_len": int}."""
    items = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompt, olen = str(obj["prompt"]), int(obj["output_len"])
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{path}:{number}: expected {{\"prompt\": str, \"output_len\": int}}") from None
        items.append(BenchRequest(prompt, _count(prompt, tok), olen))
    return _pick(items, n, seed, str(path))


def load_requests(dataset: str, path: Optional[Path], n: int, input_len: int, output_len: int,
                  range_ratio: float, seed: int, tok: Optional[TokenCounter],
                  sharegpt_output_len: Optional[int] = None) -> list[BenchRequest]:
    if dataset == "random":
        return random_requests(n, input_len, output_len, range_ratio, seed, tok)
    if path is None:
        raise UsageError(f"--dataset {dataset} needs --dataset-path")
    if dataset == "sharegpt":
        return sharegpt_requests(path, n, seed, tok, sharegpt_output_len)
    if dataset == "jsonl":
        return jsonl_requests(path, n, seed, tok)
    raise UsageError(f"unknown --dataset {dataset!r} (random, sharegpt or jsonl)")
