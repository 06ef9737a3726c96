"""What a decode step's GPU time goes to, from `dsctl bench one-batch --profile` traces (torch profiler, chrome JSON).

    dsctl bench one-batch --model deepseek-v2 --load-format dummy --quantization fp8 --tp 2 --batch-size 1 128 \\
        --input-len 256 --output-len 16 --profile /tmp/prof
    python3 benchmarks/decode_kernels.py /tmp/prof-rank0-bs1-in256-out16.json --num-layers 60

The decode steps are the GPU kernels that run inside the run's "one-batch decode steps" range (the bench
synchronises before it, so no prefill kernel runs in it). Per trace: the step's span and busy time (the union
of its kernels: the rest is launch latency and host waits), then one row per kernel family (`FAMILIES`, first
match wins; "other" the rest) and the `--top` kernels by time, each as launches and us per decode step and us
per layer. Families overlap in time under programmatic dependent launch (a kernel starts while the one before
it drains), so their sum can exceed the busy time.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_time import busy_us, decode_steps, trace_events, trace_parser  # noqa: E402
from dsctl.bench_one_batch_timing import DECODE_MARK  # noqa: E402

FAMILIES = [  # (family, kernel-name pattern)
    ("collectives", r"nccl|all_reduce|allreduce|_one_shot|_two_shot|all_gather|alltoall|reduce_scatter"),
    ("attention", r"_mla_decode_stage|BatchMLAPage|mla::hopper|BatchDecode|_extend_fwd|BatchPrefill"),
    ("fused MoE GEMMs", r"fused_moe|_moe_gemm|_moe_kernel|w4a8"),
    ("MoE routing and glue", r"moe_gate|router|topk|moe_align|_prologue|_moe_sum|_sum_topk|expert"),
    ("absorbed bmm", r"bmm"),
    ("dense GEMMs", r"_block_gemm|block_fp8|gemm|gemv|cutlass|xmma|nvjet|cublas|matmul"),
    ("norms, quantisation, activation", r"norm|quant|silu|act_"),
    ("rope and KV cache", r"rope|cache"),
]


@dataclass
class Row:
    name: str
    launches: float  # per decode step
    us: float  # per decode step


@dataclass
class StepProfile:
    steps: int
    span_us: float  # per step: first kernel start to last kernel end, over the range
    busy_us: float  # per step: the union of the kernels' intervals
    families: list[Row]
    top: list[Row]


def family_of(name: str) -> str:
    for family, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return family
    return "other"


def decode_steps_profile(events: list[dict], steps: int, top: int = 15) -> StepProfile:
    """The kernels inside the decode range of a trace's events, per step (`steps`: decode steps in the range)."""
    marks = [e for e in events if e.get("name") == DECODE_MARK and "dur" in e]
    if not marks:
        raise ValueError(f"no '{DECODE_MARK}' range in the trace (a `dsctl bench one-batch --profile` trace of "
                         "this version?)")
    start = min(e["ts"] for e in marks)
    end = max(e["ts"] + e["dur"] for e in marks)
    kernels = [e for e in events if e.get("cat") == "kernel" and start <= e["ts"] <= end]
    if not kernels:
        raise ValueError("no GPU kernels inside the decode range (a CPU run has none)")
    fam_us, fam_n, name_us, name_n = (defaultdict(float) for _ in range(4))
    for e in kernels:
        fam = family_of(e["name"])
        fam_us[fam] += e["dur"]
        fam_n[fam] += 1
        name_us[e["name"]] += e["dur"]
        name_n[e["name"]] += 1

    def rows(us: dict, n: dict, limit=None) -> list[Row]:
        order = sorted(us, key=us.get, reverse=True)[:limit]
        return [Row(k, n[k] / steps, us[k] / steps) for k in order]

    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    busy = busy_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    return StepProfile(steps, span / steps, busy / steps, rows(fam_us, fam_n), rows(name_us, name_n, top))


def format_profile(path: str, p: StepProfile, layers: int) -> str:
    out = [f"{path}: {p.steps} decode steps; per step: span {p.span_us / 1e3:.3f} ms, kernels busy "
           f"{p.busy_us / 1e3:.3f} ms ({p.busy_us / p.span_us:.0%})",
           f"{'':<48} {'launches':>9} {'us/step':>9} {'us/layer':>9} {'share':>6}"]
    for title, rows in (("by family", p.families), (f"top {len(p.top)} kernels", p.top)):
        out.append(f"-- {title}")
        for r in rows:
            out.append(f"{r.name[:48]:<48} {r.launches:9.1f} {r.us:9.1f} {r.us / layers:9.2f} {r.us / p.busy_us:6.1%}")
    return "\n".join(out)


def main() -> int:
    ap = trace_parser(__doc__.split("\n")[0])
    ap.add_argument("--top", type=int, default=15, help="kernels listed by name")
    args = ap.parse_args()
    failed = 0
    for path in args.traces:
        steps = decode_steps(ap, path, args.decode_steps)
        try:
            print(format_profile(path, decode_steps_profile(trace_events(path), steps, args.top), args.num_layers))
        except ValueError as why:
            print(f"{path}: {why}")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
