"""The engine against Hugging Face transformers' DeepSeek implementation (an independent oracle).

Random tiny checkpoints are written by transformers itself (V3 with noaux_tc, V2 with
group_limited_greedy, a V2-Lite-style one without q compression and greedy routing)
plus a block-FP8 copy of the V3 one, which transformers dequantises on its own.
"""

import pytest
import torch
from safetensors.torch import load_file

from engine.checkpoint.tiny import quantize_state_dict, write_checkpoint
from engine.engine import Engine
from engine.sampling import SamplingParams
from tests.engine import hf_oracle as H

VARIANTS = ["v3", "v2", "v2-lite", "v3-fp8"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("oracle")
    out = {v: H.make_checkpoint(v, root / v, seed=i) for i, v in enumerate(["v3", "v2", "v2-lite"])}
    sd = {}
    for f in sorted(out["v3"].glob("*.safetensors")):
        sd.update(load_file(f))
    cfg = H.read_config(out["v3"])
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    write_checkpoint(root / "v3-fp8", cfg, quantize_state_dict(sd))
    out["v3-fp8"] = root / "v3-fp8"
    return out


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, H.COMMON["vocab_size"], (n,), generator=g).tolist()


@pytest.mark.parametrize("variant", VARIANTS)
def test_teacher_forced_logprobs_match_transformers(checkpoints, variant):
    ids = _ids(7, 48)
    ref = H.hf_logprobs(checkpoints[variant], ids)
    eng = Engine(model=str(checkpoints[variant]), dtype="float32", device="cpu")
    out = eng.generate(input_ids=[ids], sampling_params=SamplingParams(
        max_new_tokens=1, temperature=0, prompt_logprobs=True))[0]
    assert out.prompt_logprobs[0] is None
    mine = torch.tensor(out.prompt_logprobs[1:])
    assert ref.max() - ref.min() > 2.0, "oracle distribution too flat to be a meaningful check"
    torch.testing.assert_close(mine, ref, atol=2e-3, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_continuation_matches_transformers(checkpoints, variant):
    prompt = _ids(11, 10)
    ref = H.hf_greedy(checkpoints[variant], prompt, 24)
    eng = Engine(model=str(checkpoints[variant]), dtype="float32", device="cpu")
    out = eng.generate(input_ids=[prompt], sampling_params=SamplingParams(
        max_new_tokens=24, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == ref
    assert len(set(ref)) > 3, "degenerate continuation: the check would be weak"


def test_fp8_copy_differs_from_bf16(checkpoints):
    """The FP8 checkpoint is a real quantisation (so the FP8 oracle test can catch a missing scale)."""
    ids = _ids(3, 32)
    a = H.hf_logprobs(checkpoints["v3"], ids)
    b = H.hf_logprobs(checkpoints["v3-fp8"], ids)
    assert (a - b).abs().max() > 1e-3
