"""Decode attention time in a `dsctl bench one-batch --profile` trace (torch profiler, chrome JSON).

    dsctl bench one-batch --model deepseek-v3 --load-format dummy --num-layers 5 --batch-size 32 \\
        --input-len 4096 --output-len 12 --attention-backend triton --profile /tmp/prof-triton
    python3 benchmarks/attention_time.py /tmp/prof-triton-bs32-in4096-out12.json --num-layers 5

The decode steps are what follows the prefill's last Triton extend-attention kernel (so: runs with
--attention-backend triton or flashinfer-decode, whose prefill attention is Triton's; with 'flashinfer' the
prefill's attention kernels have the decode's names). Their attention kernels (dsctl's Triton MLA decode stages,
FlashInfer's MLA kernel) are merged into busy intervals before summing, because the Triton decode's second stage
starts early under programmatic dependent launch and waits for the first (summing the two kernels' durations
would count that wait twice). Prints the attention time per decode step and per layer.
"""

from __future__ import annotations

import argparse
import json
import re

DECODE_ATTENTION = re.compile(r"_mla_decode_stage|BatchMLAPage|mla::hopper|BatchDecodeWithPagedKVCache")
EXTEND_ATTENTION = re.compile(r"_extend_fwd")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (µs)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def trace_events(path: str) -> list[dict]:
    """A chrome trace's events (a bare list, or under "traceEvents")."""
    with open(path) as f:
        events = json.load(f)
    return events["traceEvents"] if isinstance(events, dict) else events


def trace_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of the scripts that read one-batch traces: the traces, --num-layers, --decode-steps."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--num-layers", type=int, required=True, help="the model's layers in the run")
    ap.add_argument("--decode-steps", type=int, default=0,
                    help="decode steps in the trace (default: --output-len - 1, read from the file name)")
    return ap


def decode_steps(ap: argparse.ArgumentParser, path: str, given: int) -> int:
    """`given`, else the trace's --output-len - 1 from its file name (`-outN`, as `bench one-batch` names it)."""
    if given:
        return given
    m = re.search(r"-out(\d+)", path)
    if m is None:
        ap.error(f"{path}: give --decode-steps (no -outN in the file name)")
    return int(m.group(1)) - 1


def decode_attention(path: str) -> dict:
    events = trace_events(path)
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    prefill_end = max((e["ts"] + e["dur"] for e in kernels if EXTEND_ATTENTION.search(e["name"])), default=0.0)
    decode = [e for e in kernels if e["ts"] >= prefill_end]
    attention = [e for e in decode if DECODE_ATTENTION.search(e["name"])]
    return dict(attention_us=busy_us([(e["ts"], e["ts"] + e["dur"]) for e in attention]),
                calls=len(attention), names=sorted({e["name"][:60] for e in attention}))


def main() -> int:
    ap = trace_parser(__doc__.split("\n")[0])
    args = ap.parse_args()
    for path in args.traces:
        steps = decode_steps(ap, path, args.decode_steps)
        r = decode_attention(path)
        print(f"{path}: attention {r['attention_us'] / steps / 1e3:.3f} ms per decode step, "
              f"{r['attention_us'] / steps / args.num_layers:.0f} us per layer ({r['calls']} kernels: "
              f"{', '.join(r['names'])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
