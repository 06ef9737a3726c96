"""Benchmark prompts: random (fixed or ranged lengths), ShareGPT conversations, or a JSONL file.

Each request carries its prompt, the number of prompt tokens asked for (exact for
token-id prompts, tokenizer count or estimate for text; the server's usage field
is what the results report) and the number of tokens to ask for (max_tokens).
Random prompts of exact lengths are made in random_prompts.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from dsctl.bench_serving.random_prompts import PromptForm, lengths, random_prompts
from dsctl.bench_serving.tokens import TokenCounter, estimate_tokens
from engine.errors import UsageError


@dataclass(frozen=True)
class BenchRequest:
    prompt: Union[str, list[int]]  # text, or token ids (random dataset on /v1/completions)
    prompt_len: int  # tokens asked for (random) or counted by the tokenizer / estimated (files)
    output_len: int  # max_tokens


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    tok: Optional[TokenCounter], form: PromptForm = "words",
                    add_special_tokens: bool = True) -> list[BenchRequest]:
    """Random prompts; lengths uniform in [len * range_ratio, len] (ratio 1: exactly len).

    form: "ids" (token ids, exact), "text" (tokenizer-verified text; add_special_tokens: count the
    BOS the server adds, as /v1/completions does) or "words" (no tokenizer; approximate).
    """
    rng = np.random.default_rng(seed)
    in_lens = lengths(rng, n, input_len, range_ratio)
    out_lens = lengths(rng, n, output_len, range_ratio)
    prompts = random_prompts(rng, in_lens, form, tok, add_special_tokens)
    return [BenchRequest(p, int(i), int(o)) for p, i, o in zip(prompts, in_lens, out_lens)]


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
                  sharegpt_output_len: Optional[int] = None, form: PromptForm = "words",
                  add_special_tokens: bool = True) -> list[BenchRequest]:
    if dataset == "random":
        return random_requests(n, input_len, output_len, range_ratio, seed, tok, form, add_special_tokens)
    if path is None:
        raise UsageError(f"--dataset {dataset} needs --dataset-path")
    if dataset == "sharegpt":
        return sharegpt_requests(path, n, seed, tok, sharegpt_output_len)
    if dataset == "jsonl":
        return jsonl_requests(path, n, seed, tok)
    raise UsageError(f"unknown --dataset {dataset!r} (random, sharegpt or jsonl)")
