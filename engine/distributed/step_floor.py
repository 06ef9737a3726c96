"""The bytes floor of a decode step: the bytes one GPU must read per step, at the copy bandwidth it measured.

A decode step reads, once, every weight it touches and the KV cache it attends over; no step can be
faster than those bytes at the GPU's device-to-device copy bandwidth (`copy_bandwidth`). Per rank
of a layout (`tp` ranks, `dp` DP-attention groups of tp / dp ranks each):

- weights, counted by engine/memory/weight_tally.py's `Tally` (the memory plan's own count): norms,
  q_a / kv_a whole on every rank, q_b (or q) / kv_b / o_proj over the attention-TP group (kv_b stands
  for the absorbed w_kc / w_vc a decode step reads: the same weights), the dense MLP, the shared
  experts and the routed experts the batch's tokens select over all tp ranks (the expected count
  under uniform routing, e (1 - (1 - k / e)^bs): the MoE runs every group's tokens), the router;
  block-FP8 linears 1 byte per weight plus a float32 per block, everything else the model dtype;
  then lm_head over the attention-TP group and the group's embedding rows.
- KV: MLA's latent is not split by TP, so every rank of a group reads all its requests' cache: the
  busiest group's ceil(bs / dp) requests x `ctx` tokens x the KV row x the KV dtype's bytes, per layer.

Expert parallelism (whole experts per rank) reads, in expectation, the same bytes as the TP split of
every expert, so it needs no term. Used by `dsctl bench one-batch` (its floor columns) and by
benchmarks/bench_decode.py, multi_gpu_tables.py and serve_sweep.sh.
"""

from __future__ import annotations

import statistics
from typing import Optional, Union

import torch

from engine.checkpoint.config import ModelConfig, parse_config
from engine.checkpoint.registry import lookup
from engine.memory.weight_tally import ATTN, REPL, SPLIT, Tally

FP8_BLOCK = (128, 128)  # the weight tile of --quantization fp8 (a block-FP8 checkpoint brings its own)


def _tally(cfg: ModelConfig, weight_bytes: int) -> Tally:
    """weight_bytes 1: block-FP8 linears (bf16 elsewhere); else every weight in that many bytes."""
    if weight_bytes == 1:
        return Tally(2, (cfg.fp8.block_n, cfg.fp8.block_k) if cfg.fp8 else FP8_BLOCK)
    return Tally(weight_bytes, None)


def _per_rank(t: Tally, tp: int, dp: int) -> float:
    return t.bytes[REPL] + t.bytes[ATTN] / (tp // dp) + t.bytes[SPLIT] / tp


def layer_bytes(cfg: ModelConfig, layer: int, bs: int, ctx: int, kv_bytes: int, weight_bytes: int = 1, tp: int = 1,
                dp: int = 1, kv_dim: Optional[int] = None) -> dict:
    """{"weights": ..., "kv": ...}: the bytes one rank reads for decoder layer `layer` in a decode step of bs
    requests at context ctx (see the module docstring; `kv_dim`: the KV row, by default MLA's latent)."""
    t = _tally(cfg, weight_bytes)
    moe = cfg.is_moe_layer(layer)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    t.decoder_layer(cfg, moe, e * (1 - (1 - k / e) ** bs) if moe else None)
    kv = -(-bs // dp) * ctx * (kv_dim or cfg.kv_cache_dim) * kv_bytes
    return {"weights": _per_rank(t, tp, dp), "kv": kv}


def step_bytes(cfg: ModelConfig, n_layers: int, bs: int, ctx: int, kv_bytes: int, weight_bytes: int = 1,
               tp: int = 1, dp: int = 1, kv_dim: Optional[int] = None) -> float:
    """The bytes one rank reads in a decode step of the first n_layers layers: `layer_bytes` of each, plus
    lm_head, the final norm and the group's embedding rows."""
    total = sum(sum(layer_bytes(cfg, i, bs, ctx, kv_bytes, weight_bytes, tp, dp, kv_dim).values())
                for i in range(n_layers))
    t = _tally(cfg, weight_bytes)
    t.dense(cfg.vocab_size * cfg.hidden_size, ATTN)  # lm_head (vocab rows over the attention group)
    t.dense(cfg.hidden_size * (1 + -(-bs // dp)), REPL)  # final norm, embedding rows
    return total + _per_rank(t, tp, dp)


def step_floor_s(cfg: ModelConfig, n_layers: int, bs: int, ctx: int, kv_bytes: int, bw: float, weight_bytes: int = 1,
                 tp: int = 1, dp: int = 1, kv_dim: Optional[int] = None) -> float:
    """The bytes floor of one decode step on one GPU (`step_bytes`) at copy bandwidth bw (bytes/s)."""
    return step_bytes(cfg, n_layers, bs, ctx, kv_bytes, weight_bytes, tp, dp, kv_dim) / bw


def serving_floor_ms(model: str, n_layers: int, bs: int, ctx: int, bw: float, tp: int = 1, dp: int = 1,
                     quantization: str = "none", kv_bytes: int = 2) -> float:
    """The bytes floor of one decode step of a served registry model (dummy weights: FP8 where the
    checkpoint is block-FP8 or under --quantization fp8 / w4afp8, INT4 routed experts under w4afp8, else bf16;
    a bf16 KV cache, or `kv_bytes` per element: 1 for an FP8 one) at batch bs and context ctx, in ms, per GPU
    of the layout."""
    cfg = parse_config(lookup(model).config_dict())
    if quantization == "w4afp8":
        cfg = cfg.with_int4_experts()  # keeps a W4AFP8 checkpoint's own group
    weight_bytes = 1 if cfg.fp8 or quantization in ("fp8", "w4afp8") else 2
    return step_floor_s(cfg, n_layers or cfg.num_hidden_layers, bs, ctx, kv_bytes, bw, weight_bytes, tp, dp) * 1e3


def copy_bandwidth(device: Union[str, torch.device] = "cuda") -> float:
    """Bytes/s of a large device-to-device copy on a CUDA device, counting bytes read plus written (median
    of 10 after 3 warm-ups); its 2 GiB are given back to the allocator's cache before it returns."""
    n = 1 << 30
    with torch.cuda.device(device):
        a = torch.empty(n, dtype=torch.uint8, device=device)
        a.random_()
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            b.copy_(a)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        del a, b
        torch.cuda.empty_cache()
    return 2 * n / statistics.median(times)
