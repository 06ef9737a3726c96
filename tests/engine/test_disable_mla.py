"""--disable-mla (attention without weight absorption, per-head K/V in the cache) against the absorbed
path and the transformers oracle; its KV layout; the radix cache and chunked prefill over it; the Triton
backend (interpreter) against the torch reference; TP 2; and the flag combinations it rejects."""

from __future__ import annotations

import pytest
import torch

from engine.args import EngineArgs
from engine.checkpoint.config import load_config, parse_config
from engine.checkpoint.registry import MODELS
from engine.engine import Engine
from engine.errors import UsageError
from engine.memory.pools import kv_row_dim
from engine.model.kernel_registry import ATTENTION, KernelSetup
from engine.sampling import SamplingParams
from tests.engine import hf_oracle as H

ORACLE = ["v3", "v2-lite"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("oracle-no-mla")
    return {v: H.make_checkpoint(v, root / v, seed=i) for i, v in enumerate(ORACLE)}


def _ids(seed: int, n: int, vocab: int = H.COMMON["vocab_size"]) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


# --- the cache layout --------------------------------------------------------------------------------------

def test_expanded_pool_holds_every_local_heads_k_and_v():
    v3 = parse_config(MODELS["deepseek-v3"].config_dict())
    assert kv_row_dim(v3, 128) == 512 + 64  # the latent: the same whatever the heads
    assert kv_row_dim(v3, 128, expanded=True) == 128 * (192 + 128)  # 71x the latent per token
    assert kv_row_dim(v3, 64, expanded=True) == 64 * (192 + 128)  # --tp 2: this rank's heads only
    eng = Engine(model="tiny", device="cpu", dtype="float32", disable_mla=True, max_total_tokens=300)
    cfg, pool = eng.runner.config, eng.runner.kv_pool
    assert pool.dim == cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) != cfg.kv_cache_dim
    assert pool.buffer[0].shape[0] == 301 and pool.size == 300
    assert type(eng.runner.forward_ctx.attn_backend).__name__ == "TorchExpandedAttention"


# --- the oracle and the absorbed path --------------------------------------------------------------------

@pytest.mark.parametrize("variant", ORACLE)
def test_matches_transformers_and_the_absorbed_path(checkpoints, variant):
    forced, prompt = _ids(7, 48), _ids(11, 10)
    ref_logprobs = H.hf_logprobs(checkpoints[variant], forced)
    ref_greedy = H.hf_greedy(checkpoints[variant], prompt, 24)
    params = [SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True),
              SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, logprobs=True)]
    outs = {}
    for disable_mla in (True, False):
        eng = Engine(model=str(checkpoints[variant]), dtype="float32", device="cpu", disable_mla=disable_mla)
        assert eng.runner.forward_ctx.expanded_kv is disable_mla
        outs[disable_mla] = eng.generate(input_ids=[forced, prompt], sampling_params=params)
    scored, continued = outs[True]
    assert ref_logprobs.max() - ref_logprobs.min() > 2.0, "oracle distribution too flat to be a meaningful check"
    torch.testing.assert_close(torch.tensor(scored.prompt_logprobs[1:]), ref_logprobs, atol=2e-3, rtol=0)
    assert continued.token_ids == ref_greedy
    assert len(set(ref_greedy)) > 3, "degenerate continuation: the check would be weak"
    a_scored, a_continued = outs[False]
    assert continued.token_ids == a_continued.token_ids
    torch.testing.assert_close(torch.tensor(scored.prompt_logprobs[1:]), torch.tensor(a_scored.prompt_logprobs[1:]),
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(continued.logprobs), torch.tensor(a_continued.logprobs),
                               atol=1e-4, rtol=0)


# --- radix cache and chunked prefill ---------------------------------------------------------------------

def _shared_prefix_prompts() -> list[list[int]]:
    head = _ids(21, 40, 256)
    return [head + _ids(22 + i, 5 + 3 * i, 256) for i in range(3)]


def test_radix_cache_and_chunked_prefill_keep_outputs():
    prompts = _shared_prefix_prompts()
    sp = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    plain = Engine(model="tiny", device="cpu", dtype="float32", disable_mla=True, disable_radix_cache=True,
                   chunked_prefill_size=-1)
    ref = [plain.generate(input_ids=[p], sampling_params=sp)[0] for p in prompts]
    eng = Engine(model="tiny", device="cpu", dtype="float32", disable_mla=True, chunked_prefill_size=16)
    first = eng.generate(input_ids=prompts[:1], sampling_params=sp)  # fills the radix cache with the head
    rest = eng.generate(input_ids=prompts[1:], sampling_params=sp)  # chunked, over a cached 40-token head
    assert eng.scheduler.stats()["prefix_cache_hit_tokens"] >= 2 * 40
    for got, want in zip(first + rest, ref):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter on CPU; on a GPU the CUDA-graph test "
                    "below runs the compiled kernels")
def test_triton_backend_matches_torch_reference():
    """kernels/mla_extend.py under the Triton interpreter, over gathered per-head K/V (prefill, a radix-cache hit,
    decode)."""
    prompts = _shared_prefix_prompts()
    sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
    outs = {}
    for backend in ("torch", "triton"):
        eng = Engine(model="tiny", device="cpu", dtype="float32", disable_mla=True, attention_backend=backend)
        if backend == "triton":  # a small gather budget: the two cached-prefix requests prefill in two launches
            eng.runner.forward_ctx.attn_backend.prefix_token_budget = 48
        outs[backend] = eng.generate(input_ids=prompts[:1], sampling_params=sp) + \
            eng.generate(input_ids=prompts[1:], sampling_params=sp)
        assert eng.scheduler.stats()["prefix_cache_hit_tokens"] >= 2 * 40
    backend = eng.runner.forward_ctx.attn_backend
    assert type(backend).__name__ == "TritonExpandedAttention"
    fb_groups = []
    real = backend.begin_forward
    backend.begin_forward = lambda fb, ctx, graph_bs=None: (real(fb, ctx, graph_bs), fb_groups.append(backend.groups))
    eng.generate(input_ids=[p[:45] for p in prompts[1:]], sampling_params=SamplingParams(max_new_tokens=1))
    assert [len(g) for g in fb_groups] == [2]  # 2 requests with 44 cached tokens each: one launch apiece
    for got, want in zip(outs["triton"], outs["torch"]):
        assert got.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 2e-2  # tl.dot: tf32-like


def test_tp2_ranks_cache_their_own_heads_and_match_transformers(tmp_path):
    from engine.runtime.offline import RankedEngine

    ckpt = H.make_checkpoint("v3", tmp_path / "v3", seed=0, vocab_size=212)  # even vocab: splits over 2 ranks
    forced, prompt = _ids(7, 48, 212), _ids(11, 10, 212)
    ref_logprobs, ref_greedy = H.hf_logprobs(ckpt, forced), H.hf_greedy(ckpt, prompt, 16)
    args = EngineArgs.of(model=str(ckpt), dtype="float32", device="cpu", tp_size=2, disable_mla=True)
    with RankedEngine(args) as eng:
        scored, continued = eng.generate(input_ids=[forced, prompt], sampling_params=[
            SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True),
            SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)])
    torch.testing.assert_close(torch.tensor(scored.prompt_logprobs[1:]), ref_logprobs, atol=2e-3, rtol=0)
    assert continued.token_ids == ref_greedy
    assert kv_row_dim(load_config(ckpt), 4 // 2, True) == 2 * (16 + 8 + 16)  # a rank's pool row: 2 of 4 heads


# --- flags -------------------------------------------------------------------------------------------------

def test_flashinfer_is_rejected():
    for flags in (dict(attention_backend="flashinfer"), dict(enable_flashinfer_mla=True)):
        with pytest.raises(UsageError, match="FlashInfer") as exc:
            EngineArgs.of(model="tiny", disable_mla=True, **flags).validate()
        assert "--disable-mla" in str(exc.value) and "\n" not in str(exc.value)


def test_speculative_decoding_is_rejected():
    with pytest.raises(UsageError, match="--speculative-algorithm") as exc:
        EngineArgs.of(model="tiny", disable_mla=True, speculative_algorithm="NEXTN").validate()
    assert "--disable-mla" in str(exc.value) and "\n" not in str(exc.value)


def test_allowed_combinations():
    for flags in (dict(device="cuda"), dict(device="cuda", enable_torch_compile=True), dict(attention_backend="triton"),
                  dict(disable_radix_cache=True, chunked_prefill_size=-1), dict(kv_cache_dtype="fp8_e4m3",
                  device="cuda"), dict(tp_size=2, enable_dp_attention=True), dict(tp_size=2, enable_ep_moe=True)):
        EngineArgs.of(model="tiny", disable_mla=True, **flags).validate()


def _setup(graphs: tuple[int, ...]) -> KernelSetup:
    cfg = parse_config(MODELS["deepseek-v3"].config_dict())
    return KernelSetup(cfg, torch.device("cuda"), torch.bfloat16, torch.bfloat16, graphs, expanded_kv=True)


def test_start_up_checks_with_auto_device():
    """--device auto resolves to CUDA after validate(): the backends' start-up checks decide there."""
    assert ATTENTION.resolve("triton", _setup((1, 2, 4))) == "triton"  # paged decode: graphs work
    with pytest.raises(UsageError, match="--disable-cuda-graph"):  # as without --disable-mla
        ATTENTION.resolve("torch", _setup((1, 2, 4)))
    with pytest.raises(UsageError, match="FlashInfer"):
        ATTENTION.resolve("flashinfer", _setup(()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("variant", ["v3"])
def test_cuda_graphs_and_the_absorbed_path_agree_on_gpu(checkpoints, variant):
    """bf16 on the GPU: decode replayed from CUDA graphs (paged kernels/mha_decode.py) vs eager, and vs MLA."""
    prompts = [_ids(31 + i, 7 + 5 * i) for i in range(3)]
    sp = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, logprobs=True)
    runs = {}
    for name, flags in (("graphs", dict(disable_mla=True)), ("eager", dict(disable_mla=True, disable_cuda_graph=True)),
                        ("mla", dict())):
        eng = Engine(model=str(checkpoints[variant]), device="cuda", dtype="bfloat16", cuda_graph_bs="1,2,4",
                     max_total_tokens=16384, **flags)  # a small pool: three engines in turn on one GPU
        assert (eng.runner.graphs is not None) == (name != "eager")
        runs[name] = eng.generate(input_ids=prompts, sampling_params=sp)
        eng.close()
    for g, e, m in zip(runs["graphs"], runs["eager"], runs["mla"]):
        assert g.token_ids == e.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, e.logprobs)) < 2e-2
        assert max(abs(a - b) for a, b in zip(g.logprobs, m.logprobs)) < 0.1  # bf16: a different rounding path
