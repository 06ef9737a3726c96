"""GPU-only: the memory plan at real start-up (ModelRunner._check_pool), with the pool the runner really sized from
free memory by the plan's own rule (`kv_pool_tokens`), and the plan's KV tokens against it.

Run on one GPU with `python -m pytest tests/gpu/test_memory_plan_gpu.py -q -s` (about a minute); `-s` prints the
start-up reserve this GPU really held (engine/memory/plan.py's ONE_GPU_RESERVE_BYTES is that number).
"""

import gc

import pytest
import torch

from engine.args import EngineArgs
from engine.errors import UsageError
from engine.memory.plan import GB, plan_memory, spec_from_args

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FLAGS = dict(model="deepseek-v3", load_format="dummy", num_layers=3, device="cuda", disable_cuda_graph=True,
             triton_compile_workers=0)


def _free() -> None:
    """Each runner sizes its pool from free memory: the runners before it (a refused one stays referenced by its
    traceback until collected) must be gone, and their cached blocks handed back."""
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def clean_gpu():
    _free()
    yield
    _free()


def _config():
    from engine.checkpoint.resolve import resolve_model  # lazy: the checkpoint's config only

    return resolve_model(EngineArgs.of(**FLAGS).model).config.with_num_layers(3)


def _runner(**flags):
    from engine.runner.model_runner import ModelRunner  # lazy: builds the model on the GPU

    return ModelRunner(EngineArgs.of(**{**FLAGS, **flags}))


def _spec(args, runner_cfg, fraction=None):
    total = torch.cuda.mem_get_info()[1]  # what the runner's rule reads: 85.0 GB on an H100 80GB
    if fraction is not None:
        args = args.replace(mem_fraction_static=fraction)
    return spec_from_args(args, runner_cfg, tp=1, dp=1, ep=1, fp8_block=(128, 128), mtp=True, gpu_bytes=total)


def _fraction_for(tokens: int) -> tuple[float, int]:
    """The --mem-fraction-static whose plan leaves `tokens` KV tokens (negative: that many short of 0), and the
    plan's exact count."""
    args, cfg = EngineArgs.of(**FLAGS), _config()
    probe = plan_memory(_spec(args, cfg))
    fraction = (probe.weight_bytes + sum(probe.reserve.values()) + tokens * probe.kv_per_token) / probe.spec.gpu_bytes
    return fraction, plan_memory(_spec(args, cfg, fraction)).memory_tokens


def _measure(fraction: float) -> tuple[int, int, int]:
    """(KV pool tokens, weight bytes, context limit) of a runner at `fraction`, closed before any assertion (a
    failed assertion's traceback would keep its model on the GPU for the next test)."""
    from engine.weights.loader import iter_params  # lazy: the model stack

    runner = _runner(mem_fraction_static=fraction)
    modules = {"": runner.model, "mtp.": runner.mtp}
    params = {p.data_ptr(): p for _, p in iter_params(modules)}
    absorbed = {b.data_ptr(): b for m in modules.values() for n, b in m.named_buffers() if n.endswith(("w_kc", "w_vc"))}
    weights = sum(t.numel() * t.element_size() for t in [*params.values(), *absorbed.values()])
    out = runner.kv_pool.size, weights, runner.max_model_len
    runner.close()
    return out


def test_plan_tokens_against_the_real_pool_and_the_context_rule():
    """A fraction the plan says leaves 80k tokens: the weights are the plan's, the runner's pool is the plan's up
    to 0.1 GB of start-up reserve error (the old plan was 0.48 GB off), and, with no --max-model-len, the context
    limit becomes the pool."""
    fraction, planned = _fraction_for(80_000)
    real, weights, context = _measure(fraction)
    plan = plan_memory(_spec(EngineArgs.of(**FLAGS), _config(), fraction))
    held = plan.budget - weights - plan.reserve["request table"] - real * plan.kv_per_token
    print(f"plan {planned} tokens, real {real} tokens; weights plan {plan.weight_bytes / GB:.3f} GB, "
          f"real {weights / GB:.3f} GB; start-up reserve held {held / GB:.3f} GB (plan "
          f"{(sum(plan.reserve.values()) - plan.reserve['request table']) / GB:.3f} GB)")
    assert abs(plan.weight_bytes - weights) < 0.01 * weights
    assert abs(real - planned) * plan.kv_per_token < 0.1 * GB
    assert context == min(real, 163_840) < 163_840


def test_refusals_at_start_up():
    """--max-model-len longer than the pool: refused naming it and a shorter length; also below --min-kv-tokens:
    the length the user gave still speaks first, with no shorter length offered; --min-kv-tokens alone."""
    fraction, _ = _fraction_for(80_000)
    with pytest.raises(UsageError, match=r"one request of --max-model-len 163,840 tokens does not fit; "
                                         r"give --max-model-len \d+ or less"):
        _runner(max_model_len=163_840, mem_fraction_static=fraction)
    _free()
    short, planned = _fraction_for(-65_000)  # 0.3 GB short of any KV pool
    assert planned == 0
    with pytest.raises(UsageError, match="a KV pool of 0 tokens per DP group: one request of --max-model-len "
                                         "163,840 tokens does not fit, and the pool is below --min-kv-tokens 4,096"):
        _runner(max_model_len=163_840, mem_fraction_static=short)
    _free()
    with pytest.raises(UsageError, match="below --min-kv-tokens 1,000,000,000"):
        _runner(min_kv_tokens=10**9)
