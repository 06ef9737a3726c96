"""Tables across parallel layouts for benchmarks/multi_gpu.sh.

    python3 benchmarks/multi_gpu_tables.py onebatch ONEBATCH.jsonl COPY_BW   # bench one-batch rows vs the floor
    python3 benchmarks/multi_gpu_tables.py serve OUT_DIR LAYOUT...           # serve_sweep.sh's JSONL per layout

onebatch: each layout's median decode step at each batch size against its bytes floor per GPU
(engine/distributed/step_floor.py `step_floor_s` with the layout's tp / dp, context = input + output / 2,
bf16 KV, at the copy bandwidth measured in the same run), and its speed against tp1's step.
serve: output tok/s, TTFT and ITL per concurrency for every layout, and output tok/s against tp1's.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.layouts import split  # noqa: E402
from engine.distributed.step_floor import step_floor_s  # noqa: E402


def layout_key(meta_layout: str) -> str:
    """bench one-batch's "tp2 dp2" -> "tp2-dp2"."""
    return meta_layout.replace(" ", "-")


def onebatch(path: str, bw: float) -> None:
    from engine.checkpoint.config import parse_config
    from engine.checkpoint.registry import lookup

    rows = [json.loads(line) for line in open(path)]
    base = {r["batch_size"]: r["median_decode_latency_s"] for r in rows if r.get("layout", "tp1") == "tp1"}
    print(f"\nbench one-batch, decode step per layout (copy bandwidth {bw / 1e12:.2f} TB/s per GPU; floor = bytes one "
          "GPU must read per step / that bandwidth)")
    print(f"{'layout':<9} {'bs':>4} {'in/out':>8} {'prefill ms':>10} {'step ms':>8} {'floor ms':>8} {'x floor':>7} "
          f"{'tok/s':>8} {'vs tp1':>6}")
    for r in rows:
        layout = layout_key(r.get("layout", "tp1"))
        tp, dp = split(layout)
        cfg = parse_config(lookup(r["model"]).config_dict())
        ctx = r["input_len"] + r["output_len"] // 2
        floor = step_floor_s(cfg, r["num_layers"], r["batch_size"], ctx, 2, bw, 1 if cfg.fp8 else 2, tp, dp)
        step = r["median_decode_latency_s"]
        ref = base.get(r["batch_size"])
        vs = f"{ref / step:6.2f}" if ref else f"{'-':>6}"
        print(f"{layout:<9} {r['batch_size']:>4} {r['input_len']:>4}/{r['output_len']:<3} "
              f"{r['prefill_latency_s'] * 1e3:10.1f} {step * 1e3:8.3f} {floor * 1e3:8.3f} {step / floor:7.2f} "
              f"{r['batch_size'] / step:8.0f} {vs}")


def serve(out_dir: str, layouts: list[str]) -> None:
    table = {}
    for layout in layouts:
        path = os.path.join(out_dir, f"v3-{layout}.jsonl")
        if os.path.exists(path):
            table[layout] = [json.loads(line) for line in open(path)]
    base = {r["flags"]["max_concurrency"]: r["output_throughput"] for r in table.get("tp1", [])}
    print("\ndsctl serve + bench serving per layout (random, exact input / output lengths)")
    print(f"{'layout':<9} {'conc':>5} {'ok':>5} {'fail':>4} {'out tok/s':>9} {'vs tp1':>6} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}")
    for layout, rows in table.items():
        for r in rows:
            conc = r["flags"]["max_concurrency"]

            def q(key, p):
                return (r.get(key) or {}).get(p, float("nan"))
            ref = base.get(conc)
            vs = f"{r['output_throughput'] / ref:6.2f}" if ref else f"{'-':>6}"
            print(f"{layout:<9} {conc:>5} {r['completed']:>5} {r['failed']:>4} {r['output_throughput']:9.0f} {vs} "
                  f"{q('ttft_ms', 'median'):9.1f} {q('ttft_ms', 'p99'):9.1f} {q('itl_ms', 'median'):8.2f} "
                  f"{q('itl_ms', 'p99'):8.2f}")


if __name__ == "__main__":
    if sys.argv[1] == "onebatch":
        onebatch(sys.argv[2], float(sys.argv[3]))
    elif sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3:])
    else:
        raise SystemExit(__doc__)
