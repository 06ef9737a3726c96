"""SwiGLU's activation fused with the FP8 activation quantisation of the block-FP8 down projection after it: the
implementations the kernel registry (engine/model/kernel_registry.py, op "act_quant") chooses from.

- `triton_act_quant`: kernels/silu_mul_quant.py, (q e4m3, column-major float32 scales) of SiLU(gate) * up in one
  launch instead of three, or None where the kernel does not run (under torch.compile, inputs it does not take):
  the MLP then runs the torch form and the GEMM quantises, as without it;
- `torch_act_quant`: its reference (the torch form, then the group quantisation in plain torch);
- 'off' is no callable (`Kernels.act_quant` None).
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels import silu_mul_quant as kernel


def triton_act_quant(gate_up: torch.Tensor, group: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    if torch.compiler.is_compiling() or not kernel.supported(gate_up, group):
        return None
    return kernel.silu_mul_quant(gate_up, group)


def torch_act_quant(gate_up: torch.Tensor, group: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    return kernel.silu_mul_quant_ref(gate_up, group)
