"""RMSNorm: the implementations the kernel registry (engine/model/kernel_registry.py, ops "rms_norm" and
"norm_quant") chooses from.

- `torch_rms_norm`: the reference (float32, cast back to the input dtype before the weight, as HF does);
- `triton_rms_norm`: one Triton kernel (kernels/rms_norm.py) instead of ~7 torch kernels, except under
  torch.compile (inductor fuses the torch form itself) and for inputs the kernel does not take;
- `triton_norm_quant`: RMSNorm and the FP8 group quantisation of the block-FP8 GEMM it feeds in one
  kernel (kernels/rms_norm_quant.py): (q e4m3, column-major float32 scales), bit-equal to `triton_rms_norm`
  then the GEMM's own quantisation, or None where the kernel does not run (under torch.compile, inputs it
  does not take, float32 activations on a GPU): the caller then norms and lets the GEMM quantise, as
  without it. `torch_norm_quant` is its reference (two steps in plain torch).
- the `*add*` twins take the decoder layer's residual add before the norm into the same kernel: (the norm of
  x + residual, or its quantised pair, and x + residual itself, the new residual stream). Where the fused kernel
  does not run (the cases above, and float32 activations on a GPU, whose compiled sum of squares may move by an
  ulp) `triton_add_rms_norm` adds in torch and runs the norm kernel, `triton_add_norm_quant` returns None.
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels import rms_norm as kernel
from kernels import rms_norm_quant as fused

torch_rms_norm = kernel.rms_norm_ref


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not torch.compiler.is_compiling() and kernel.supported(x, weight):
        return kernel.rms_norm_triton(x, weight, eps)
    return kernel.rms_norm_ref(x, weight, eps)


def triton_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      group: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    if torch.compiler.is_compiling() or not fused.supported(x, weight, group) or _fp32_on_gpu(x):
        return None
    return fused.rms_norm_quant(x, weight, eps, group)


def _fp32_on_gpu(x: torch.Tensor) -> bool:
    """float32 activations on a GPU: there the fused kernel's sum of squares may differ from the RMSNorm
    kernel's by an ulp (the compiler lays the fused kernel out differently), so they are not fused; bf16 (what
    serving runs) rounds that away, and the interpreter on CPU sums alike in both."""
    return x.dtype == torch.float32 and x.device.type == "cuda"


def triton_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if (torch.compiler.is_compiling() or not kernel.residual_supported(x, residual) or not kernel.supported(x, weight)
            or _fp32_on_gpu(x)):
        summed = x + residual
        return triton_rms_norm(summed, weight, eps), summed
    return kernel.add_rms_norm_triton(x, residual, weight, eps)


def triton_add_norm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                          group: int) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    if (torch.compiler.is_compiling() or not kernel.residual_supported(x, residual)
            or not fused.supported(x, weight, group) or _fp32_on_gpu(x)):
        return None
    return fused.add_rms_norm_quant(x, residual, weight, eps, group)


torch_add_rms_norm = kernel.add_rms_norm_ref


def torch_add_norm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         group: int) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return fused.add_rms_norm_quant_ref(x, residual, weight, eps, group)


def torch_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     group: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    return fused.rms_norm_quant_ref(x, weight, eps, group)
