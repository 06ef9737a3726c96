"""Under torch.compile a KV write stays a write: no copy of the layer's cache (CPU inductor).

Found on the GPU: with the pool as one [layers, slots, dim] tensor, inductor turned each layer's
`index_copy_` into "copy the whole layer, scatter, copy back", allocating the layer's size per write
(58 GiB for a V2-Lite pool on an H200, an OOM at CUDA-graph capture; on smaller pools two passes over
every layer's cache per decode step). The generated code is the witness: no buffer of the pool's row
count may be allocated, and the write must land in the pool's own tensor.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from engine.memory.pools import KVPool

SLOTS = 50_000  # rows per layer: a number no other buffer in the graph has


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_compiled_write_is_in_place_and_allocates_no_layer_copy(dtype):
    torch._dynamo.reset()
    pool = KVPool(2, SLOTS, 64, dtype, torch.device("cpu"))

    def step(values, slots, layer: int):
        pool.write(layer, slots, values * 2)
        return pool.read(layer, slots, torch.float32).sum(-1)

    g = torch.Generator().manual_seed(0)
    values = torch.randn(4, 64, generator=g)
    slots = torch.tensor([3, 17, 4096, SLOTS])
    compiled = torch.compile(step, dynamic=False)
    with torch.inference_mode():
        out, code = run_and_get_code(compiled, values, slots, 1)
    expected = (values * 2).to(dtype).float().sum(-1)
    assert torch.allclose(out, expected)
    assert torch.equal(pool.buffer[1][slots].float(), (values * 2).to(dtype).float())  # written in place
    assert pool.buffer[0].float().abs().sum() == 0  # the other layer untouched
    copies = re.findall(rf"empty_strided\w*\(\({SLOTS + 1}L?, 64", "\n".join(code))
    assert not copies, f"the compiled write allocates a copy of the layer: {copies}"
