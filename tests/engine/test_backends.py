"""Backend registry (engine/model/backends.py) and the ForwardContext the runner builds from it:
names, 'auto', start-up checks and their messages, factories, and MoE layers taking their backend
from the context."""

import pytest
import torch

from engine.args import EngineArgs
from engine.config import parse_config
from engine.errors import UsageError
from engine.model import backends as bk
from engine.model.attention import TorchAttentionBackend
from engine.model.moe import MoE, TorchMoEBackend, TritonMoEBackend
from engine.models import lookup
from engine.runner import ModelRunner
from tests.engine import fake_flashinfer

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


def _setup(device=CPU, dtype=torch.float32, kv_dtype=None, graphs=(), interpret=False, model="tiny"):
    cfg = parse_config(lookup(model).config_dict())
    return bk.BackendSetup(cfg, device, dtype, kv_dtype or dtype, tuple(graphs), interpret)


@pytest.mark.parametrize("registry", [bk.ATTENTION_BACKENDS, bk.MOE_BACKENDS], ids=["attention", "moe"])
def test_unknown_backend_names_the_flag_and_the_choices(registry):
    with pytest.raises(UsageError) as err:
        registry.resolve("cutlass", _setup())
    msg = str(err.value)
    assert f"--{registry.kind}-backend cutlass" in msg
    for name in registry.choices():
        assert name in msg
    assert "auto" in registry.choices() and "torch" in registry.choices() and "triton" in registry.choices()


def test_choices_per_kind():
    assert bk.ATTENTION_BACKENDS.choices() == ["auto", "torch", "triton", "flashinfer"]
    assert bk.MOE_BACKENDS.choices() == ["auto", "torch", "triton"]


@pytest.mark.parametrize("registry", [bk.ATTENTION_BACKENDS, bk.MOE_BACKENDS], ids=["attention", "moe"])
def test_auto_is_torch_on_cpu_and_triton_on_cuda(registry):
    assert registry.resolve("auto", _setup(CPU)) == "torch"
    assert registry.resolve("auto", _setup(CPU, interpret=True)) == "torch"  # the interpreter is opt-in
    assert registry.resolve("auto", _setup(CUDA, torch.bfloat16, graphs=(1, 2))) == "triton"
    assert bk.default_backend(CPU) == "torch" and bk.default_backend(CUDA) == "triton"


@pytest.mark.parametrize("registry", [bk.ATTENTION_BACKENDS, bk.MOE_BACKENDS], ids=["attention", "moe"])
def test_start_up_checks(registry):
    with pytest.raises(UsageError, match=r"the Triton kernels need a CUDA GPU \(or TRITON_INTERPRET=1 for slow "
                                         r"CPU checks\); use --attention-backend torch --moe-backend torch on CPU"):
        registry.resolve("triton", _setup(CPU))
    assert registry.resolve("triton", _setup(CPU, interpret=True)) == "triton"
    with pytest.raises(UsageError, match="cannot be captured in CUDA graphs: add --disable-cuda-graph"):
        registry.resolve("torch", _setup(CUDA, torch.bfloat16, graphs=(1,)))
    assert registry.resolve("torch", _setup(CUDA, torch.bfloat16)) == "torch"  # eager CUDA is fine
    assert registry.resolve("torch", _setup(CPU)) == "torch"


def test_flashinfer_check_runs_at_resolve():
    with pytest.raises(UsageError, match="--attention-backend flashinfer needs a CUDA GPU"):
        bk.ATTENTION_BACKENDS.resolve("flashinfer", _setup(CPU))


def test_runner_reports_the_check_of_the_backend_it_cannot_run(monkeypatch):
    import engine.runner as runner_mod

    monkeypatch.setattr(runner_mod, "interpreting", lambda: False)
    with pytest.raises(UsageError, match="the Triton kernels need a CUDA GPU"):
        ModelRunner(EngineArgs.of(model="tiny", device="cpu", moe_backend="triton", max_total_tokens=256))
    with pytest.raises(UsageError, match="--attention-backend flashinfer needs a CUDA GPU"):
        ModelRunner(EngineArgs.of(model="tiny", device="cpu", enable_flashinfer_mla=True, max_total_tokens=256))


def test_registering():
    reg = bk.BackendRegistry("attention")
    seen = []
    reg.register("mine", seen.append, lambda setup, pool, table: ("built", pool, table))
    setup = _setup()
    assert reg.choices() == ["auto", "mine"]
    assert reg.resolve("mine", setup) == "mine" and seen == [setup]
    assert reg.build("mine", setup, "pool", "table") == ("built", "pool", "table")
    for taken in ("mine", "auto"):
        with pytest.raises(ValueError, match="taken"):
            reg.register(taken, seen.append, lambda *a: None)
    with pytest.raises(UsageError, match="no such backend; choose one of auto, mine"):
        reg.resolve("auto", setup)  # auto means torch on CPU, which this registry does not have


def test_factories_build_the_backend_classes(monkeypatch):
    setup = _setup(CPU, interpret=True)
    assert isinstance(bk.ATTENTION_BACKENDS.build("torch", setup, None, None), TorchAttentionBackend)
    assert isinstance(bk.MOE_BACKENDS.build("torch", setup), TorchMoEBackend)
    assert isinstance(bk.MOE_BACKENDS.build("triton", setup), TritonMoEBackend)
    from engine.model.attention_triton import TritonAttentionBackend

    assert isinstance(bk.ATTENTION_BACKENDS.build("triton", setup, None, None), TritonAttentionBackend)
    fake_flashinfer.install(monkeypatch)
    from engine.memory.pools import KVPool, ReqToTokenPool

    cfg = setup.config
    pool = KVPool(1, 64, cfg.kv_cache_dim, torch.float32, CPU)
    table = ReqToTokenPool(4, 33, CPU)
    fi = bk.ATTENTION_BACKENDS.build("flashinfer", bk.BackendSetup(cfg, CPU, torch.float32, torch.float32, (1, 8)),
                                     pool, table)
    assert (fi.num_heads, fi.kv_lora_rank, fi.rope_dim) == (cfg.num_attention_heads, cfg.kv_lora_rank,
                                                            cfg.qk_rope_head_dim)
    assert fi.max_graph_bs == 8 and fi.max_context == 33 and fi.kv_dtype == torch.float32


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
    assert (runner.attention_backend, runner.moe_backend) == ("torch", "torch")
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
