"""Triton MLA attention backend (kernels/mla_decode.py, kernels/mla_extend.py).

- extend: the new tokens' k_nope / v come from kv_b_proj on their fresh latent; a
  cached prefix is read back from the latent cache and expanded the same way; the
  packed varlen kernel attends causally over new tokens and fully over the prefix.
- decode: q_nope is absorbed into latent space (bmm with W_UK, or the FP8 bmm when
  the weights are FP8), the split-KV decode kernel reads the paged latent cache
  directly (bf16 or FP8 with a scale), and the latent output goes back through W_UV.

Every decode launch has fixed shapes and reads lengths from device tensors, so a
decode step can be captured in a CUDA graph. The kernel calls are opaque to
torch.compile (`torch.compiler.disable`): it compiles the code between them.
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch
from engine.model.attention import MLA
from engine.model.context import ForwardContext


def absorbed_query(layer: MLA, q_nope: torch.Tensor) -> torch.Tensor:
    """q_nope [B, H, nope] -> q in latent space [B, H, kv_lora] (W_UK folded in)."""
    if layer.w_kc_fp8 is not None:
        from kernels.fp8 import fp8_bmm

        return fp8_bmm(q_nope.transpose(0, 1), layer.w_kc_fp8, layer.w_kc_scale).transpose(0, 1)
    return torch.bmm(q_nope.transpose(0, 1), layer.w_kc).transpose(0, 1)


def latent_to_values(layer: MLA, out_lat: torch.Tensor) -> torch.Tensor:
    """Latent attention output [B, H, kv_lora] -> per-head values [B, H, v] (W_UV)."""
    if layer.w_vc_fp8 is not None:
        from kernels.fp8 import fp8_bmm

        return fp8_bmm(out_lat.transpose(0, 1), layer.w_vc_fp8, layer.w_vc_scale).transpose(0, 1)
    return torch.bmm(out_lat.transpose(0, 1), layer.w_vc.transpose(1, 2)).transpose(0, 1)


class TritonAttentionBackend:
    def __init__(self, num_kv_splits: int | None = None):
        self.num_kv_splits = num_kv_splits

    def begin_forward(self, fb: ForwardBatch, ctx: ForwardContext, graph_bs: int | None = None) -> None:
        pass  # the kernels read lengths from device tensors: nothing to plan

    @torch.compiler.disable
    def extend(self, layer: MLA, q_nope, q_pe, c_kv, k_pe, fb: ForwardBatch, ctx: ForwardContext):
        from kernels.mla_extend import extend_attention

        t, h = q_nope.shape[:2]
        k_nope, v = layer.expand_latent(c_kv)
        q = torch.cat((q_nope, q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe[:, None, :].expand(t, h, -1)), dim=-1)
        kp, vp = self._prefix_kv(layer, fb, ctx, c_kv.dtype)
        return extend_attention(q, k, v.contiguous(), kp, vp, fb.extend_lens, fb.prefix_lens, layer.scale,
                                max_extend_len=max(fb.extend_lens_cpu, default=0))

    def _prefix_kv(self, layer: MLA, fb: ForwardBatch, ctx: ForwardContext, dtype):
        h, dqk = layer.num_heads, layer.nope + layer.rope_dim
        if not any(fb.prefix_lens_cpu):
            empty = torch.empty(0, h, dqk, dtype=dtype, device=ctx.kv_pool.buffer.device)
            return empty, empty[..., : layer.v_dim]
        slots = torch.cat([ctx.req_to_token.slots(int(r), p)
                           for r, p in zip(fb.req_pool_indices.tolist(), fb.prefix_lens_cpu)])
        cached = ctx.kv_pool.read(layer.layer_id, slots, dtype)
        k_nope, v = layer.expand_latent(cached[:, : layer.kv_lora_rank])
        k_pe = cached[:, None, layer.kv_lora_rank:].expand(-1, h, -1)
        return torch.cat((k_nope, k_pe), dim=-1), v.contiguous()

    @torch.compiler.disable
    def decode(self, layer: MLA, q_nope, q_pe, fb: ForwardBatch, ctx: ForwardContext):
        from kernels.mla_decode import mla_decode

        q_lat = absorbed_query(layer, q_nope)
        pool = ctx.kv_pool
        out_lat = mla_decode(q_lat.contiguous(), q_pe.contiguous(), pool.buffer[layer.layer_id],
                             ctx.req_to_token.table, fb.req_pool_indices, fb.seq_lens, layer.scale,
                             num_kv_splits=self.num_kv_splits, kv_scale=pool.scale)
        return latent_to_values(layer, out_lat.to(q_nope.dtype))
