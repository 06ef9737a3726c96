"""Expert placement with redundant experts, and the routing counts (in process, no collectives).

- `plan_layer`: every expert keeps a slot, every rank the same number, copies of one expert on different
  ranks, the copies go to the hottest experts, and no rank carries more than the mean plus the largest copy's
  share (hypothesis, random loads); a skewed layer comes out near balanced where the plain layout is not.
- The placement file: written, read back, and each malformed or mismatched one refused with its reason.
- The MoE's slot mapping: a routed logical id becomes a slot holding that expert, a hot expert's picks spread
  over its copies, and ids of no expert stay no expert.
- Loading under a placement (tiny checkpoint, FP8 kept, and dummy weights): each slot of each EP rank holds
  exactly its logical expert's TP-1 tensors, and the ranks' expert outputs still sum to the unsplit layer's.
- `ExpertLoad.record`: padding rows (past the real count, from the row offset) and ids of no expert are not
  counted; the report's per-expert and per-rank sums.
- `dsctl place-experts`: a load file in, a placement file out that the engine accepts; bad input exits 2.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from engine.distributed.expert_placement import (
    ExpertPlacement,
    check_placement,
    expected_rank_loads,
    load_placement,
    plan_layer,
    plan_placement,
)
from engine.errors import UsageError
from engine.model.builder import build_model
from engine.model.expert_load import ExpertLoad
from tests.distributed.model_tp_targets import _checkpoint
from tests.distributed.test_model_ep import BLOCK, _bytes, _group


def _ratio(loads):
    return max(loads) * len(loads) / sum(loads)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(8, 2), (16, 2), (16, 4), (32, 8)]), st.integers(0, 3), st.data())
def test_plan_places_every_expert_and_balances(shape, extra_per_rank, data):
    experts, ep = shape
    redundant = extra_per_rank * ep
    load = data.draw(st.lists(st.integers(0, 10_000), min_size=experts, max_size=experts))
    slots = plan_layer(load, ep, redundant)
    per = (experts + redundant) // ep
    assert len(slots) == experts + redundant and set(slots) == set(range(experts))
    for r in range(ep):
        mine = slots[r * per:(r + 1) * per]
        assert len(set(mine)) == len(mine), "two copies of one expert on one rank"
    if sum(load):
        planned = expected_rank_loads(slots, load, ep)
        copies = [slots.count(e) for e in range(experts)]
        biggest = max(load[e] / copies[e] for e in range(experts))
        assert max(planned) <= sum(load) / ep + biggest + 1e-6  # greedy list scheduling's bound
        if redundant:
            hottest = max(range(experts), key=lambda e: load[e])
            assert slots.count(hottest) >= 2 or load.count(load[hottest]) > redundant


def test_plan_gives_copies_to_the_hot_experts():
    load = [1000, 10, 10, 10, 10, 10, 10, 500]
    slots = plan_layer(load, 2, 2)
    assert slots.count(0) == 2 and slots.count(7) == 2
    assert _ratio(expected_rank_loads(slots, load, 2)) < 1.05 < _ratio(expected_rank_loads(range(8), load, 2))


def test_placement_file_round_trip_and_refusals(tmp_path):
    placement = plan_placement({1: [5, 1, 1, 1], 4: [1, 1, 1, 9]}, 2, 2)
    path = tmp_path / "p.json"
    placement.save(path)
    assert load_placement(path) == placement
    check_placement(placement, 2, 4, [1, 2, 3, 4])
    cases = [
        (dict(layers={"1": [0, 1, 2, 2]}), "experts [3] have no slot"),
        (dict(layers={"1": [0, 1, 2]}), "multiple of the EP size"),
        (dict(layers={"1": [0, 1, 2, 7]}), "outside [0, 4)"),
        (dict(format="other"), "not a placement file"),
        (dict(layers={"x": [0, 1, 2, 3]}), "malformed"),
    ]
    for change, message in cases:
        path.write_text(json.dumps({**placement.to_json(), **change}))
        with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")
                           .replace("(", r"\(").replace(")", r"\)")):
            load_placement(path)
    for args, message in [((1, 4, [1, 4]), "add --ep-size"), ((4, 4, [1, 4]), "planned for EP 2"),
                          ((2, 8, [1, 4]), "this model has 8"), ((2, 4, [1, 2]), "layers \\[4\\]")]:
        with pytest.raises(UsageError, match=message):
            check_placement(placement, *args)


def test_routed_ids_map_to_slots_that_hold_them():
    from engine.model.moe import MoE

    _, cfg = _checkpoint("tiny")
    e = cfg.n_routed_experts
    slots = plan_layer([100] + [1] * (e - 1), 2, 2)  # the hot expert 0: one copy per rank
    assert slots.count(0) == 2
    moe = MoE(cfg, torch.float32, tp=_group(0, 2, ep=2), layer=1, slots=slots)
    assert moe.num_local_experts == (e + 2) // 2 and moe.local_experts() == slots[: (e + 2) // 2]
    ids = torch.tensor([[0, 3, 5, 1]] * 6 + [[-1, e, 0, 2]], dtype=torch.int32)
    got = moe.to_slots(ids)
    logical = torch.tensor(slots)[got.clamp(min=0).long()]
    assert torch.equal(torch.where(got >= 0, logical, -1), torch.where((ids >= 0) & (ids < e), ids, -1))
    assert len(set(got[:6, 0].tolist())) == 2  # expert 0's picks use both copies


@pytest.mark.parametrize("alias, block, dummy", [("tiny", None, False), ("tiny-fp8", BLOCK, False),
                                                 ("tiny", None, True)])
def test_each_slot_holds_its_expert(alias, block, dummy):
    from tests.distributed.model_tp_targets import params_by_checkpoint_name

    path, cfg = _checkpoint(alias)
    ckpt = None if dummy else path
    full = params_by_checkpoint_name(*build_model(cfg, cfg.num_hidden_layers, torch.float32, "cpu", block,
                                                  checkpoint=ckpt, seed=3))
    load = {i: [(7 * e * e + i) % 23 for e in range(cfg.n_routed_experts)] for i in range(1, cfg.num_hidden_layers + 1)}
    placement = plan_placement(load, 2, 4)
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    outs = []
    for rank in range(2):
        model, mtp = build_model(cfg, cfg.num_hidden_layers, torch.float32, "cpu", block, _group(rank, 2, ep=2),
                                 checkpoint=ckpt, seed=3, placement=placement)
        for prefix, mod in (("layers.1.", model.layers[1]), ("mtp.layer.", mtp.layer)):
            moe = mod.mlp
            assert moe.slots == placement.slots(moe.layer)
            for j, expert in enumerate(moe.local_experts()):
                for p in ("w13", "w2", "w13_scale", "w2_scale"):
                    if getattr(moe, p) is not None:
                        assert torch.equal(_bytes(getattr(moe, p)[j]), _bytes(full[f"{prefix}mlp.{p}"][expert])), \
                            (rank, prefix, j, expert, p)
        outs.append(_experts_out(model.layers[1].mlp, x, cfg))
    whole = build_model(cfg, 2, torch.float32, "cpu", block, checkpoint=ckpt, seed=3, mtp=False)[0].layers[1].mlp
    want = _experts_out(whole, x, cfg)
    torch.testing.assert_close(sum(outs), want, rtol=0, atol=1e-5 * want.abs().max().item())


def _experts_out(moe, x, cfg):
    from engine.model.moe import TorchMoEBackend, local_expert_ids

    weights, ids = moe.route(x)
    ids = moe.to_slots(ids)
    if moe.tp.ep_size > 1:
        ids = local_expert_ids(ids, moe.first_expert, moe.num_local_experts)
    return TorchMoEBackend().experts(moe, x, weights, ids)


def test_expert_load_counts_real_rows_only():
    load = ExpertLoad({1: (0, 1, 2, 3, 0, 1), 2: (0, 1, 2, 3)}, 4, 2, torch.device("cpu"))
    ids = torch.tensor([[0, 4], [5, 3], [1, -1], [2, 6]])
    load.begin_forward(3)
    load.record(1, ids, padded=True, first_row=1)  # rows 0, 1 are the batch's rows 1, 2 < 3: real; 2, 3 padding
    load.record(2, ids[:, :1], padded=False)  # every row; slot 5 is outside layer 2's four
    report = load.report(load.totals(None))
    assert load.counts[0].tolist() == [1, 0, 0, 1, 1, 1]  # -1 and slot 6 (padding rows) not counted
    assert report.layers[1].logical == [2, 1, 0, 1] and report.layers[1].ranks == [1, 3]
    assert report.layers[2].logical == [1, 1, 1, 0] and report.layers[2].ranks == [2, 1]
    assert report.rank_totals() == [3, 4] and report.imbalance() == pytest.approx((1.5 + 4 / 3) / 2)


def _exit_code(args, monkeypatch) -> int:
    from dsctl.cli import main

    monkeypatch.setattr("sys.argv", ["dsctl", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    return exc.value.code


def test_place_experts_cli(tmp_path, monkeypatch, capsys):
    from dsctl.cli import app

    load = {"ep_size": 1, "num_experts": 16,
            "layers": {str(i): {"logical": [1000 if e == i else 10 for e in range(16)], "ranks": [0]}
                       for i in (1, 2, 3, 4)}}
    (tmp_path / "load.json").write_text(json.dumps(load))
    out = tmp_path / "placement.json"
    args = ["place-experts", "--load", str(tmp_path / "load.json"), "--ep", "2", "--redundant", "2", "-o", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    placement = load_placement(out)
    assert isinstance(placement, ExpertPlacement) and placement.slots(1).count(1) == 2
    assert _exit_code(args[:5] + ["--redundant", "1", "-o", str(out)], monkeypatch) == 2
    assert "multiple of 2" in capsys.readouterr().err
    (tmp_path / "load.json").write_text("{}")
    assert _exit_code(args, monkeypatch) == 2
    assert "not a routing-count file" in capsys.readouterr().err


def test_memory_plan_counts_the_redundant_copies(tmp_path):
    from engine.args import EngineArgs
    from engine.checkpoint.config import parse_config
    from engine.checkpoint.registry import lookup
    from engine.memory.plan import spec_from_args, weight_parts
    from engine.memory.weight_tally import Tally

    cfg = parse_config(lookup("deepseek-v3").config_dict()).with_num_layers(5)
    moe_layers = [i for i in range(6) if cfg.is_moe_layer(i)]  # + the MTP layer
    path = tmp_path / "p.json"
    plan_placement({i: [1] * 256 for i in moe_layers}, 8, 32).save(path)

    def experts_gb(placement):
        args = EngineArgs.of(model="deepseek-v3", tp_size=8, ep_size=8, quantization="fp8",
                             expert_placement=placement)
        spec = spec_from_args(args, cfg, tp=8, dp=1, ep=8, fp8_block=(128, 128), mtp=True, gpu_bytes=141e9)
        return weight_parts(spec)

    plain, placed = experts_gb(None), experts_gb(str(path))
    one = Tally(2, (128, 128))
    one.linear(2 * cfg.moe_intermediate_size, cfg.hidden_size, "split")  # w13
    one.linear(cfg.hidden_size, cfg.moe_intermediate_size, "split")  # w2
    per_rank = 32 // 8 * one.bytes["split"]  # 4 more experts on each rank, in each MoE layer
    main_layers = sum(cfg.is_moe_layer(i) for i in range(5))
    assert placed["routed experts"] - plain["routed experts"] == pytest.approx(main_layers * per_rank)
    assert placed["MTP layer"] - plain["MTP layer"] == pytest.approx(per_rank)
