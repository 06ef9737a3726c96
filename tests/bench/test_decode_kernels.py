"""benchmarks/decode_kernels.py: a decode step's kernel time by family and by name, from a one-batch profile trace
(synthetic events; and the decode range in a real trace of `bench one-batch --profile` on CPU)."""

import json

import pytest

from benchmarks.decode_kernels import DECODE_MARK, decode_steps_profile, family_of, format_profile


def _kernel(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_kernels_inside_the_decode_range_by_family_and_name():
    # a prefill kernel before the range (not counted); two decode steps of one layer inside it, the second step's
    # norm overlapping its GEMM (PDL); a kernel after the range (not counted)
    events = [_kernel("_extend_fwd", 0, 500), _kernel("_block_gemm_kernel", 510, 90),
              {"cat": "user_annotation", "name": DECODE_MARK, "ts": 1000, "dur": 1000},
              _kernel("_block_gemm_kernel", 1010, 40), _kernel("ncclDevKernel_AllReduce_Sum_bf16", 1050, 10),
              _kernel("_mla_decode_stage1", 1060, 20),
              _kernel("_block_gemm_kernel", 1500, 40), _kernel("_add_rms_norm_quant_kernel", 1530, 20),
              _kernel("ncclDevKernel_AllReduce_Sum_bf16", 1550, 12), _kernel("_mla_decode_stage1", 1562, 18),
              _kernel("_block_gemm_kernel", 2100, 99)]
    p = decode_steps_profile(events, steps=2)
    assert p.steps == 2 and p.span_us == (1580 - 1010) / 2 and p.busy_us == (70 + 80) / 2  # the union of each step's kernels
    fams = {r.name: (r.launches, r.us) for r in p.families}
    assert fams == {"dense GEMMs": (1.0, 40.0), "collectives": (1.0, 11.0), "attention": (1.0, 19.0),
                    "norms, quantisation, activation": (0.5, 10.0)}
    assert [r.name for r in p.families][0] == "dense GEMMs"  # by time
    assert p.top[0].name == "_block_gemm_kernel" and p.top[0].us == 40.0
    text = format_profile("t.json", p, layers=1)
    assert "span 0.285 ms" in text and "collectives" in text


def test_families_name_the_engines_kernels():
    assert family_of("void flashinfer::mla::hopper::BatchMLAPageAttentionHopperKernel<...>") == "attention"
    assert family_of("_fused_moe_kernel") == "fused MoE GEMMs"
    assert family_of("_moe_gate_kernel") == "MoE routing and glue"
    assert family_of("_fp8_bmm_kernel") == "absorbed bmm"
    assert family_of("nvjet_tst_64x8_64x16_4x1_v_bz_TNN") == "dense GEMMs"
    assert family_of("_one_shot_kernel") == "collectives"
    assert family_of("_mla_rope_cache_kernel") == "rope and KV cache"
    assert family_of("elementwise_kernel") == "other"


def test_a_trace_without_the_range_or_kernels_is_refused():
    with pytest.raises(ValueError, match="no 'one-batch decode steps' range"):
        decode_steps_profile([_kernel("x", 0, 1)], 1)
    with pytest.raises(ValueError, match="no GPU kernels"):
        decode_steps_profile([{"name": DECODE_MARK, "ts": 0, "dur": 5}], 1)


def test_one_batch_profile_marks_its_decode_steps(tmp_path):
    from dsctl.bench_one_batch import bench
    from engine.args import EngineArgs

    bench(EngineArgs.of(model="tiny", device="cpu"), [2], [4], [3], repeats=1, profile=tmp_path / "prof.json")
    (trace,) = tmp_path.glob("prof-bs2-in4-out3.json")
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    marks = [e for e in events if e.get("name") == DECODE_MARK]
    assert len(marks) == 1 and marks[0]["dur"] > 0
    with pytest.raises(ValueError, match="no GPU kernels"):  # CPU: the range is there, no kernels in it
        decode_steps_profile(events, 2)
