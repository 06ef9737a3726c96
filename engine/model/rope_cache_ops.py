"""The MLA layer's latent norm, rope and KV-cache write in one kernel: the implementations the kernel registry
(engine/model/kernel_registry.py, op "rope_cache") chooses from.

- 'torch' is no callable (`Kernels.rope_cache` None): the layer runs its torch form op by op (the registry's
  RMSNorm, engine/model/rope.py, KVPool.write), the reference;
- `triton_rope_cache`: kernels/mla_rope_cache.py, one launch instead of about thirty, or None where the
  kernel does not run (under torch.compile, which fuses the torch form itself; inputs it does not take; a
  cache in neither e4m3 nor the latent's dtype, e.g. --kv-cache-dtype fp8_e5m2): the layer then runs the torch
  form.
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels import mla_rope_cache as kernel


def triton_rope_cache(q: torch.Tensor, latent: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, kv_lora_rank: int,
                      cache: Optional[torch.Tensor], slots: Optional[torch.Tensor],
                      kv_scale: float) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(q_pe contiguous, c_kv, k_pe), the cache rows written when `cache` is given; None where it does not run."""
    if torch.compiler.is_compiling() or not kernel.supported(q, latent, norm_weight, kv_lora_rank, cache):
        return None
    return kernel.mla_rope_cache(q, latent, norm_weight, eps, cos, sin, positions, kv_lora_rank, cache, slots,
                                 kv_scale)
