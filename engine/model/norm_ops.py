"""RMSNorm: the implementations the kernel registry (engine/model/kernel_registry.py, op "rms_norm")
chooses from.

- `torch_rms_norm`: the reference (float32, cast back to the input dtype before the weight, as HF does);
- `triton_rms_norm`: one Triton kernel (kernels/rms_norm.py) instead of ~7 torch kernels, except under
  torch.compile (inductor fuses the torch form itself) and for inputs the kernel does not take.
"""

from __future__ import annotations

import torch

from kernels import rms_norm as kernel

torch_rms_norm = kernel.rms_norm_ref


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not torch.compiler.is_compiling() and kernel.supported(x, weight):
        return kernel.rms_norm_triton(x, weight, eps)
    return kernel.rms_norm_ref(x, weight, eps)
