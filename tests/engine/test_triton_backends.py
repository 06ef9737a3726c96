"""The model with the Triton MLA / fused-MoE / FP8 / rope-and-cache / RMSNorm (with the residual add) kernels (run by
Triton's CPU interpreter) vs the torch reference."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from engine.engine import Engine
    from engine.sampling import SamplingParams
    model, backend = sys.argv[1], sys.argv[2]
    eng = Engine(model=model, device="cpu", dtype="float32", attention_backend=backend, moe_backend=backend,
                 rope_cache_backend=backend, rms_norm_backend=backend)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 17, 4)]
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
    out = eng.generate(input_ids=prompts, sampling_params=sp)
    # a second round reuses nothing but exercises decode over longer caches
    print(json.dumps([[o.token_ids, o.logprobs] for o in out]))
""")


def _run(model, backend):
    env = dict(os.environ, TRITON_INTERPRET="1" if backend == "triton" else os.environ.get("TRITON_INTERPRET", "0"))
    res = subprocess.run([sys.executable, "-c", SCRIPT, model, backend], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["tiny"])
def test_triton_backends_match_torch_reference(model):
    ref = _run(model, "torch")
    got = _run(model, "triton")
    for (rt, rl), (gt, gl) in zip(ref, got):
        assert gt == rt
        assert max(abs(a - b) for a, b in zip(gl, rl)) < 2e-2  # tl.dot runs in tf32-like precision


def test_absorbed_products_are_token_major_and_equal_the_head_major_ones():
    """With FP8 absorbed weights, W_UK's and W_UV's batched products come back [B, H, N] contiguous (the decode
    kernel and o_proj then read them without a copy), with the values of the head-major product."""
    from types import SimpleNamespace

    import torch

    from engine.model.attention_triton import absorbed_query, latent_to_values
    from kernels.fp8 import fp8_bmm
    from kernels.fp8_math import quantize_block_fp8

    g = torch.Generator().manual_seed(0)
    heads, nope, lora, v = 3, 128, 256, 128
    w_kc, s_kc = quantize_block_fp8(torch.randn(heads, nope, lora, generator=g) * 0.05, (128, 128))
    w_vc, s_vc = quantize_block_fp8(torch.randn(heads, lora, v, generator=g) * 0.05, (128, 128))
    layer = SimpleNamespace(w_kc_fp8=w_kc, w_kc_scale=s_kc, w_vc_fp8=w_vc, w_vc_scale=s_vc)
    for batch in (1, 5):
        q = torch.randn(batch, heads, nope, generator=g).to(torch.bfloat16)
        lat = torch.randn(batch, heads, lora, generator=g).to(torch.bfloat16)
        for got, x, w, s in ((absorbed_query(layer, q), q, w_kc, s_kc), (latent_to_values(layer, lat), lat, w_vc, s_vc)):
            assert got.is_contiguous() and got.shape == (batch, heads, w.shape[2])
            assert torch.equal(got, fp8_bmm(x.transpose(0, 1), w, s).transpose(0, 1))
