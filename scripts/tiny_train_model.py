"""A plain-torch, trainable DeepSeek-V3 model (MLA + noaux_tc MoE + one MTP layer) that exports to HF layout.

The maths is the engine's (engine/model/): MLA with q_lora and a shared rope key, interleaved-pair
RoPE with YaRN (engine.model.rope's tables, so positions and the softmax scale match exactly),
RMSNorm computed like the engine's, SwiGLU experts, the noaux_tc sigmoid router with the
engine's own reference gate (kernels.moe_gate.moe_gate_ref picks the experts; the weights are the
chosen sigmoid scores, normalised, times routed_scaling_factor, differentiable), a shared
expert, dense first layer(s), and the MTP / NextN module of DeepSeek-V3:

    h_i  = the main model's final hidden state at i (before model.norm)
    x_i  = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))  -> one decoder layer
    p(t_{i+2}) = softmax(head(shared_head.norm(x_i)))            (embed and head shared with the main model)

Training uses loss = CE(main, t_{i+1}) + lambda * CE(mtp, t_{i+2}); the MTP gradient also flows
into the main model, as in DeepSeek-V3. Expert balance: DeepSeek-V3's auxiliary-loss-free
update of e_score_correction_bias (`update_router_bias`), no auxiliary loss.

`hf_state_dict()` names every tensor as a DeepSeek-V3 checkpoint does (the MTP module is layer
num_hidden_layers, with its own copies of the embedding and head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint.config import ModelConfig
from engine.model.rope import RotaryEmbedding
from kernels.rms_norm import rms_norm_ref as rms_norm


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(in_f: int, out_f: int) -> nn.Linear:
    return nn.Linear(in_f, out_f, bias=False)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation of x [..., T, H, d] by cos / sin [T, d/2] (engine.model.rope's layout)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


class Attention(nn.Module):
    """MLA, non-absorbed (expand the latent with kv_b_proj, then ordinary causal attention)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        self.q_a_proj = _linear(h, cfg.q_lora_rank)
        self.q_a_layernorm = Norm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = _linear(cfg.q_lora_rank, heads * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = Norm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = _linear(heads * cfg.v_head_dim, h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        b, t, _ = x.shape
        heads, nope, rope, vd = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, heads, nope + rope)
        latent = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(latent[..., : c.kv_lora_rank])
        k_pe = rotate(latent[..., c.kv_lora_rank:].unsqueeze(2), cos, sin)  # [B, T, 1, rope]
        q_pe = rotate(q[..., nope:], cos, sin)
        kv = self.kv_b_proj(c_kv).view(b, t, heads, nope + vd)
        qf = torch.cat((q[..., :nope], q_pe), -1).transpose(1, 2)
        kf = torch.cat((kv[..., :nope], k_pe.expand(b, t, heads, rope)), -1).transpose(1, 2)
        v = kv[..., nope:].transpose(1, 2)
        out = F.scaled_dot_product_attention(qf, kf, v, is_causal=True, scale=c.softmax_scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, heads * vd))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(hidden, inter), _linear(hidden, inter), _linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Routed experts (stacked: gate / up [E, N, K], down [E, K, N]) + shared expert, noaux_tc router."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, k, n = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.gate = nn.Parameter(torch.empty(e, k))
        self.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.register_buffer("load", torch.zeros(e))  # tokens routed to each expert since the last bias update
        self.w_gate = nn.Parameter(torch.empty(e, n, k))
        self.w_up = nn.Parameter(torch.empty(e, n, k))
        self.w_down = nn.Parameter(torch.empty(e, k, n))
        self.shared_experts = MLP(k, n * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.dense_experts = False  # True: every expert on every token, masked (no host syncs; for GPUs)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from kernels.moe_gate import moe_gate_ref

        c = self.cfg
        with torch.autocast(x.device.type, enabled=False):  # the router in float32, as the engine runs it
            logits = F.linear(x.float(), self.gate.float())
        with torch.no_grad():
            _, ids = moe_gate_ref(logits, top_k=c.num_experts_per_tok, method=c.topk_method, n_group=c.n_group,
                                  topk_group=c.topk_group, correction_bias=self.e_score_correction_bias,
                                  norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=1.0,
                                  scoring_func=c.scoring_func, ids_dtype=torch.int64)
            if self.training:
                self.load += torch.bincount(ids.flatten(), minlength=c.n_routed_experts).float()
        scores = logits.sigmoid() if c.scoring_func == "sigmoid" else logits.softmax(-1)
        w = scores.gather(1, ids)
        if c.norm_topk_prob and c.num_experts_per_tok > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * c.routed_scaling_factor, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, ids = self.route(x)
        w = w.to(x.dtype)
        if self.dense_experts:
            combine = torch.zeros(x.shape[0], self.cfg.n_routed_experts, dtype=x.dtype, device=x.device)
            combine = combine.scatter(1, ids, w)
            hid = F.silu(torch.einsum("tk,enk->ten", x, self.w_gate)) * torch.einsum("tk,enk->ten", x, self.w_up)
            out = torch.einsum("ten,ekn,te->tk", hid, self.w_down, combine)
        else:
            out = torch.zeros_like(x)
            for e in range(self.cfg.n_routed_experts):
                tok, slot = (ids == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                xe = x[tok]
                ye = F.linear(F.silu(F.linear(xe, self.w_gate[e])) * F.linear(xe, self.w_up[e]), self.w_down[e])
                out = out.index_add(0, tok, ye * w[tok, slot, None])
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool):
        super().__init__()
        self.input_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyDeepseek(nn.Module):
    """Main model + one MTP module. forward(tokens [B, T+2]) -> (main loss, MTP loss, MTP logits)."""

    def __init__(self, cfg: ModelConfig, max_len: int):
        super().__init__()
        if not cfg.num_nextn_predict_layers:
            raise ValueError("the training model needs num_nextn_predict_layers = 1")
        h = cfg.hidden_size
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, h))
        self.layers = nn.ModuleList(Block(cfg, cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers))
        self.norm = Norm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, h))
        # MTP / NextN module (layer num_hidden_layers in the checkpoint)
        self.enorm, self.hnorm = Norm(h, cfg.rms_norm_eps), Norm(h, cfg.rms_norm_eps)
        self.eh_proj = _linear(2 * h, h)
        self.mtp_block = Block(cfg, cfg.is_moe_layer(cfg.num_hidden_layers))
        self.shared_head_norm = Norm(h, cfg.rms_norm_eps)
        rot = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, max_len, torch.device("cpu"))
        self.register_buffer("cos", rot.cos, persistent=False)
        self.register_buffer("sin", rot.sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        depth = self.cfg.num_hidden_layers + 1
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "w_down")):
                nn.init.normal_(p, std=std / (2 * depth) ** 0.5)
            else:
                nn.init.normal_(p, std=std)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def set_dense_experts(self, on: bool) -> None:
        for m in self.moe_layers():
            m.dense_experts = on

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """Final pre-norm hidden states [B, T, h] of the main model."""
        t = ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = F.embedding(ids, self.embed_tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x

    def mtp_hidden(self, next_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """MTP hidden states: row i takes token t_{i+1} (next_ids) and the main model's h_i (position i)."""
        t = next_ids.shape[1]
        e = self.enorm(F.embedding(next_ids, self.embed_tokens))
        x = self.eh_proj(torch.cat((e, self.hnorm(h)), dim=-1))
        return self.mtp_block(x, self.cos[:t], self.sin[:t])

    def main_logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(h), self.lm_head).float()

    def mtp_logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.shared_head_norm(x), self.lm_head).float()

    def forward(self, tokens: torch.Tensor):
        """tokens [B, T+2] -> (main CE over t_1..t_T, MTP CE over t_2..t_{T+1}, main logits, MTP logits)."""
        inp, nxt, nxt2 = tokens[:, :-2], tokens[:, 1:-1], tokens[:, 2:]
        h = self.hidden(inp)
        main = self.main_logits(h)
        mtp = self.mtp_logits(self.mtp_hidden(nxt, h))
        v = self.cfg.vocab_size
        return (F.cross_entropy(main.reshape(-1, v), nxt.reshape(-1)),
                F.cross_entropy(mtp.reshape(-1, v), nxt2.reshape(-1)), main, mtp)


@torch.no_grad()
def update_router_bias(model: TinyDeepseek, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower the
    others', by `rate` (the sign of the load's deviation from the mean), then reset the counts."""
    for m in model.moe_layers():
        if m.load.sum() > 0:
            m.e_score_correction_bias += rate * torch.sign(m.load.mean() - m.load)
        m.load.zero_()


def _block_state(block: Block, p: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    sd = {p + "input_layernorm.weight": block.input_layernorm.weight,
          p + "post_attention_layernorm.weight": block.post_attention_layernorm.weight}
    for name, t in block.self_attn.state_dict().items():
        sd[p + "self_attn." + name] = t
    mlp = block.mlp
    if isinstance(mlp, MoE):
        sd[p + "mlp.gate.weight"] = mlp.gate
        sd[p + "mlp.gate.e_score_correction_bias"] = mlp.e_score_correction_bias
        for e in range(cfg.n_routed_experts):
            q = f"{p}mlp.experts.{e}."
            sd[q + "gate_proj.weight"], sd[q + "up_proj.weight"] = mlp.w_gate[e], mlp.w_up[e]
            sd[q + "down_proj.weight"] = mlp.w_down[e]
        if mlp.shared_experts is not None:
            for name, t in mlp.shared_experts.state_dict().items():
                sd[p + "mlp.shared_experts." + name] = t
    else:
        for name, t in mlp.state_dict().items():
            sd[p + "mlp." + name] = t
    return sd


def hf_state_dict(model: TinyDeepseek, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every tensor under its DeepSeek-V3 checkpoint name, in dtype (the router bias stays float32)."""
    cfg = model.cfg
    sd = {"model.embed_tokens.weight": model.embed_tokens, "model.norm.weight": model.norm.weight,
          "lm_head.weight": model.lm_head}
    for i, layer in enumerate(model.layers):
        sd.update(_block_state(layer, f"model.layers.{i}.", cfg))
    p = f"model.layers.{cfg.num_hidden_layers}."
    sd.update(_block_state(model.mtp_block, p, cfg))
    sd.update({p + "enorm.weight": model.enorm.weight, p + "hnorm.weight": model.hnorm.weight,
               p + "eh_proj.weight": model.eh_proj.weight, p + "shared_head.norm.weight": model.shared_head_norm.weight,
               p + "shared_head.head.weight": model.lm_head, p + "embed_tokens.weight": model.embed_tokens})
    out = {}
    for name, t in sd.items():
        t = t.detach().to("cpu").contiguous()
        out[name] = t.float() if name.endswith("e_score_correction_bias") else t.to(dtype)
    return out


def load_hf_state_dict(model: TinyDeepseek, sd: dict[str, torch.Tensor]) -> None:
    """Inverse of hf_state_dict: fill model from HF-named tensors (e.g. a shipped checkpoint)."""
    names = hf_state_dict(model, torch.float32)
    missing = sorted(set(names) - set(sd))
    if missing:
        raise KeyError(f"missing tensors: {missing[:5]}")
    with torch.no_grad():
        for name, t in _param_views(model).items():
            t.copy_(sd[name].to(t.dtype))


def _param_views(model: TinyDeepseek) -> dict[str, torch.Tensor]:
    """HF name -> the live tensor (a view into the model's parameters) it comes from."""
    cfg = model.cfg
    views = {}
    for i, layer in enumerate(list(model.layers) + [model.mtp_block]):
        views.update(_block_state(layer, f"model.layers.{i}.", cfg))
    p = f"model.layers.{cfg.num_hidden_layers}."
    views.update({"model.embed_tokens.weight": model.embed_tokens, "model.norm.weight": model.norm.weight,
                  "lm_head.weight": model.lm_head, p + "enorm.weight": model.enorm.weight,
                  p + "hnorm.weight": model.hnorm.weight, p + "eh_proj.weight": model.eh_proj.weight,
                  p + "shared_head.norm.weight": model.shared_head_norm.weight})
    return {k: v.data for k, v in views.items()}
