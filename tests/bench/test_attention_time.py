"""benchmarks/attention_time.py: decode attention time from a one-batch profile trace (synthetic traces)."""

import json

from benchmarks.attention_time import busy_us, decode_attention


def _kernel(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_busy_time_merges_overlapping_kernels():
    assert busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert busy_us([]) == 0


def test_decode_attention_counts_the_decode_steps_once(tmp_path):
    # prefill: an extend-attention kernel (not counted) and a decode-named kernel before it (not decode either);
    # two decode steps of one layer: stage 1, then stage 2 launched early (PDL) and ending after it.
    events = [_kernel("_mla_decode_stage1", 0, 50), _kernel("_extend_fwd", 60, 100), _kernel("_moe_gemm_kernel", 170, 40),
              _kernel("_mla_decode_stage1", 300, 30), _kernel("_mla_decode_stage2", 310, 25),
              _kernel("_moe_gemm_kernel", 340, 10),
              _kernel("void flashinfer::mla::hopper::BatchMLAPageAttentionHopperKernel<...>", 400, 20)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}, *events]}))
    r = decode_attention(str(path))
    assert r["attention_us"] == 35 + 20 and r["calls"] == 3
