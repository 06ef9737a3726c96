"""`dsctl bench ablation`: the grid (landed features only, one line to add one), each row in its own process
(a crash, a kill or a hang costs only its row), the table in the seed's shape at 80 columns, and the whole
command on the tiny model on CPU (JSONL + PNG) well within CI's 2 minutes."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from dsctl import bench_ablation
from dsctl.ablation_grid import FEATURES, SEED_ROWS, available_features, engine_field, make_rows
from dsctl.ablation_report import layouts, print_table
from dsctl.bench_ablation import RowResult, Settings, failure_reason, run_ablation
from engine.args import EngineArgs
from tests.cli.screen import assert_fits, assert_no_empty_column, run_dsctl

LANDED = ["mla", "torch_compile", "cuda_graph", "radix_cache", "flashinfer_mla", "nextn", "ep_moe", "dp_attention"]
PENDING = []
RANKED = {"ep_moe", "dp_attention"}  # refused at --tp 1


def _landing(*keys: str) -> tuple:
    """FEATURES as they will be once `keys` land (the one-word change in ablation_grid.FEATURES)."""
    return tuple(dataclasses.replace(f, landed=True) if f.key in keys else f for f in FEATURES)


def _pending(*keys: str) -> tuple:
    """FEATURES as they were before `keys` landed."""
    return tuple(dataclasses.replace(f, landed=False) if f.key in keys else f for f in FEATURES)


def _only(*keys: str) -> tuple:
    """FEATURES with only `keys` landed."""
    return tuple(dataclasses.replace(f, landed=f.key in keys) for f in FEATURES)


# --- the grid ----------------------------------------------------------------------------------------------

def test_columns_are_the_landed_features_and_each_names_a_real_flag():
    assert [f.key for f in available_features()] == LANDED
    for f in FEATURES:
        if f.landed:
            assert engine_field(f.field) is not None, f"{f.key}: EngineArgs has no field {f.field!r}"
    assert sorted(f.key for f in FEATURES if not f.landed) == sorted(PENDING)


def test_a_feature_lands_with_one_line():
    before_features = _pending("ep_moe")
    assert [f.key for f in available_features(before_features)] == [k for k in LANDED if k != "ep_moe"]
    rows = make_rows(EngineArgs.of(model="tiny", tp_size=2), cuda=True)
    before = make_rows(EngineArgs.of(model="tiny", tp_size=2), cuda=True, features=before_features)
    assert len(rows) > len(before)
    states = [r.state for r in rows]
    assert {"mla": True, "torch_compile": False, "cuda_graph": True, "radix_cache": True, "flashinfer_mla": False,
            "nextn": False, "ep_moe": True, "dp_attention": False} in states  # a seed row: CUDA graph + radix cache + EP-MoE
    ep_row = next(r for r in rows if r.state["ep_moe"])
    assert ep_row.args.parallel.enable_ep_moe is True
    # a feature whose flag does not exist stays out even if marked landed
    ghost = dataclasses.replace(FEATURES[0], key="ghost", field="no_such_flag")
    assert "ghost" not in [f.key for f in available_features(FEATURES + (ghost,))]


def _fits_here(on: frozenset, keys: set) -> bool:
    return on <= keys


def _check_args(r) -> None:
    """A row's flags say what its columns say."""
    assert r.args.kernels.disable_mla == (not r.state["mla"])
    assert r.args.kernels.enable_torch_compile == r.state["torch_compile"]
    assert r.args.kernels.disable_cuda_graph == (not r.state["cuda_graph"])
    assert r.args.cache.disable_radix_cache == (not r.state["radix_cache"])
    assert r.args.kernels.enable_flashinfer_mla == r.state["flashinfer_mla"]
    pc = r.args.parallel.config()
    assert (pc.ep_size > 1) == r.state["ep_moe"] or pc.tp_size == 1
    assert pc.enable_dp_attention == r.state["dp_attention"]
    assert (r.args.speculative.speculative_algorithm == "NEXTN") == r.state["nextn"]
    if not r.state["mla"]:  # FlashInfer's MLA wrapper and the MTP draft cannot use --disable-mla's per-head cache
        assert not r.state["flashinfer_mla"] and not r.state["nextn"]


def test_rows_with_a_gpu_as_given_then_each_flip_then_the_seed():
    base = EngineArgs.of(model="deepseek-v3", load_format="dummy", num_layers=5)
    rows = make_rows(base, cuda=True, base_label="baseline")
    keys = [f.key for f in available_features()]
    assert rows[0].label == "baseline" and rows[0].args == base
    assert rows[0].state == {"mla": True, "torch_compile": False, "cuda_graph": True, "radix_cache": True,
                             "flashinfer_mla": False, "nextn": False, "ep_moe": False, "dp_attention": False}
    flips = {r.label for r in rows[1:9]}
    assert flips == {"-MLA", "+torch.compile", "-CUDA graph", "-radix cache", "+FlashInfer MLA", "+NextN",
                     "+EP-MoE", "+DP attention"}
    sigs = [tuple(r.state[k] for k in keys) for r in rows]
    assert len(sigs) == len(set(sigs))  # no configuration twice
    for on in SEED_ROWS:
        if _fits_here(on, set(keys)):
            assert tuple(k in on for k in keys) in sigs, on
    for r in rows:
        _check_args(r)
        ranked = any(r.state[k] for k in RANKED)
        assert (r.refusal is not None) == ranked, r.label  # --tp 1: EP-MoE / DP attention would change nothing
        if ranked:
            assert r.refusal.startswith("needs --tp > 1")
        assert r.args.model.num_layers == 5 and r.args.model.load_format == "dummy"  # the user's flags stay
    no_mla = next(r for r in rows if not r.state["mla"])
    assert no_mla.refusal is None and no_mla.args.kernels.disable_mla and not no_mla.args.kernels.disable_cuda_graph
    flashinfer_base = make_rows(base.replace(enable_flashinfer_mla=True), cuda=True)
    assert "-MLA, -FlashInfer MLA" in [r.label for r in flashinfer_base]


def test_rows_at_tp2_run_ep_moe_and_dp_attention():
    base = EngineArgs.of(model="deepseek-v3", load_format="dummy", num_layers=5, tp_size=2, ep_size=2)
    rows = make_rows(base, cuda=True, base_label="baseline")
    assert rows[0].state["ep_moe"] and not rows[0].state["dp_attention"]  # --ep-size 2 given: EP is on
    assert all(r.refusal is None for r in rows)
    for r in rows:
        _check_args(r)
        pc = r.args.parallel.config()
        assert pc.ep_size == (2 if r.state["ep_moe"] else 1)
        assert pc.dp_size == (2 if r.state["dp_attention"] else 1)
    assert "-EP-MoE" in [r.label for r in rows]


def test_rows_on_cpu_refuse_cuda_only_features_without_a_process():
    rows = make_rows(EngineArgs.of(model="tiny", device="cpu"), cuda=False)
    runnable = [r for r in rows if r.refusal is None]
    assert [r.label for r in runnable] == ["as given", "-MLA", "-radix cache", "+NextN"]
    assert all(not r.state["cuda_graph"] and r.args.kernels.disable_cuda_graph for r in runnable)
    for r in rows:
        cuda_only = r.state["torch_compile"] or r.state["cuda_graph"] or r.state["flashinfer_mla"]
        ranked = any(r.state[k] for k in RANKED)
        assert (r.refusal is not None) == (cuda_only or ranked)
        if cuda_only:
            assert r.refusal.startswith("needs a CUDA GPU")
        elif ranked:
            assert r.refusal.startswith("needs --tp > 1")
    at_tp2 = [r.label for r in make_rows(EngineArgs.of(model="tiny", device="cpu", tp_size=2), cuda=False)
              if r.refusal is None]
    assert at_tp2 == ["as given", "-MLA", "-radix cache", "+NextN", "+EP-MoE", "+DP attention",  # gloo ranks on CPU
                      "-radix cache, +NextN, +EP-MoE", "-radix cache, +NextN, +DP attention"]  # the seed's rows


# --- one process per row -----------------------------------------------------------------------------------

def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _ok(result_file: Path, rate: float) -> list[str]:
    line = json.dumps({"model": "m", "device": "cpu", "dtype": "float32", "input_len": 8, "output_len": 4,
                       "concurrency": 2, "decode_tok_s_bs1": rate, "output_tok_s": 2 * rate})
    return _py(f"open({str(result_file)!r}, 'a').write({line!r} + '\\n')")


CRASHES = {
    "traceback": (_py("raise RuntimeError('CUDA error at graph capture')"), "RuntimeError: CUDA error at graph capture"),
    "dsctl error": (_py("import sys; print('loading'); print('error: CUDA out of memory', file=sys.stderr); "
                        "sys.exit(2)"), "CUDA out of memory"),
    "killed": (_py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), "killed by SIGKILL"),
    "no result": (_py("pass"), "finished without writing a result"),
    "hang": (_py("import time; time.sleep(60)"), "timed out after 3 s"),
}


def test_a_crashing_row_costs_only_its_row(tmp_path, monkeypatch):
    rows = make_rows(EngineArgs.of(model="tiny", tp_size=2), cuda=True)[:len(CRASHES) + 2]
    assert len(rows) == len(CRASHES) + 2
    plan = {rows[0].label: "ok", **{r.label: name for r, name in zip(rows[1:], CRASHES)}, rows[-1].label: "ok"}

    def command(row, settings, result_file):
        what = plan[row.label]
        return _ok(result_file, 10.0 + len(row.label)) if what == "ok" else CRASHES[what][0]

    monkeypatch.setattr(bench_ablation, "row_command", command)
    settings = Settings(row_timeout=3.0, out_dir=tmp_path)
    results = run_ablation(rows, settings)
    assert [r.index for r in results] == list(range(1, len(rows) + 1))
    assert results[0].runnable and results[-1].runnable  # the row after every crash still ran
    assert results[-1].result["decode_tok_s_bs1"] == 10.0 + len(rows[-1].label)
    for r, name in zip(results[1:], CRASHES):
        assert not r.runnable and r.reason == CRASHES[name][1], (name, r.reason)
        assert Path(r.log).is_file()
    assert results[len(CRASHES)].seconds < 10  # the hang was stopped at --row-timeout


def test_time_budget_stops_the_running_row_and_skips_the_rest(tmp_path, monkeypatch):
    rows = make_rows(EngineArgs.of(model="tiny", tp_size=2), cuda=True)[:3]
    monkeypatch.setattr(bench_ablation, "row_command", lambda row, settings, result_file: CRASHES["hang"][0])
    start = time.monotonic()
    results = run_ablation(rows, Settings(row_timeout=60.0, out_dir=tmp_path, time_budget=2.0))
    assert time.monotonic() - start < 20
    assert results[0].reason == "timed out after 2 s"  # the row in flight: stopped when the budget ran out
    assert [r.reason for r in results[1:]] == ["not started: the --time-budget of 2 s was spent"] * 2
    assert all(r.log == "" for r in results[1:])


def test_rows_refused_up_front_keep_their_reason_after_the_budget(tmp_path, monkeypatch):
    """A spent --time-budget does not hide why a row cannot run here: refusals (no process) come first."""
    rows = make_rows(EngineArgs.of(model="tiny", device="cpu"), cuda=False)
    monkeypatch.setattr(bench_ablation, "run_row", lambda i, row, settings: pytest.fail("no row may start"))
    results = run_ablation(rows, Settings(out_dir=tmp_path, time_budget=0.0))
    reasons = {r.reason.split(" (")[0].split(":")[0] for r in results}
    assert any(r.reason.startswith(("needs a CUDA GPU", "needs --tp > 1")) for r in results)
    assert "not started" in reasons and all(r.log == "" for r in results)


def test_failure_reason_picks_the_error_line():
    tb = ("starting\nTraceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n    f()\n"
          "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    assert failure_reason(1, tb) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert failure_reason(2, "x\nerror: --enable-torch-compile need(s) a CUDA GPU\n") == \
        "--enable-torch-compile need(s) a CUDA GPU"
    assert failure_reason(-11, "") == "killed by SIGSEGV"
    assert failure_reason(3, "") == "exit status 3"


def test_refused_rows_start_no_process(tmp_path, monkeypatch):
    rows = make_rows(EngineArgs.of(model="tiny", device="cpu"), cuda=False)
    started = []
    monkeypatch.setattr(bench_ablation, "run_row", lambda i, row, settings: started.append(row.label) or
                        RowResult(i, row.label, dict(row.state), [], runnable=False, reason="stub"))
    results = run_ablation(rows, Settings(out_dir=tmp_path))
    assert started == ["as given", "-MLA", "-radix cache", "+NextN"]
    refused = [r for r in results if r.label not in started]
    assert refused and all(r.reason.startswith(("needs a CUDA GPU", "needs --tp > 1")) and r.log == ""
                           for r in refused)


def test_launch_checks_refuse_a_row_without_a_process(tmp_path, monkeypatch):
    """A layout the engine's start-up checks refuse (a TP size the model's heads cannot be split by) is ❌ with
    the engine's own message, and no process starts."""
    rows = make_rows(EngineArgs.of(model="tiny", device="cpu", tp_size=3), cuda=False)
    started = []
    monkeypatch.setattr(bench_ablation, "run_row", lambda i, row, settings: started.append(row.label))
    results = run_ablation(rows[:2], Settings(out_dir=tmp_path))
    assert started == []
    for r in results:
        assert not r.runnable and r.reason.startswith("--tp 3 does not divide num_attention_heads"), r.reason


# --- the table -----------------------------------------------------------------------------------------------

def _fake_results(features) -> list[RowResult]:
    rows = make_rows(EngineArgs.of(model="deepseek-v3"), cuda=True, features=features)
    out = []
    for i, row in enumerate(rows, 1):
        if i % 3 == 0:
            out.append(RowResult(i, row.label, row.state, [], runnable=False,
                                 reason="RuntimeError: CUDA error at graph capture"))
        else:
            out.append(RowResult(i, row.label, row.state, [], runnable=True, result={
                "model": "deepseek-v3", "device": "cuda:0", "dtype": "bfloat16", "input_len": 512,
                "output_len": 256, "concurrency": 64, "decode_tok_s_bs1": 37.0 * i, "output_tok_s": 3909.04 * i}))
    return out


@pytest.mark.parametrize("landed", [("torch_compile", "cuda_graph", "radix_cache", "flashinfer_mla"), ()],
                         ids=["four-features", "today"])
@pytest.mark.parametrize("width", [80, 160])
def test_table_in_the_seed_shape_fits(landed, width):
    features = _only(*landed) if landed else FEATURES
    results = _fake_results(features)
    console = Console(width=width, record=True, file=open("/dev/null", "w"))
    print_table(results, available_features(features), "deepseek-v3", console)
    text = console.export_text()
    assert_fits(text, width)
    table, = assert_no_empty_column(text)
    headers = table["headers"]
    assert headers[0] == "runnable" and "decode tok/s batch 1" in headers and "output tok/s 64 concurrent" in headers
    runnable = [c for c in table["columns"][0] if c]  # a wrapped row adds lines
    assert runnable == ["✅" if r.runnable else "❌ [1]" for r in results]
    assert "[1] RuntimeError: CUDA error at graph capture" in text
    names = [f.header.replace("\n", " ") for f in available_features(features)]
    if set(names) <= set(headers):  # the seed's layout: one ✅/➖ column per feature
        for f in available_features(features):
            column = table["columns"][headers.index(f.header.replace("\n", " "))]
            assert column == ["✅" if r.features[f.key] else "➖" for r in results]
    else:  # too narrow for one column per feature: what is on, in words
        assert width == 80 and not landed and "optimisations on" in headers
    if landed or width == 160:
        assert set(names) <= set(headers)  # four feature columns fit in 80; all of them in 160
    assert "N/A" in text and f"{37.0 * 1:.1f}" in text


def test_wide_and_narrow_layouts_hold_the_same_rows():
    results = _fake_results(FEATURES)
    wide, narrow = layouts(results, available_features(), "deepseek-v3")
    assert wide.row_count == narrow.row_count == len(results)


# --- the command, on CPU -------------------------------------------------------------------------------------

def test_bench_ablation_on_tiny_cpu(tmp_path):
    out = tmp_path / "ablation"
    start = time.monotonic()
    # One torch thread per row: on a CI box whose 2 cores are shared, OpenMP's spinning threads make a row up to
    # 8x slower under load (measured: 68 s vs 8 s for one row); the figures themselves are not checked here.
    res = run_dsctl("bench", "ablation", "--model", "tiny", "--device", "cpu", "--out-dir", out, timeout=170,
                    env={"OMP_NUM_THREADS": "1"})
    elapsed = time.monotonic() - start
    assert res.returncode == 0, res.stdout + res.stderr
    assert elapsed < 120, f"{elapsed:.0f} s"
    assert_fits(res.stdout)
    table, = assert_no_empty_column(res.stdout)
    assert table["headers"][:2] == ["runnable", "optimisations on"]  # 7 feature columns do not fit in 80
    lines = [json.loads(line) for line in (out / "ablation.jsonl").read_text().splitlines()]
    assert len(lines) == len([c for c in table["columns"][0] if c]) == len(make_rows(
        EngineArgs.of(model="tiny", device="cpu"), cuda=False))
    ran = [line for line in lines if line["runnable"]]
    assert [line["label"] for line in ran] == ["baseline", "-MLA", "-radix cache", "+NextN"]
    for line in ran:
        assert line["decode_tok_s_bs1"] > 0 and line["output_tok_s"] > 0 and line["concurrency"] == 4
        assert Path(line["log"]).is_file()
    assert "--disable-mla" in ran[1]["flags"] and "--disable-mla" not in ran[0]["flags"]
    assert "--speculative-algorithm" in ran[3]["flags"] and "--speculative-algorithm" not in ran[0]["flags"]
    assert all(line["reason"].startswith(("needs a CUDA GPU", "needs --tp > 1")) for line in lines
               if not line["runnable"])
    assert (out / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
