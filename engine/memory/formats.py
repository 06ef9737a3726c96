"""How each `--quantization` stores the model's linear weights: bytes of an [out, in] matrix, per weight kind.

The memory plan (engine/memory/plan.py) reads weights through this table only. A `Quantization` names the
format of the linear layers (attention projections, dense MLP, shared experts) and of the routed experts;
everything else (embeddings, lm_head, norms, the MTP layer's eh_proj, the absorbed w_kc / w_vc) stays in the
model dtype, and the router in float32 (engine/memory/weight_tally.py). A new scheme is one entry of
`QUANTIZATIONS` (or one `register` call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class WeightFormat:
    """One weight matrix's storage: `bits` per weight, plus one scale of `scale_bytes` per
    `scale_block` = (rows of out, columns of in) it covers (None: no scales; the model dtype)."""

    bits: Optional[int] = None  # None: the model dtype's width
    scale_block: Optional[tuple[int, int]] = None
    scale_bytes: int = 4

    def nbytes(self, out_f: int, in_f: int, dtype_bytes: int = 2) -> float:
        """Bytes of one [out_f, in_f] weight and its scales."""
        bits = self.bits if self.bits is not None else 8 * dtype_bytes
        scales = 0
        if self.scale_block is not None:
            bn, bk = self.scale_block
            scales = math.ceil(out_f / bn) * math.ceil(in_f / bk) * self.scale_bytes
        return out_f * in_f * bits / 8 + scales


MODEL_DTYPE = WeightFormat()
FP8_BLOCK = WeightFormat(8, (128, 128), 4)  # e4m3 weights, a float32 scale per 128 x 128 block
INT4_G128 = WeightFormat(4, (1, 128), 4)  # two INT4 weights a byte, a float32 scale per 128 along K


@dataclass(frozen=True)
class Quantization:
    """A `--quantization` scheme as memory sees it: the format of linear layers and of routed experts."""

    name: str
    linear: WeightFormat
    experts: WeightFormat
    label: str = ""

    @property
    def fp8_block(self) -> Optional[tuple[int, int]]:
        """The block the linear layers keep FP8 (None: model dtype)."""
        return self.linear.scale_block if self.linear.bits == 8 else None


QUANTIZATIONS: dict[str, Quantization] = {}


def register(q: Quantization) -> Quantization:
    QUANTIZATIONS[q.name] = q
    return q


register(Quantization("bf16", MODEL_DTYPE, MODEL_DTYPE, "model dtype (bf16) weights"))
register(Quantization("fp8", FP8_BLOCK, FP8_BLOCK, "block-FP8 weights (128 x 128 float32 scales)"))
register(Quantization("w4afp8", FP8_BLOCK, INT4_G128,
                      "INT4 routed experts (a float32 scale per 128 along K), the rest as the checkpoint ships it"))


def quantization_for(name: str, fp8_block: Optional[tuple[int, int]] = None, int4_group: int = 128) -> Quantization:
    """The scheme `name` as the engine builds it: linear layers block-FP8 in `fp8_block` when kept FP8 (None: the
    model dtype; `w4afp8` keeps them as the checkpoint ships them), routed experts INT4 in groups of `int4_group`
    along K under `w4afp8`, else like the linear layers."""
    linear = WeightFormat(8, fp8_block, 4) if fp8_block else MODEL_DTYPE
    experts = WeightFormat(4, (1, int4_group), 4) if name == "w4afp8" else linear
    return Quantization(name, linear, experts, QUANTIZATIONS[name].label)


def bytes_per_param() -> dict[str, tuple[float, float]]:
    """Scheme -> (linear, routed-expert) bytes per weight for a large matrix (scales included), model dtype bf16:
    the table docs/memory_plan.md shows."""
    big = 128 * 1024
    return {n: (q.linear.nbytes(big, big) / big**2, q.experts.nbytes(big, big) / big**2)
            for n, q in QUANTIZATIONS.items()}
