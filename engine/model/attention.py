"""Multi-head Latent Attention (MLA) and its pure-torch attention backend.

Per token the cache holds the normalised latent c_kv (kv_lora_rank) and the
rotated shared rope key k_pe (qk_rope_head_dim). Two ways to attend:

- extend (prefill): expand the latent with kv_b_proj into per-head k_nope / v
  and run ordinary attention (causal among new tokens, full over the prefix);
- decode (absorbed): fold W_UK into the query (q_nope @ W_UK, a query in latent
  space), attend over c_kv / k_pe directly with one KV head shared by all query
  heads, then map the latent output back with W_UV before o_proj.

Backends implement `begin_forward` (per-forward planning), `extend` and `decode`;
`TorchAttentionBackend` is the reference the Triton/FlashInfer backends are
checked against (the protocol, `AttentionBackend`, is in engine/model/context.py). A layer finds
the backend, the KV pool, the request table and the rope table in the `ForwardContext` passed down
the forward; backends are chosen by name in engine/model/kernel_registry.py, and the layer's
projections and norms run the `Kernels` it is given at construction (engine/model/kernel_set.py); the latent's
norm, the rope of q_pe and k_pe and the cache write run as one kernel where `Kernels.rope_cache` is set.

Tensor parallelism splits MLA by heads: q_a / kv_a (and their norms) are replicated,
q_b (or q_proj), kv_b and the absorbed w_kc / w_vc hold this rank's `H / tp` heads, o_proj
the matching input columns, and one all-reduce sums the ranks' o_proj outputs. `num_heads`
is the local head count, which is all the backends see; the latent KV cache is the
whole latent on every rank.

q_a_proj and kv_a_proj_with_mqa read the same input: after loading, `merge_qkv_a` (engine/model/builder.py's
post-load step) stacks them into one qkv_a_proj (q_lora_rank + kv_lora_rank + qk_rope_head_dim rows; one GEMM
and one FP8 activation quantisation instead of two; tuning/shapes.py: "qkv_a_proj"). Both are replicated,
so every rank merges its whole copies; loading and dummy weights fill the two checkpoint tensors before.
V2-Lite (no q_lora_rank) keeps q_proj and kv_a_proj_with_mqa apart. The layer input and q_a's norm reach
their FP8 GEMMs through RMSNorm.for_linear (fused with the activation quantisation where the kernels say so).

With --disable-mla (`ctx.expanded_kv`) the layer instead caches each head's expanded
key and value and runs plain multi-head attention: engine/model/attention_expanded.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from engine.checkpoint.config import ModelConfig
from engine.distributed.groups import TPGroup
from engine.forward_batch import ForwardBatch
from engine.model.context import ForwardContext
from engine.model.kernel_set import REFERENCE, Kernels
from engine.model.layers import Activation, Linear, RMSNorm, solo_group, stacked, tp_local


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, fp8_block=None,
                 tp: Optional[TPGroup] = None, kernels: Kernels = REFERENCE):
        super().__init__()
        self.layer_id = layer_id
        self.kernels = kernels
        self.tp = tp or solo_group()
        self.num_heads = h = tp_local(cfg.num_attention_heads, self.tp, "num_attention_heads")  # this rank's heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        qk = cfg.qk_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype, fp8_block, kernels)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype, kernels)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * qk, dtype, fp8_block, kernels)
        else:
            self.q_proj = Linear(cfg.hidden_size, h * qk, dtype, fp8_block, kernels)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype, fp8_block,
                                         kernels)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype, kernels)
        self.qkv_a_proj: Optional[Linear] = None  # q_a_proj and kv_a_proj_with_mqa stacked, by merge_qkv_a
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (self.nope + self.v_dim), dtype, fp8_block, kernels)
        self.o_proj = Linear(h * self.v_dim, cfg.hidden_size, dtype, fp8_block, kernels)
        # Absorbed per-head weights, filled by absorb() after loading.
        self.register_buffer("w_kc", torch.empty(h, self.nope, cfg.kv_lora_rank, dtype=dtype), persistent=False)
        self.register_buffer("w_vc", torch.empty(h, self.v_dim, cfg.kv_lora_rank, dtype=dtype), persistent=False)
        # FP8 views of the same weights for the FP8 batched matmul (W8A8 checkpoints only).
        self.w_kc_fp8 = self.w_kc_scale = self.w_vc_fp8 = self.w_vc_scale = None

    def absorb(self) -> None:
        """Split kv_b_proj per head into W_UK [H, nope, kv_lora] and W_UV [H, v, kv_lora].

        When kv_b_proj is block FP8 and each head's nope / v rows are whole 128-row blocks
        (DeepSeek-V3: 128 + 128), also keep exact FP8 views, [H, K, N]-oriented for fp8_bmm."""
        h, per_head = self.num_heads, self.nope + self.v_dim
        w = self.kv_b_proj.dense_weight(self.w_kc.dtype).view(h, per_head, -1)
        self.w_kc = w[:, : self.nope].contiguous()
        self.w_vc = w[:, self.nope:].contiguous()
        block = self.kv_b_proj.fp8_block
        if block is None or self.nope % block[0] or self.v_dim % block[0] or self.kv_lora_rank % block[1]:
            return
        q = self.kv_b_proj.weight.view(h, per_head, -1)
        s = self.kv_b_proj.weight_scale_inv.view(h, per_head // block[0], -1)
        nb = self.nope // block[0]
        self.w_kc_fp8, self.w_kc_scale = q[:, : self.nope], s[:, :nb]  # [H, nope, kv_lora] = [H, K, N]
        self.w_vc_fp8 = q[:, self.nope:].transpose(1, 2)  # [H, kv_lora, v] = [H, K, N]
        self.w_vc_scale = s[:, nb:].transpose(1, 2)

    def merge_qkv_a(self) -> None:
        """Replace q_a_proj and kv_a_proj_with_mqa by one qkv_a_proj holding both (q_a rows first). FP8 weights
        merge when q_a's rows are whole scale blocks (DeepSeek-V2/V3: 1536 = 12 x 128), so kv_a's scale rows
        (576 rows: 5, the last covering 64) follow q_a's on a block boundary; otherwise they stay apart."""
        if not hasattr(self, "q_a_proj"):
            return  # no q_lora_rank (V2-Lite): q_proj is split by heads, kv_a is not
        merged = stacked(self.q_a_proj, self.kv_a_proj_with_mqa, self.kernels)
        if merged is None:
            return
        del self.q_a_proj, self.kv_a_proj_with_mqa
        self.qkv_a_proj = merged

    def input_linears(self) -> tuple[Linear, ...]:
        """The linears that read the layer's (normalised) input, for RMSNorm.for_linear."""
        if self.qkv_a_proj is not None:
            return (self.qkv_a_proj,)
        return (self.q_a_proj if hasattr(self, "q_a_proj") else self.q_proj, self.kv_a_proj_with_mqa)

    def project(self, x: Activation) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, H_local * qk_head_dim], latent [T, kv_lora_rank + rope] (c_kv before its norm)."""
        if self.qkv_a_proj is not None:
            q_lora = self.q_b_proj.in_features
            q_a, latent = self.qkv_a_proj(x).split([q_lora, self.qkv_a_proj.out_features - q_lora], dim=-1)
            return self.q_b_proj(self.q_a_layernorm.for_linear(q_a, self.q_b_proj)), latent
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm.for_linear(self.q_a_proj(x), self.q_b_proj))
        else:
            q = self.q_proj(x)
        return q, self.kv_a_proj_with_mqa(x)

    def expand_latent(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent [L, kv_lora] -> k_nope [L, H, nope], v [L, H, v] (non-absorbed path)."""
        kv = self.kv_b_proj(c_kv).view(-1, self.num_heads, self.nope + self.v_dim)
        return kv[..., : self.nope], kv[..., self.nope:]

    def rope_and_cache(self, q: torch.Tensor, latent: torch.Tensor, fb: ForwardBatch,
                       ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, qk], latent [T, kv_lora + rope] -> (rotated q_pe, normalised c_kv, rotated k_pe), each token's
        latent cache row [c_kv, k_pe] written (not with --disable-mla): in one kernel (`kernels.rope_cache`), else
        op by op."""
        rotary, norm = ctx.rotary, self.kv_a_layernorm
        if self.kernels.rope_cache is not None:
            cache = None if ctx.expanded_kv else ctx.kv_pool.buffer[self.layer_id]
            fused = self.kernels.rope_cache(q, latent, norm.weight, norm.eps, rotary.cos, rotary.sin, fb.positions,
                                            self.kv_lora_rank, cache, fb.out_cache_loc, ctx.kv_pool.scale)
            if fused is not None:
                return fused
        c_kv = norm(latent[:, : self.kv_lora_rank])
        q_pe = rotary.apply(q[..., self.nope:], fb.positions)
        k_pe = rotary.apply(latent[:, self.kv_lora_rank:], fb.positions)
        if not ctx.expanded_kv:
            ctx.kv_pool.write(self.layer_id, fb.out_cache_loc, torch.cat((c_kv, k_pe), dim=-1))
        return q_pe, c_kv, k_pe

    def forward(self, x: Activation, fb: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        """x: the normalised layer input [T, hidden] (or its FP8Input: RMSNorm.for_linear(input_linears()))."""
        t = x.shape[0]
        q, latent = self.project(x)
        q = q.view(t, self.num_heads, self.nope + self.rope_dim)
        q_nope = q[..., : self.nope]
        q_pe, c_kv, k_pe = self.rope_and_cache(q, latent, fb, ctx)
        if ctx.expanded_kv:  # --disable-mla: per-head K/V in the cache (engine/model/attention_expanded.py)
            out = ctx.attn_backend.expand_and_attend(self, q_nope, q_pe, c_kv, k_pe, fb, ctx)
        else:
            if fb.mode.is_decode:
                out = ctx.attn_backend.decode(self, q_nope, q_pe, fb, ctx)
            else:
                out = ctx.attn_backend.extend(self, q_nope, q_pe, c_kv, k_pe, fb, ctx)
        return self.kernels.all_reduce(self.o_proj(out.reshape(t, self.num_heads * self.v_dim)), self.tp)


class TorchAttentionBackend:
    """Reference MLA attention in plain torch: one request at a time, float32 softmax."""

    def begin_forward(self, fb: ForwardBatch, ctx: ForwardContext, graph_bs: int | None = None) -> None:
        pass  # reads lengths from fb as it goes

    def extend(self, layer: MLA, q_nope, q_pe, c_kv, k_pe, fb: ForwardBatch, ctx: ForwardContext):
        out = q_nope.new_empty(q_nope.shape[0], layer.num_heads, layer.v_dim)
        start = 0
        for i, (n, prefix) in enumerate(zip(fb.extend_lens_cpu, fb.prefix_lens_cpu)):
            if n == 0:
                continue
            row = int(fb.req_pool_indices[i])
            cached = ctx.kv_pool.read(layer.layer_id, ctx.req_to_token.slots(row, prefix), c_kv.dtype)
            lat = torch.cat((cached[:, : layer.kv_lora_rank], c_kv[start:start + n]))
            kpe = torch.cat((cached[:, layer.kv_lora_rank:], k_pe[start:start + n]))
            k_nope, v = layer.expand_latent(lat)
            q_n, q_p = q_nope[start:start + n], q_pe[start:start + n]
            scores = torch.einsum("qhd,khd->hqk", q_n.float(), k_nope.float())
            scores += torch.einsum("qhr,kr->hqk", q_p.float(), kpe.float())
            scores *= layer.scale
            q_pos = torch.arange(prefix, prefix + n, device=scores.device)
            k_pos = torch.arange(prefix + n, device=scores.device)
            scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
            probs = scores.softmax(-1)
            out[start:start + n] = torch.einsum("hqk,khv->qhv", probs, v.float()).to(out.dtype)
            start += n
        return out

    def decode(self, layer: MLA, q_nope, q_pe, fb: ForwardBatch, ctx: ForwardContext):
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope.float(), layer.w_kc.float())
        out_lat = torch.empty_like(q_lat)
        for i, seq_len in enumerate(fb.seq_lens_cpu):
            row = int(fb.req_pool_indices[i])
            cache = ctx.kv_pool.read(layer.layer_id, ctx.req_to_token.slots(row, seq_len), torch.float32)
            c, kpe = cache[:, : layer.kv_lora_rank], cache[:, layer.kv_lora_rank:]
            scores = (q_lat[i] @ c.T + q_pe[i].float() @ kpe.T) * layer.scale
            out_lat[i] = scores.softmax(-1) @ c
        out = torch.einsum("bhc,hvc->bhv", out_lat, layer.w_vc.float())
        return out.to(q_nope.dtype)
