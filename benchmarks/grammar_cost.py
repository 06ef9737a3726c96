"""The cost of grammar-constrained decoding on a running `dsctl serve`: the same chat requests, unconstrained
and with a json_schema response format, at a fixed concurrency; TPOT (median over requests of
(end - first token) / (tokens - 1), streamed) of each, and the constrained outputs checked against the schema.

The schema forces a long, structure-heavy output (50+ objects with an integer, a bounded string, a boolean and
an enum), so every constrained request runs to max_tokens like the unconstrained ones (`ignore_eos`), and the
mask changes at nearly every token. Rounds alternate (free, json, free, json, ...) to even out drift.

    python3 benchmarks/grammar_cost.py --url http://127.0.0.1:30555 --concurrency 64 --requests 128
    python3 benchmarks/grammar_cost.py --url ... --check-only   # a few constrained requests, schema check only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx

ROW = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"},
                                        "kind": {"enum": ["a", "bb", "ccc"]}},
       "required": ["id", "name", "ok", "kind"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "items": ROW, "minItems": 50}},
          "required": ["rows"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "rows", "schema": SCHEMA, "strict": True}}


async def one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, constrained: bool) -> dict:
    body = {"messages": [{"role": "user", "content": f"Request {i}: list the rows of table {i} as JSON."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = FORMAT
    t0, first, text, tokens = time.perf_counter(), None, [], 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": str(chunk["error"])}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices", []):
                piece = c["delta"].get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return {"tpot": tpot, "tokens": tokens, "text": "".join(text), "ttft": (first or end) - t0}


async def run_round(url: str, n: int, concurrency: int, max_tokens: int, constrained: bool) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def limited(i):
            async with sem:
                return await one(client, url, i, max_tokens, constrained)
        return await asyncio.gather(*(limited(i) for i in range(n)))


def valid_prefix(text: str) -> bool:
    """The constrained output (cut off at max_tokens) starts a document the schema accepts: the object and
    its rows array open, and every complete row is valid."""
    if not text.startswith('{"rows": ['):
        return False
    # strict=False: xgrammar lets raw control characters into JSON strings (a random model writes them)
    body, rows, at, decoder = text[len('{"rows": ['):], [], 0, json.JSONDecoder(strict=False)
    while True:
        try:
            row, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            break  # the row cut off by max_tokens
        rows.append(row)
        at += len(", ") if body.startswith(", ", at) else 0
    for row in rows:
        if set(row) != set(ROW["required"]) or not (0 <= row["id"] <= 999) or row["kind"] not in ("a", "bb", "ccc") \
                or not isinstance(row["ok"], bool) or len(row["name"]) > 12:
            return False
    return True


def summary(name: str, results: list[dict]) -> tuple[float, int]:
    bad = [r["error"] for r in results if "error" in r]
    tpots = [r["tpot"] for r in results if r.get("tpot") is not None]
    med = statistics.median(tpots) if tpots else float("nan")
    print(f"{name:>5}: {len(results) - len(bad)} ok / {len(bad)} failed, tokens/request "
          f"{statistics.mean(r.get('tokens', 0) for r in results):.0f}, TPOT median {med * 1e3:.2f} ms, "
          f"p90 {statistics.quantiles(tpots, n=10)[-1] * 1e3 if len(tpots) > 1 else float('nan'):.2f} ms")
    for e in bad[:3]:
        print("   ", e)
    return med, len(bad)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:30555")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128, help="per round")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="pairs of (free, json) rounds")
    ap.add_argument("--check-only", action="store_true", help="8 constrained requests, validity only")
    a = ap.parse_args()
    if a.check_only:
        res = asyncio.run(run_round(a.url, 8, 8, 96, True))
        ok = [valid_prefix(r.get("text", "")) for r in res]
        print(f"json_schema outputs valid: {sum(ok)} / {len(ok)}; first: {res[0].get('text', res[0])[:160]!r}")
        return 0 if all(ok) else 1
    for constrained_warmup in (True, False):  # warm-up: compiles the schema, fills every graph batch size once
        asyncio.run(run_round(a.url, a.concurrency, a.concurrency, 16, constrained_warmup))
    free, constrained = [], []
    for _ in range(a.rounds):
        free += asyncio.run(run_round(a.url, a.requests, a.concurrency, a.max_tokens, False))
        constrained += asyncio.run(run_round(a.url, a.requests, a.concurrency, a.max_tokens, True))
    f, fbad = summary("free", free)
    c, cbad = summary("json", constrained)
    invalid = [r.get("text", r) for r in constrained if not valid_prefix(r.get("text", ""))]
    print(f"json_schema outputs valid: {len(constrained) - len(invalid)} / {len(constrained)}")
    for text in invalid[:2]:
        print(f"  invalid: {str(text)[:300]!r}")
    print(f"grammar cost: TPOT json / free = {c / f:.4f} ({(c / f - 1) * 100:+.2f}%; target <= +5%)")
    return 0 if not (fbad or cbad or invalid) else 1


if __name__ == "__main__":
    sys.exit(main())
