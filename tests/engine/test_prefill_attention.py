"""The expanded prefill attention op (engine/model/prefill_attention.py): what 'auto' picks, what is refused, the
ragged key layout FlashInfer reads, and the same outputs through every implementation.

FlashInfer's prefill runs here as tests/engine/fake_flashinfer.py's pure-torch stand-in (its documented contract:
ragged [prefix; new] keys per request, causal masks aligned to the end); the Triton kernel runs in the CPU
interpreter (tests/conftest.py). tests/gpu/test_flashinfer.py runs the real FlashInfer against the same backends.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.errors import UsageError
from engine.model import kernel_registry as kr
from engine.model import prefill_attention as pa
from engine.model.attention import TorchAttentionBackend
from engine.model.attention_triton import TritonAttentionBackend
from engine.model.context import ForwardContext
from tests.engine import fake_flashinfer
from tests.engine.test_extend_runs import _setup

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
BLOCK = (128, 128)


def _kernel_setup(device=CPU, dtype=torch.bfloat16, model="deepseek-v3", **kw):
    cfg = parse_config(lookup(model).config_dict())
    return dataclasses.replace(kr.KernelSetup(cfg, device, dtype, dtype, fp8_block=BLOCK), **kw)


def test_ragged_rows_put_each_request_prefix_first():
    indptr, new_rows, prefix_rows = pa.ragged_rows([2, 3, 1], [1, 0, 2])
    assert indptr == [0, 3, 6, 9]
    assert prefix_rows == [0, 6, 7]  # request 0's prefix token, then request 2's two
    assert new_rows == [1, 2, 3, 4, 5, 8]
    assert sorted(new_rows + prefix_rows) == list(range(9))


def test_auto_is_flashinfer_on_hopper_where_installed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fake_flashinfer.install(monkeypatch)

    def auto(**kw):
        setup = _kernel_setup(CUDA, **kw)
        return kr.resolve_kernels({"attention": "triton"}, setup).prefill_attention, kr.flashinfer_prefill_auto_blocker(setup)

    assert auto() == ("flashinfer", None)
    assert auto(tp_size=8) == ("flashinfer", None)  # 16 heads per rank: measured faster too
    assert auto(expanded_kv=True)[0] == "flashinfer"  # --disable-mla's extends: the same problem
    assert auto(dtype=torch.float32)[0] == "triton"
    assert auto(micro_batches=True)[0] == "triton"  # two-batch overlap: each micro-batch plans its own prefill
    cfg = parse_config(dict(lookup("tiny").config_dict()))  # head dims FlashInfer's prefill is not wired for
    assert kr.flashinfer_prefill_auto_blocker(kr.KernelSetup(cfg, CUDA, torch.bfloat16, torch.bfloat16)).startswith(
        "head dims (qk, v)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert auto() == ("triton", "not a Hopper GPU (FlashInfer's fa3 prefill measured faster there only)")


def test_explicit_choices_are_checked():
    with pytest.raises(UsageError, match="--prefill-attention-backend flashinfer: FlashInfer needs a CUDA GPU; use "
                                         "--prefill-attention-backend triton"):
        kr.resolve_kernels({"attention": "triton", "prefill_attention": "flashinfer"}, _kernel_setup(interpret=True))
    with pytest.raises(UsageError, match="runs under --attention-backend triton or flashinfer-decode; "
                                         "--attention-backend torch attends prefills its own way"):
        kr.resolve_kernels({"attention": "torch", "prefill_attention": "triton"}, _kernel_setup(interpret=True))
    with pytest.raises(UsageError, match="Triton kernels need a CUDA GPU"):
        kr.PREFILL_ATTENTION.resolve("triton", _kernel_setup())


def _extend(backend, layer, pool, table, fb, g):
    """One MLA layer's extend through `backend` on test_extend_runs' batch (prefix-cache hits, long extends over
    prefixes, fresh prompts); the same random queries and new latents every call."""
    g.manual_seed(1)
    t = fb.num_tokens
    q_nope = torch.randn(t, layer.num_heads, layer.nope, generator=g)
    q_pe = torch.randn(t, layer.num_heads, layer.rope_dim, generator=g)
    new = pool.read(0, fb.out_cache_loc, torch.float32)  # the new tokens' latent, as MLA.forward wrote it
    ctx = ForwardContext(pool, table, None, backend, moe_backend=None)
    ctx.begin_forward(fb)
    return backend.extend(layer, q_nope, q_pe, new[:, :layer.kv_lora_rank], new[:, layer.kv_lora_rank:], fb, ctx)


@pytest.mark.parametrize("min_tokens", [1, pa.FLASHINFER_MIN_TOKENS])
def test_every_prefill_gives_the_reference_output(monkeypatch, min_tokens):
    """Torch's, Triton's and FlashInfer's prefill inside the Triton backend, several expanded groups (a small prefix
    budget splits them), against the torch attention backend. min_tokens 1: every group runs FlashInfer's wrapper
    (prefix groups through the ragged copy); the default: these small groups stay on the Triton kernel."""
    fake_flashinfer.install(monkeypatch)
    monkeypatch.setattr(pa, "FLASHINFER_MIN_TOKENS", min_tokens)
    cfg, layer, pool, table, fb, g = _setup()
    ref = _extend(TorchAttentionBackend(), layer, pool, table, fb, g)
    per_token = cfg.num_attention_heads * (layer.nope + layer.rope_dim + layer.v_dim) * 4
    budget_bytes = 40 * per_token  # the expanded prefixes of 40 tokens per group: several groups
    fi = pa.FlashInferPrefill(cfg.num_attention_heads, layer.nope + layer.rope_dim, layer.v_dim, layer.scale,
                              torch.float32, CPU)
    plans, runs = fake_flashinfer.BatchPrefillWithRaggedKVCacheWrapper.plans, \
        fake_flashinfer.BatchPrefillWithRaggedKVCacheWrapper.runs
    for prefill in (pa.TorchPrefill(), pa.TritonPrefill(), fi):
        backend = TritonAttentionBackend(per_token, prefill=prefill)
        backend.prefix_token_budget = budget_bytes // per_token
        out = _extend(backend, layer, pool, table, fb, g)
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 1e-3, (prefill.name, err)
    groups = len(backend.prefill_plan.ragged)
    over_prefix = [r.prefix_rows is not None for r in backend.prefill_plan.ragged].count(True)
    assert groups == 4 and over_prefix == (2 if min_tokens == 1 else 0)  # the ragged copy ran for those two
    used = fake_flashinfer.BatchPrefillWithRaggedKVCacheWrapper
    assert (used.plans - plans, used.runs - runs) == ((groups, groups) if min_tokens == 1 else (0, 0))
