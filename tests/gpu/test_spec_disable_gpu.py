"""--speculative-disable-by-batch-size on the GPU (skipped on CPU): plain decode steps run through CUDA graphs,
whose output buffers the next replay overwrites, so the hidden states kept for the draft layer's catch-up
must be copies. Greedy tokens equal speculation off (trained tiny-py, bf16, as tests/gpu/test_spec_gpu.py),
and the caught-up draft KV matches what a prefill of the same sequence writes, within bf16 rounding (decode
rows and an extend run different kernels)."""

import pytest
import torch

from engine.engine import Engine
from engine.sampling import SamplingParams
from tests.speculative.helpers import SPEC, prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FLAGS = dict(model="tiny-py", device="cuda", dtype="bfloat16", max_total_tokens=16384, max_running_requests=16,
             cuda_graph_bs="1,2,4,8,16,32,64,128")


def _greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def test_switching_steps_keep_greedy_output_with_graphs():
    ref = Engine(**FLAGS)
    ps = prompts(ref.config.vocab_size, n=32, seed=4)
    params = [_greedy(8 + (5 * i) % 41) for i in range(len(ps))]
    off = ref.generate(input_ids=ps, sampling_params=params)
    eng = Engine(**FLAGS, **SPEC, speculative_disable_by_batch_size=8)
    on = eng.generate(input_ids=ps, sampling_params=params)
    stats = eng.scheduler.stats()
    print(f"plain steps {stats['spec_plain_steps']}, spec accepted length {stats['spec_accept_mean']:.2f}, "
          f"histogram {stats['spec_accept_hist']}")
    assert stats["spec_plain_steps"] > 16 and sum(stats["spec_accept_hist"]) > 0
    assert [o.token_ids for o in on] == [o.token_ids for o in off]


def test_caught_up_draft_kv_matches_prefill_with_graphs():
    plain = Engine(**FLAGS, **SPEC, speculative_disable_by_batch_size=1)
    ps = prompts(plain.config.vocab_size, n=3, seed=5)[:2] + [list(range(40, 71))]
    outs = plain.generate(input_ids=ps, sampling_params=_greedy(40))
    fresh = Engine(**FLAGS, **SPEC)
    layer = plain.runner.config.num_hidden_layers  # the pool's extra (MTP) layer
    for prompt, out in zip(ps, outs):
        seq = prompt + out.token_ids
        n = len(prompt) + 14  # caught up once 16 plain steps had run
        fresh.generate(input_ids=[seq], sampling_params=_greedy(1))
        kv = []
        for eng in (plain, fresh):
            slots, _ = eng.scheduler.cache.match_prefix(seq)
            kv.append(eng.runner.kv_pool.read(layer, slots[len(prompt):n].to(eng.runner.device), torch.float32))
        got, want = kv
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        assert want.abs().max() > 0.1 and cos.min() > 0.99, cos
