"""The multi-GPU benchmark scripts' own logic (benchmarks/layouts.py, multi_gpu_check.py, bench_collectives.py,
multi_gpu_tables.py and the per-GPU floor they use), on CPU: what they parse, compare and compute."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_collectives, multi_gpu_check, multi_gpu_tables
from benchmarks.layouts import cli_flags, engine_flags, split
from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.distributed.step_floor import serving_floor_ms, step_floor_s


def test_layout_names_map_to_flags():
    assert engine_flags("tp2-dp2") == dict(tp_size=2, enable_dp_attention=True, dp_size=2)
    assert cli_flags("tp2-dp2") == ["--tp", "2", "--enable-dp-attention", "--dp", "2"]
    assert cli_flags("tp4-ep4") == ["--tp", "4", "--ep", "4"]
    assert split("tp2-dp2") == (2, 2) and split("tp2-ep2") == (2, 1) and split("tp1") == (1, 1)
    with pytest.raises(ValueError, match="bad layout part"):
        engine_flags("tp2-xx2")


def test_per_gpu_floor_follows_the_layout():
    cfg = parse_config(lookup("deepseek-v3").config_dict())
    bw = 3e12

    def floor(bs, ctx, tp=1, dp=1):
        return step_floor_s(cfg, 5, bs, ctx, 2, bw, 1, tp, dp)

    assert floor(1, 512, tp=2) < floor(1, 512) < 2 * floor(1, 512, tp=2)  # split weights, replicated ones kept
    # DP attention keeps whole attention weights per rank (more bytes at short contexts) but reads only its
    # group's KV (fewer bytes once the cache dominates)
    assert floor(32, 512, tp=2, dp=2) > floor(32, 512, tp=2)
    assert floor(256, 32768, tp=2, dp=2) < 0.7 * floor(256, 32768, tp=2)
    # an FP8 cache: the weights' bytes the same, the cache's halved
    served = [serving_floor_ms("deepseek-v2", 0, bs, 1152, bw, 4, quantization="fp8", kv_bytes=kv)
              for bs in (1, 256) for kv in (2, 1)]
    kv_part = served[2] - served[3]  # bf16 minus fp8 at batch 256: half of the bf16 cache's bytes
    assert kv_part > 0.1 * served[2] and abs((served[0] - served[1]) - kv_part / 256) < 1e-9


def _run(tokens, logprobs=None, top=None, failed=()):
    logprobs = logprobs or [[-1.0] * len(t) for t in tokens]
    top = top or [[[(x, -1.0), (x + 1, -1.02)] for x in t] for t in tokens]
    return multi_gpu_check.Run("tp2", "eager", tokens, logprobs, top, 1.0, list(failed))


def test_check_passes_identical_runs_and_rounding_ties_only():
    ref = _run([[1, 2, 3], [4, 5, 6]])
    same = _run([[1, 2, 3], [4, 5, 6]])
    c = multi_gpu_check.compare(ref, same)
    assert (c.identical, c.gaps) == (2, []) and multi_gpu_check.verdict(same, c, 0.05)
    tie = _run([[1, 3, 9], [4, 5, 6]])  # position 1: the reference's second choice, 0.02 below its first
    c = multi_gpu_check.compare(ref, tie)
    assert c.identical == 1 and c.gaps == [(1, pytest.approx(0.02))]
    assert multi_gpu_check.verdict(tie, c, 0.05) and not multi_gpu_check.verdict(tie, c, 0.01)
    far = _run([[7, 2, 3], [4, 5, 6]])  # not among the reference's alternatives: not a tie
    assert not multi_gpu_check.verdict(far, multi_gpu_check.compare(ref, far), 0.05)
    drift = _run([[1, 2, 3], [4, 5, 6]], logprobs=[[-1.0, -1.3, -1.0], [-1.0] * 3])
    assert multi_gpu_check.compare(ref, drift).max_dlogprob == pytest.approx(0.3)


def test_check_fails_a_run_whose_requests_failed():
    ref = _run([[1, 2, 3]])
    broken = _run([[]], failed=["OutOfResources: out of resource: shared memory"])
    assert not multi_gpu_check.verdict(broken, multi_gpu_check.compare(ref, broken), 0.05)


def test_check_output_lengths_shrink_the_batch_through_every_graph_size():
    lens = multi_gpu_check.new_tokens(16, 32)
    assert lens[0] == 8 and lens[-1] == 32 and lens == sorted(lens)


@pytest.mark.slow
def test_collectives_benchmark_runs_on_gloo(tmp_path, capsys):
    out = tmp_path / "c.jsonl"
    run = bench_collectives.main(["--device", "cpu", "--tp", "2", "--hidden", "64", "--tokens", "1,16",
                                  "--iters", "3", "--peak-mib", "1", "--result-file", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["op"], r["tokens"]) for r in rows] == [("all_reduce", None), ("all_gather", None),
                                                      ("all_reduce", 1), ("all_reduce", 16),
                                                      ("all_gather", 1), ("all_gather", 16)]
    assert all(r["eager_s"] > 0 and r["bus_gbps"] > 0 for r in rows) and run["ranks"] == 2
    assert rows[3]["bytes"] == 16 * 64 * 2 and rows[5]["bytes"] == 2 * 16 * 64 * 2  # gathered bytes count n x
    assert "all_gather" in capsys.readouterr().out


def test_onebatch_table_compares_each_layout_with_tp1(tmp_path, capsys):
    rows = [dict(model="deepseek-v3", num_layers=5, layout=layout, batch_size=32, input_len=512, output_len=32,
                 prefill_latency_s=0.1, median_decode_latency_s=step) for layout, step in
            (("tp1", 0.006), ("tp2", 0.004), ("tp2 dp2", 0.005))]
    path = tmp_path / "ob.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    multi_gpu_tables.onebatch(str(path), 4e12)
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("tp")]
    assert [(cells[0], cells[-1]) for cells in lines] == [("tp1", "1.00"), ("tp2", "1.50"), ("tp2-dp2", "1.20")]


def test_layout_table_reads_the_sweeps_and_divides_by_the_baseline(tmp_path):
    """serve_sweep.sh's summaries (start-up, memory from the rank-0 and DP lines of the server log, the levels)
    in one table: the batch-1 step over its floor, tok/s over the baseline's level by level, failures summed."""
    from benchmarks import layout_table

    def record(conc, tok_s, tpot, failed=0, floor=None):
        return {"flags": {"max_concurrency": conc}, "completed": 8 - failed, "failed": failed,
                "output_throughput": tok_s, "ttft_ms": {"median": 70.0}, "itl_ms": {"median": tpot, "p99": 2 * tpot},
                "tpot_ms": {"median": tpot}, **({"floor_ms": floor} if floor else {})}

    tp_log = "x engine rank 0 INFO rank 0: weights 59.88 GB, KV pool 923900 tokens (63.86 GB); start-up ..."
    dp_log = ("x engine rank 0 INFO rank 0: weights 67.68 GB, KV pool 786639 tokens (54.37 GB)\n"
              "x engine rank 0 INFO KV cache: 4 DP attention groups x 786639 tokens = 3146556 tokens in all")
    sweeps = {"tp4": layout_table.summary("tp4", "tp4", "deepseek-v2", "", 71.3, 4.1e12, tp_log,
                                          [record(1, 117.0, 8.2, floor=1.64), record(256, 3923.0, 40.0)]),
              "tp4-dp4": layout_table.summary("tp4-dp4", "tp4-dp4", "deepseek-v2", "", 46.8, float("nan"), dp_log,
                                              [record(1, 75.0, 12.5), record(256, 3206.0, 41.5, failed=2)])}
    assert sweeps["tp4-dp4"]["dp_groups"] == 4 and sweeps["tp4-dp4"]["kv_tokens_per_rank"] == 786639
    assert sweeps["tp4"]["weights_gb"] == 59.88 and sweeps["tp4-dp4"]["copy_bandwidth"] is None
    for tag, s in sweeps.items():
        (tmp_path / f"{tag}.summary.json").write_text(json.dumps(s))
    rows = layout_table.table(layout_table.load(str(tmp_path)), baseline="tp4").splitlines()
    assert rows[0].startswith("| layout | healthy s |") and "tok/s c=256" in rows[0] and "c=1 |" not in rows[0]
    tp, dp = (next(r for r in rows if r.startswith(f"| {tag} |")) for tag in ("tp4", "tp4-dp4"))
    assert "| 8.20 (1.64) | 5.00 |" in tp and "3,923 (1.00x)" in tp and tp.endswith("| 0 of 16 |")
    assert "786,639 x 4" in dp and "| 12.50 (-) | - |" in dp and "3,206 (0.82x)" in dp and dp.endswith("| 2 of 16 |")
    with pytest.raises(SystemExit, match="no sweep tagged"):
        layout_table.table(layout_table.load(str(tmp_path)), baseline="tp8")
