"""The kernel registry (engine/model/kernel_registry.py) and what the runner builds from it: names and
flags per op, 'auto', start-up checks and their messages, factories, the start-up log line, the
`Kernels` every module is built with, and MoE layers taking their backend from the ForwardContext."""

import dataclasses
import importlib.util
import logging

import pytest
import torch

from engine.args import EngineArgs, KernelArgs
from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.distributed import comm
from engine.errors import UsageError
from engine.model import act_ops, fp8_ops, gate_ops, norm_ops, rope_cache_ops
from engine.model import kernel_registry as kr
from engine.model.attention import MLA, TorchAttentionBackend
from engine.model.kernel_set import Kernels
from engine.model.layers import MLP, Linear, RMSNorm
from engine.model.moe import MoE, TorchMoEBackend, TritonMoEBackend
from engine.runner.model_runner import ModelRunner
from tests.engine import fake_flashinfer

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
BLOCK = (128, 128)
OPS = list(kr.REGISTRIES)
FLAG_OPS = ["attention", "moe", "gemm", "rms_norm", "moe_gate", "norm_quant", "act_quant", "rope_cache",
            "prefill_attention"]  # triton each


def _setup(device=CPU, dtype=torch.float32, kv_dtype=None, graphs=(), interpret=False, model="tiny", fp8_block=None):
    cfg = parse_config(lookup(model).config_dict())
    return kr.KernelSetup(cfg, device, dtype, kv_dtype or dtype, tuple(graphs), interpret, fp8_block=fp8_block)


@pytest.mark.parametrize("op", OPS)
def test_unknown_name_names_the_flag_and_the_choices(op):
    registry = kr.REGISTRIES[op]
    with pytest.raises(UsageError) as err:
        registry.resolve("cutlass", _setup())
    msg = str(err.value)
    assert f"--{op.replace('_', '-')}-backend cutlass: no such backend" in msg
    for name in registry.choices():
        assert name in msg


def test_choices_per_op():
    assert kr.ATTENTION.choices() == ["auto", "torch", "triton", "flashinfer", "flashinfer-decode"]
    assert kr.MOE.choices() == ["auto", "torch", "triton"]
    assert kr.GEMM.choices() == ["auto", "torch", "triton", "cublas"]
    assert kr.RMS_NORM.choices() == kr.MOE_GATE.choices() == ["auto", "torch", "triton"]
    assert kr.ALL_REDUCE.choices() == ["auto", "torch", "custom"]
    assert kr.NORM_QUANT.choices() == ["auto", "off", "torch", "triton"]
    assert kr.ROPE_CACHE.choices() == ["auto", "torch", "triton"]
    assert kr.ACT_QUANT.choices() == ["auto", "off", "torch", "triton"]
    assert kr.SHARED_EXPERTS.choices() == ["auto", "separate", "fused"]


@pytest.mark.parametrize("op", [*FLAG_OPS, "all_reduce"])
def test_each_flag_offers_exactly_the_registered_names(op):
    field = {"attention": "attention_backend"}.get(op, f"{op}_backend")
    flags = {f.name: f for f in dataclasses.fields(KernelArgs)}
    assert set(flags[field].metadata["choices"]) == set(kr.REGISTRIES[op].choices())
    assert KernelArgs(**{field: "torch"}).requested_kernels()[op] == "torch"
    assert set(KernelArgs().requested_kernels()) == {*FLAG_OPS, "all_reduce", "shared_experts"}
    assert set(flags["shared_experts_backend"].metadata["choices"]) == set(kr.SHARED_EXPERTS.choices())


def test_auto_on_cpu():
    names = kr.resolve_kernels({}, _setup(CPU, fp8_block=BLOCK)).names()
    assert names == dict(attention="torch", moe="torch", gemm="torch", rms_norm="torch", moe_gate="torch",
                         all_reduce="torch", norm_quant="off", act_quant="off", rope_cache="torch",
                         shared_experts="separate", moe_a2a="none", prefill_attention="torch")
    interp = kr.resolve_kernels({}, _setup(CPU, interpret=True, fp8_block=BLOCK)).names()
    # the interpreter is opt-in for every op but the FP8 GEMM (and the norm fused with its quantisation),
    # which the CPU tests run in Triton
    assert interp == dict(names, gemm="triton", norm_quant="triton", act_quant="triton")
    # the expanded prefill follows the attention backend: the reference with torch's, Triton under triton's
    triton = kr.resolve_kernels({"attention": "triton"}, _setup(CPU, interpret=True))
    assert triton.prefill_attention == "triton"
    # the exact torch GEMM quantises no activation: nothing to fuse with
    exact = kr.resolve_kernels({"gemm": "torch"}, _setup(CPU, interpret=True, fp8_block=BLOCK))
    assert exact.norm_quant == exact.act_quant == "off"
    assert kr.resolve_kernels({}, _setup(CPU, interpret=True)).gemm == "torch"  # no FP8 weights: no FP8 GEMM


@pytest.mark.parametrize("cublas_why,gemm", [("", "cublas"), ("no cuBLASLt here", "triton")])
def test_auto_on_cuda(monkeypatch, cublas_why, gemm):
    monkeypatch.setattr(kr, "cublas_unavailable_reason", lambda device: cublas_why)
    choice = kr.resolve_kernels({}, _setup(CUDA, torch.bfloat16, graphs=(1, 2), fp8_block=BLOCK))
    assert choice == kr.KernelChoice("triton", "triton", gemm, "triton", "triton", "torch", "triton", "triton", "triton",
                                     "fused", "none", "triton")  # (no FlashInfer installed here)
    bf16 = kr.resolve_kernels({}, _setup(CUDA, torch.bfloat16))
    assert bf16.gemm == "torch" and bf16.norm_quant == bf16.act_quant == "off"  # bf16 weights: F.linear, nothing to quantise


def test_auto_attention_is_flashinfer_decode_where_its_kernel_is_faster(monkeypatch):
    """'auto' picks FlashInfer's decode (Triton for the rest) from 32 heads per rank over a 16-bit cache on a Hopper
    GPU with FlashInfer installed (its kernel 1.1-3x the Triton one there, docs/perf.md), DP attention included;
    Triton for anything else (16 heads per rank, FP8 caches, two-batch overlap, other GPUs)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fake_flashinfer.install(monkeypatch)

    def auto(**kw):
        setup = dataclasses.replace(_setup(CUDA, torch.bfloat16, model="deepseek-v3", fp8_block=BLOCK), **kw)
        return kr.resolve_kernels({}, setup).attention, kr.flashinfer_decode_blocker(setup)

    assert auto() == ("flashinfer-decode", None)  # 128 heads on one GPU
    assert auto(tp_size=2) == ("flashinfer-decode", None)  # 64 heads per rank
    assert auto(tp_size=4) == ("flashinfer-decode", None)  # 32
    assert auto(tp_size=8) == ("triton", "16 heads per rank (FlashInfer measured faster from 32)")
    assert auto(kv_dtype=torch.float8_e4m3fn)[0] == "triton"  # the Triton fp8dot kernel is faster than fa3's FP8
    assert auto(micro_batches=True)[0] == "triton"  # two-batch overlap plans per micro-batch
    from engine.distributed.groups import TPGroup

    dp2 = TPGroup(rank=0, size=2, ranks=(0, 1), attn=TPGroup(rank=0, size=1, ranks=(0,)), dp_size=2)
    assert auto(group=dp2) == ("flashinfer-decode", None)  # a whole group's 128 heads on each rank
    assert auto(expanded_kv=True)[0] == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert auto() == ("triton", "not a Hopper GPU (measured there only)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert auto() == ("triton", "--attention-backend flashinfer: FlashInfer is not installed (pip install "
                                "flashinfer-python), or use --attention-backend triton (the CUDA default)")
    assert kr.resolve_kernels({}, _setup(CPU, model="deepseek-v3")).attention == "torch"


@pytest.mark.parametrize("op", FLAG_OPS)
def test_triton_needs_cuda_or_the_interpreter(op):
    registry = kr.REGISTRIES[op]
    flag = registry.flag
    with pytest.raises(UsageError, match=rf"the Triton kernels need a CUDA GPU \(or TRITON_INTERPRET=1 for slow "
                                         rf"CPU checks\); use {flag} torch on CPU"):
        registry.resolve("triton", _setup(CPU))
    assert registry.resolve("triton", _setup(CPU, interpret=True)) == "triton"
    assert registry.resolve("torch", _setup(CPU)) == "torch"


@pytest.mark.parametrize("registry", [kr.ATTENTION, kr.MOE], ids=["attention", "moe"])
def test_torch_backends_refuse_cuda_graphs(registry):
    with pytest.raises(UsageError, match="cannot be captured in CUDA graphs: add --disable-cuda-graph"):
        registry.resolve("torch", _setup(CUDA, torch.bfloat16, graphs=(1,)))
    assert registry.resolve("torch", _setup(CUDA, torch.bfloat16)) == "torch"  # eager CUDA is fine


def test_cublas_check_says_what_to_use_instead(monkeypatch):
    with pytest.raises(UsageError, match=r"--gemm-backend cublas: cuBLASLt's block-scaled FP8 GEMM needs a CUDA "
                                         r"GPU; use --gemm-backend triton \(or torch\)"):
        kr.GEMM.resolve("cublas", _setup(CPU, interpret=True, fp8_block=BLOCK))
    monkeypatch.setattr(kr, "cublas_unavailable_reason", lambda device: "")
    assert kr.GEMM.resolve("cublas", _setup(CUDA, torch.bfloat16, fp8_block=BLOCK)) == "cublas"


def test_flashinfer_check_runs_at_resolve():
    with pytest.raises(UsageError, match="--attention-backend flashinfer needs a CUDA GPU"):
        kr.ATTENTION.resolve("flashinfer", _setup(CPU))


def test_build_kernels_gives_the_chosen_callables():
    setup = _setup(CPU, interpret=True)
    choice = kr.resolve_kernels(dict(gemm="triton", rms_norm="triton", moe_gate="triton"), setup)
    assert kr.build_kernels(choice, setup) == Kernels(fp8_ops.triton_linear, norm_ops.triton_rms_norm,
                                                      gate_ops.triton_gate, comm.all_reduce,
                                                      add_rms_norm=norm_ops.triton_add_rms_norm)
    ref = kr.build_kernels(kr.resolve_kernels({}, _setup(CPU)), setup)
    assert ref == Kernels(fp8_ops.torch_linear, norm_ops.torch_rms_norm, gate_ops.torch_gate, comm.all_reduce)
    assert kr.GEMM.build("cublas", setup) is fp8_ops.cublas_linear
    fused = kr.build_kernels(kr.resolve_kernels(dict(gemm="triton", norm_quant="triton"), setup), setup)
    assert (fused.norm_quant, fused.gemm_q) == (norm_ops.triton_norm_quant, fp8_ops.triton_linear_q)
    assert (fused.add_rms_norm, fused.add_norm_quant) == (norm_ops.torch_add_rms_norm, norm_ops.triton_add_norm_quant)
    assert ref.add_norm_quant is None  # norm_quant off: the residual add goes with the plain norm
    assert ref.rope_cache is None  # the torch form runs op by op in the layer
    act = kr.build_kernels(kr.resolve_kernels(dict(gemm="triton", norm_quant="off", act_quant="triton"), setup), setup)
    assert (act.act_quant, act.gemm_q) == (act_ops.triton_act_quant, fp8_ops.triton_linear_q)
    rope = kr.build_kernels(kr.resolve_kernels(dict(rope_cache="triton"), setup), setup)
    assert rope.rope_cache is rope_cache_ops.triton_rope_cache


def test_describe_names_what_runs_for_each_op(monkeypatch):
    monkeypatch.setattr(kr, "cublas_unavailable_reason", lambda device: "")
    setup = _setup(CUDA, torch.bfloat16, fp8_block=BLOCK)
    assert kr.describe(kr.resolve_kernels({}, setup), setup) == (
        "attention triton, moe triton, gemm triton+cublas, rms_norm triton, moe_gate triton, all_reduce nccl, "
        "norm_quant triton, act_quant triton, rope_cache triton, shared_experts fused, moe_a2a none, "
        "prefill_attention triton")
    cpu = _setup(CPU)
    assert kr.describe(kr.resolve_kernels({"attention": "torch"}, cpu), cpu) == (
        "attention torch, moe torch, gemm torch, rms_norm torch, moe_gate torch, all_reduce gloo, norm_quant off, "
        "act_quant off, rope_cache torch, shared_experts separate, moe_a2a none, prefill_attention torch")


def test_runner_logs_its_kernels_once(caplog):
    with caplog.at_level(logging.INFO, logger="engine.runner.model_runner"):
        runner = ModelRunner(EngineArgs.of(model="tiny", device="cpu", rms_norm_backend="triton",
                                           moe_gate_backend="triton", max_total_tokens=256))
    lines = [r.getMessage() for r in caplog.records if "kernels:" in r.getMessage()]
    assert lines == ["rank 0 kernels: attention torch, moe torch, gemm torch, rms_norm triton, moe_gate triton, "
                     "all_reduce gloo, norm_quant off, act_quant off, rope_cache torch, shared_experts separate, "
                     "moe_a2a none, prefill_attention torch, pdl off"]
    assert runner.kernel_choice.rms_norm == "triton"


def test_every_module_runs_the_runners_kernels():
    runner = ModelRunner(EngineArgs.of(model="tiny", device="cpu", rms_norm_backend="triton",
                                       moe_gate_backend="triton", max_total_tokens=256))
    assert runner.kernels.rms_norm is norm_ops.triton_rms_norm and runner.kernels.moe_gate is gate_ops.triton_gate
    kinds = (RMSNorm, Linear, MLP, MoE, MLA)
    modules = [m for m in [*runner.model.modules(), *runner.mtp.modules()] if isinstance(m, kinds)]
    assert {type(m) for m in modules} == set(kinds)
    assert all(m.kernels is runner.kernels for m in modules)


def test_runner_reports_the_check_of_the_kernel_it_cannot_run(monkeypatch):
    import engine.runner.model_runner as runner_mod

    monkeypatch.setattr(runner_mod, "interpreting", lambda: False)
    with pytest.raises(UsageError, match="the Triton kernels need a CUDA GPU"):
        ModelRunner(EngineArgs.of(model="tiny", device="cpu", moe_backend="triton", max_total_tokens=256))
    with pytest.raises(UsageError, match="use --rms-norm-backend torch on CPU"):
        ModelRunner(EngineArgs.of(model="tiny", device="cpu", rms_norm_backend="triton", max_total_tokens=256))
    with pytest.raises(UsageError, match="--attention-backend flashinfer needs a CUDA GPU"):
        ModelRunner(EngineArgs.of(model="tiny", device="cpu", enable_flashinfer_mla=True, max_total_tokens=256))


def test_registering():
    reg = kr.OpRegistry("attention")
    seen = []
    reg.register("mine", seen.append, lambda setup, pool, table: ("built", pool, table))
    setup = _setup()
    assert reg.choices() == ["auto", "mine"]
    assert reg.resolve("mine", setup) == "mine" and seen == [setup]
    assert reg.build("mine", setup, "pool", "table") == ("built", "pool", "table")
    assert reg.label("mine", setup) == "mine"
    for taken in ("mine", "auto"):
        with pytest.raises(ValueError, match="taken"):
            reg.register(taken, seen.append, lambda *a: None)
    with pytest.raises(UsageError, match="no such backend; choose one of auto, mine"):
        reg.resolve("auto", setup)  # auto means torch on CPU, which this registry does not have


def test_factories_build_the_backend_classes(monkeypatch):
    setup = _setup(CPU, interpret=True)
    assert isinstance(kr.ATTENTION.build("torch", setup, None, None), TorchAttentionBackend)
    assert isinstance(kr.MOE.build("torch", setup), TorchMoEBackend)
    assert isinstance(kr.MOE.build("triton", setup), TritonMoEBackend)
    from engine.model.attention_triton import TritonAttentionBackend

    assert isinstance(kr.ATTENTION.build("triton", setup, None, None), TritonAttentionBackend)
    fake_flashinfer.install(monkeypatch)
    from engine.memory.pools import KVPool, ReqToTokenPool

    cfg = setup.config
    pool = KVPool(1, 64, cfg.kv_cache_dim, torch.float32, CPU)
    table = ReqToTokenPool(4, 33, CPU)
    fi = kr.ATTENTION.build("flashinfer", kr.KernelSetup(cfg, CPU, torch.float32, torch.float32, (1, 8)), pool, table)
    assert (fi.num_heads, fi.kv_lora_rank, fi.rope_dim) == (cfg.num_attention_heads, cfg.kv_lora_rank,
                                                            cfg.qk_rope_head_dim)
    assert fi.max_graph_bs == 8 and fi.max_context == 33 and fi.kv_dtype == torch.float32 and not fi.decode_only
    hybrid = kr.ATTENTION.build("flashinfer-decode", kr.KernelSetup(cfg, CPU, torch.float32, torch.float32), pool, table)
    assert hybrid.decode_only


class Counting:
    """Wraps a callable and counts the calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args):
        self.calls += 1
        return self.inner(*args)


def test_the_kernels_given_at_construction_run(monkeypatch):
    """The runner's `Kernels` reach RMSNorm, the MoE gate and the all-reduces: counted during a generate."""
    import engine.runner.model_runner as runner_mod
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    made = []

    def counting_kernels(choice, setup):
        k = kr.build_kernels(choice, setup)
        made.append(Kernels(*(Counting(f) for f in (k.gemm, k.rms_norm, k.moe_gate, k.all_reduce))))
        return made[-1]

    monkeypatch.setattr(runner_mod, "build_kernels", counting_kernels)
    eng = Engine(model="tiny", device="cpu", max_total_tokens=512)
    (kernels,) = made
    counts = lambda: [f.calls for f in (kernels.rms_norm, kernels.moe_gate, kernels.all_reduce)]  # noqa: E731
    before = counts()
    sp = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    eng.generate(input_ids=[[5, 6, 7, 8]], sampling_params=sp)
    assert all(after > b for after, b in zip(counts(), before))
    assert kernels.gemm.calls == 0  # CPU: no FP8 weights (dequantised), so no block-FP8 GEMM


class CountingMoE:
    """Wraps a MoE backend and counts the calls the layers make to it."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def experts(self, moe, x, weights, ids):
        self.calls += 1
        return self.inner.experts(moe, x, weights, ids)


def test_moe_layers_take_their_backend_from_the_forward_context():
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    eng = Engine(model="tiny", device="cpu", max_total_tokens=512)
    runner = eng.runner
    assert (runner.kernel_choice.attention, runner.kernel_choice.moe) == ("torch", "torch")
    assert isinstance(runner.forward_ctx.moe_backend, TorchMoEBackend)
    moe_layers = [m for m in runner.model.modules() if isinstance(m, MoE)]
    assert moe_layers and not any(hasattr(m, "backend") for m in moe_layers)
    sp = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    ref = eng.generate(input_ids=[[5, 6, 7, 8]], sampling_params=sp)[0].token_ids
    counting = CountingMoE(runner.forward_ctx.moe_backend)
    runner.forward_ctx.moe_backend = counting
    forwards = []
    real_forward = runner.forward
    runner.forward = lambda fb: forwards.append(fb.mode) or real_forward(fb)
    got = eng.generate(input_ids=[[5, 6, 7, 8]], sampling_params=sp)[0].token_ids
    assert got == ref
    assert forwards and counting.calls == len(forwards) * len(moe_layers)


def test_moe_a2a_follows_the_layout():
    """--moe-a2a-backend is a layout flag: 'auto' is what the TP group was built with, and the all-to-all is
    refused for a group that does not exchange tokens (no EP)."""
    from engine.distributed.groups import TPGroup
    from engine.distributed.token_exchange import torch_all_to_all

    a2a = TPGroup(rank=0, size=2, ranks=(0, 1), ep_size=2, moe_a2a="torch")
    setup = dataclasses.replace(_setup(CPU), group=a2a)
    choice = kr.resolve_kernels({}, setup)
    assert choice.moe_a2a == "torch" and kr.build_kernels(choice, setup).moe_a2a is torch_all_to_all
    assert "moe_a2a gloo" in kr.describe(choice, setup)
    plain = dataclasses.replace(_setup(CPU), group=TPGroup(rank=0, size=2, ranks=(0, 1)))
    assert kr.build_kernels(kr.resolve_kernels({}, plain), plain).moe_a2a is None
    with pytest.raises(UsageError, match="expert parallelism"):
        kr.resolve_kernels({"moe_a2a": "torch"}, plain)
