"""Greedy decoding of a W4AFP8 model without the runner, the same way in one process and on every rank of a
gloo world (tests/distributed/test_w4afp8_model.py): build the model for a TP group from a checkpoint, prefill
one prompt, decode a few greedy tokens (rank 0's broadcast), return the tokens and the last logits; and the
next-token log-probs at every position of a prompt (the W4AFP8-vs-FP8 error measurement)."""

from __future__ import annotations

import os

import torch

from engine.distributed import comm
from engine.distributed.groups import init_parallel
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory.pools import KVPool, ReqToTokenPool
from engine.model.attention import TorchAttentionBackend
from engine.model.builder import build_model
from engine.model.context import ForwardContext
from engine.model.moe import TorchMoEBackend
from engine.model.rope import RotaryEmbedding

PROMPT = [5, 77, 190, 3, 42, 250, 18, 9, 131, 64, 7]
STEPS = 5
LAYERS = 2  # greedy(): the dense layer 0 and the first MoE layer (cheap on CI's two cores)


def greedy(path, cfg, tp=None, prompt=PROMPT) -> dict:
    dev, dt = torch.device("cpu"), torch.float32
    model, _ = build_model(cfg, LAYERS, dt, dev, None, tp, checkpoint=path, mtp=False)
    kv = KVPool(LAYERS, 64, cfg.kv_cache_dim, dt, dev)
    table = ReqToTokenPool(1, 64, dev)
    ctx = ForwardContext(kv, table, RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, 64, dev), TorchAttentionBackend(),
                         TorchMoEBackend())
    row, tokens, seq = table.alloc(), [], 0
    ids, mode = list(prompt), ForwardMode.EXTEND
    for _ in range(STEPS):
        slots = kv.alloc(len(ids))
        table.set(row, seq, slots)
        fb = ForwardBatch.build(mode, ids, [row], [seq], [len(ids)], slots, [len(ids) - 1], dev)
        ctx.begin_forward(fb)
        with torch.inference_mode():
            logits = model.logits(model.hidden_states(fb, ctx)[fb.logits_indices])
        nxt = logits.argmax(-1)
        if tp is not None and tp.size > 1:
            comm.broadcast_tensor(nxt, 0, tp)
        seq += len(ids)
        ids, mode = nxt.tolist(), ForwardMode.DECODE
        tokens += ids
    return {"tokens": tokens, "logits": logits}


def prompt_logprobs(path, cfg, prompt=PROMPT) -> torch.Tensor:
    """Next-token log-probs [len(prompt), vocab] at every prompt position (one prefill, one process)."""
    dev, dt = torch.device("cpu"), torch.float32
    model, _ = build_model(cfg, cfg.num_hidden_layers, dt, dev, checkpoint=path, mtp=False)
    kv = KVPool(cfg.num_hidden_layers, 64, cfg.kv_cache_dim, dt, dev)
    table = ReqToTokenPool(1, 64, dev)
    ctx = ForwardContext(kv, table, RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, 64, dev), TorchAttentionBackend(),
                         TorchMoEBackend())
    row, slots = table.alloc(), kv.alloc(len(prompt))
    table.set(row, 0, slots)
    fb = ForwardBatch.build(ForwardMode.EXTEND, list(prompt), [row], [0], [len(prompt)], slots,
                            list(range(len(prompt))), dev)
    ctx.begin_forward(fb)
    with torch.inference_mode():
        return torch.log_softmax(model.logits(model.hidden_states(fb, ctx)[fb.logits_indices]).double(), -1)


def rank_main(local_rank: int, pc, sources, out_dir: str) -> None:
    torch.set_num_threads(1)
    state = init_parallel(pc, local_rank, "cpu")
    try:
        for i, (path, cfg) in enumerate(sources):
            torch.save(greedy(path, cfg, state.tp), os.path.join(out_dir, f"src{i}.rank{state.tp.rank}.pt"))
    finally:
        state.destroy()
