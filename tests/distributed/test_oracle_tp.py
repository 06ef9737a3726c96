"""The transformers oracle at --tp 2: two engine ranks (gloo on CPU) against Hugging Face's model.

Same checks as tests/engine/test_oracle.py (teacher-forced log-probs, greedy continuation), on a
random V3 checkpoint written by transformers. Its vocabulary is 212 instead of 211 so that the
vocab-parallel embedding and lm_head split evenly over two ranks (vocab padding is not
implemented; every DeepSeek release has a vocabulary divisible by 16). Bounds are the one-process
test's: TP only reorders float32 partial sums, far below 2e-3.
"""

from __future__ import annotations

import pytest
import torch

from engine.args import EngineArgs
from engine.runtime.offline import RankedEngine
from engine.sampling import SamplingParams
from tests.engine import hf_oracle as H

VOCAB = 212


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return H.make_checkpoint("v3", tmp_path_factory.mktemp("oracle-tp") / "v3", seed=0, vocab_size=VOCAB)


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


def test_tp2_matches_transformers(checkpoint):
    forced, prompt = _ids(7, 48), _ids(11, 10)
    ref_logprobs = H.hf_logprobs(checkpoint, forced)
    ref_greedy = H.hf_greedy(checkpoint, prompt, 24)
    args = EngineArgs.of(model=str(checkpoint), dtype="float32", device="cpu", tp_size=2)
    with RankedEngine(args) as eng:
        scored, continued = eng.generate(input_ids=[forced, prompt], sampling_params=[
            SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True),
            SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)])
    assert ref_logprobs.max() - ref_logprobs.min() > 2.0, "oracle distribution too flat to be a meaningful check"
    torch.testing.assert_close(torch.tensor(scored.prompt_logprobs[1:]), ref_logprobs, atol=2e-3, rtol=0)
    assert continued.token_ids == ref_greedy
    assert len(set(ref_greedy)) > 3, "degenerate continuation: the check would be weak"
