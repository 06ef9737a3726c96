"""The MoE router at decode sizes: the three launches a step used to run (x.float(), the float32 GEMV, the gate
kernel with --warps warps at every row count) against what `moe_gate(x, weight)` runs now (kernels/moe_gate.py:
the fused router, logits and gate in one launch, from FUSED_MIN_T to FUSED_MAX_T rows; one row: the three
launches with a one-warp gate; --warps sets the gate kernels' GATE_WARPS), each checked against the reference
first, at DeepSeek-V2's (160 experts, hidden 5120, group-limited greedy) and V3's (256, 7168, noaux_tc)
shapes. Per call, timed inside a CUDA graph of 20 calls (no launch overhead from the host; PDL as the engine
sets it), against the bytes floor of reading the float32 router weight at the measured copy bandwidth.

    python3 benchmarks/bench_router.py [--rows 1,4,16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels.moe_gate as mg  # noqa: E402
from benchmarks.bench_moe_fp8 import graph_ms  # noqa: E402
from engine.distributed.step_floor import copy_bandwidth  # noqa: E402
from kernels import pdl  # noqa: E402
from kernels.moe_gate import moe_gate, moe_gate_ref  # noqa: E402

SHAPES = {  # E, H, gate options
    "V2": (160, 5120, dict(top_k=6, method="group_limited_greedy", n_group=8, topk_group=3, norm_topk_prob=False,
                           routed_scaling_factor=16.0)),
    "V3": (256, 7168, dict(top_k=8, method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
                           routed_scaling_factor=2.5)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--warps", default="4", help="comma-separated num_warps of the gate kernels to compare")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    pdl.set_enabled(not pdl.supported(torch.device("cuda")))
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, pdl {'on' if pdl.enabled() else 'off'}")
    print(f"{'shape':>5} {'rows':>4} {'warps':>5} {'3 launches us':>13} {'engine us':>9} {'engine / 3':>10} "
          f"{'floor us':>8}")
    for name, (e, h, kw) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(e, h, device="cuda", generator=g) * 0.02
        bias = torch.randn(e, device="cuda", generator=g) * 0.1 if kw["method"] == "noaux_tc" else None
        for t in rows:
            x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
            want_w, want_i = moe_gate_ref(x, w, correction_bias=bias, **kw)
            for warps in (int(v) for v in args.warps.split(",")):
                mg.GATE_WARPS = warps
                got_w, got_i = moe_gate(x, w, correction_bias=bias, **kw)
                assert torch.equal(got_i, want_i), (name, t)
                torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
                one_row, mg.ONE_ROW_GATE_WARPS = mg.ONE_ROW_GATE_WARPS, warps  # the three launches as they were
                three = graph_ms([lambda: moe_gate(F.linear(x.float(), w), correction_bias=bias, **kw)] * 20) * 1e3
                mg.ONE_ROW_GATE_WARPS = one_row
                fused = graph_ms([lambda: moe_gate(x, w, correction_bias=bias, **kw)] * 20) * 1e3
                floor = w.numel() * 4 / bw * 1e6
                print(f"{name:>5} {t:>4} {warps:>5} {three:13.2f} {fused:9.2f} {fused / three:10.2f} {floor:8.2f}")


if __name__ == "__main__":
    main()
