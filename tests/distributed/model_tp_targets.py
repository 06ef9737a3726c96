"""A small fixed workload for the tensor-parallel model tests, run the same way by one process
(the reference) and by every rank of a gloo world (tests/distributed/test_model_tp.py).

`run_workload` builds the model for a TP group with engine/model/builder.py from a built-in
checkpoint, then drives it without the runner: a prefill of three prompts of mixed lengths
(one of them in two chunks, the second over its cached prefix), two greedy decode steps, and
a draft-extend of the MTP layer. It returns every logits tensor and the greedy tokens. The
greedy tokens fed back are broadcast from rank 0, as the engine does.

`rank_main` is a rank's body: it joins the world, runs each case and saves its outputs to
`out_dir/<case>.rank<r>.pt` for the test process to compare.
"""

from __future__ import annotations

import os
import re
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Optional

import torch

PROMPT_LENS = (5, 11, 3)  # the 11-token prompt is prefilled in two chunks: 7, then 4 over the cached 7
FIRST_CHUNK = 7
DECODE_STEPS = 2


@dataclass(frozen=True)
class Case:
    model: str  # registry alias of a built-in checkpoint
    attention: str = "torch"  # attention backend
    moe: str = "torch"  # MoE backend
    keep_fp8: bool = False  # keep FP8 weights FP8 (the W8A8 path; Triton GEMM under the interpreter)
    # with keep_fp8: the W8A8 maths in plain torch (block_fp8_matmul_ref; the norms before block-FP8 GEMMs
    # quantise with the reference of the fused norm + quantisation), no Triton: cheap enough for every TP size
    w8a8_torch: bool = False

    @property
    def tag(self) -> str:
        return (f"{self.model}-{self.attention}-{self.moe}{'-w8a8' if self.keep_fp8 else ''}"
                f"{'-torch' if self.w8a8_torch else ''}")


def case_kernels(case: Case, cfg, block, old_paths: bool):
    """The Kernels the case's model runs: 'auto' on CPU, or the W8A8 torch maths; with weights not kept FP8 the
    shared experts run inside the routed experts' launch (--shared-experts-backend fused; kept FP8, tiny's
    128-wide experts split at TP 2 into half blocks, where fusion is refused). old_paths: no RMSNorm and no
    SiLU(gate) * up fused with the FP8 quantisation of the GEMM after it, shared experts apart (and run_workload
    keeps q_a / kv_a apart)."""
    from engine.model import act_ops, fp8_ops, norm_ops
    from engine.model.builder import default_kernels
    from engine.model.kernel_set import REFERENCE
    from kernels.fp8 import block_fp8_matmul_ref

    if case.w8a8_torch:
        kernels = replace(REFERENCE, gemm=block_fp8_matmul_ref, norm_quant=norm_ops.torch_norm_quant,
                          act_quant=act_ops.torch_act_quant, add_norm_quant=norm_ops.torch_add_norm_quant,
                          gemm_q=fp8_ops.torch_linear_q)
    else:
        kernels = default_kernels(cfg, torch.float32, torch.device("cpu"), block)
    if old_paths:
        return replace(kernels, norm_quant=None, act_quant=None, add_norm_quant=None, gemm_q=None)
    return replace(kernels, shared_experts_fused=block is None)


def params_by_checkpoint_name(model, mtp) -> dict[str, torch.Tensor]:
    """Every parameter of a built (model, MTP layer), an MLP's merged gate_up_proj given back as the
    gate_proj and up_proj halves it was loaded as (MLP.merge_gate_up merges only where the rank's rows are
    whole FP8 blocks, so whether a layer is merged can differ between TP sizes), and MLA's qkv_a_proj as
    q_a_proj (its first q_lora_rank rows, or their scale rows) and kv_a_proj_with_mqa (the rest)."""
    from engine.weights.loader import iter_params

    out = {}
    for name, p in iter_params({"": model, "mtp.": mtp} if mtp is not None else {"": model}):
        m = re.fullmatch(r"(.*)\.gate_up_proj\.(weight|weight_scale_inv)", name)
        a = re.fullmatch(r"(.*)\.qkv_a_proj\.(weight|weight_scale_inv)", name)
        if m:
            out[f"{m[1]}.gate_proj.{m[2]}"], out[f"{m[1]}.up_proj.{m[2]}"] = p.chunk(2, dim=0)
        elif a:
            block_n = model.cfg.fp8.block_n if model.cfg.fp8 else 128
            q_rows = model.cfg.q_lora_rank // (block_n if a[2] == "weight_scale_inv" else 1)
            out[f"{a[1]}.q_a_proj.{a[2]}"], out[f"{a[1]}.kv_a_proj_with_mqa.{a[2]}"] = p[:q_rows], p[q_rows:]
        else:
            out[name] = p
    return out


def _checkpoint(alias: str):
    from engine.checkpoint import tiny
    from engine.checkpoint.config import parse_config
    from engine.checkpoint.registry import lookup

    entry = lookup(alias)
    return tiny.materialize(alias, entry.config_dict()), parse_config(entry.config_dict())


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


class _Driver:
    """KV pool, request table and context for one model; runs ForwardBatches built from host lists."""

    def __init__(self, case: Case, tp, old_paths: bool = False):
        from engine.memory.pools import KVPool, ReqToTokenPool
        from engine.model.builder import build_model
        from engine.model.context import ForwardContext
        from engine.model.kernel_registry import ATTENTION, MOE, KernelSetup
        from engine.model.rope import RotaryEmbedding
        from kernels.interpret import interpreting

        path, cfg = _checkpoint(case.model)
        self.cfg, self.tp = cfg, tp
        block = (cfg.fp8.block_n, cfg.fp8.block_k) if case.keep_fp8 else None
        dev, dt = torch.device("cpu"), torch.float32
        kernels = case_kernels(case, cfg, block, old_paths)
        with _unmerged_qkv_a() if old_paths else nullcontext():
            self.model, self.mtp = build_model(cfg, cfg.num_hidden_layers, dt, dev, block, tp, checkpoint=path,
                                               kernels=kernels)
        assert self.mtp is not None
        layers = cfg.num_hidden_layers + 1
        self.kv = KVPool(layers, 128, cfg.kv_cache_dim, dt, dev)
        self.table = ReqToTokenPool(len(PROMPT_LENS), 64, dev)
        setup = KernelSetup(cfg, dev, dt, dt, (), interpreting(), tp_size=tp.size if tp else 1)
        # flashinfer: tests/engine/fake_flashinfer.py stands in for the kernels (its start-up check wants CUDA)
        name = case.attention if case.attention == "flashinfer" else ATTENTION.resolve(case.attention, setup)
        attn = ATTENTION.build(name, setup, self.kv, self.table)
        moe = MOE.build(MOE.resolve(case.moe, setup), setup)
        rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, 64, dev)
        self.ctx = ForwardContext(self.kv, self.table, rotary, attn, moe)

    def run(self, mode, ids, rows, prefixes, lens, slots, logits_rows, spec_hidden=None, mtp=False):
        from engine.forward_batch import ForwardBatch

        for row, p, s in zip(rows, prefixes, slots):
            self.table.set(row, p, s)
        fb = ForwardBatch.build(mode, ids, rows, prefixes, lens, torch.cat(slots), logits_rows, torch.device("cpu"))
        fb.spec_hidden = spec_hidden
        self.ctx.begin_forward(fb)
        with torch.inference_mode():
            if mtp:
                hidden = self.mtp(fb, self.ctx)
                return self.mtp.logits(hidden[fb.logits_indices]), hidden
            hidden = self.model.hidden_states(fb, self.ctx)
            return self.model.logits(hidden[fb.logits_indices]), hidden

    def greedy(self, logits: torch.Tensor) -> list[int]:
        from engine.distributed import comm

        ids = logits.argmax(-1)
        if self.tp is not None:
            comm.broadcast_tensor(ids, 0, self.tp)
        return ids.tolist()


def _unmerged_qkv_a():
    """While open, MLA.merge_qkv_a leaves q_a_proj and kv_a_proj_with_mqa apart (the path before the merge)."""
    from unittest import mock

    from engine.model.attention import MLA

    return mock.patch.object(MLA, "merge_qkv_a", lambda self: None)


def run_workload(case: Case, tp=None, old_paths: bool = False) -> dict:
    """Logits of every step (float32) and the greedy tokens, for the model of `case` split over `tp`.
    old_paths: q_a / kv_a as two GEMMs and no RMSNorm fused with an FP8 quantisation (what those replaced)."""
    from engine.forward_batch import ForwardMode

    d = _Driver(case, tp, old_paths)
    prompts = _prompts(d.cfg.vocab_size)
    rows = [d.table.alloc() for _ in prompts]
    out: dict = {}
    # chunk 1: prompts 0 and 2 whole, the first FIRST_CHUNK tokens of prompt 1
    lens = [len(prompts[0]), FIRST_CHUNK, len(prompts[2])]
    slots = [d.kv.alloc(n) for n in lens]
    ids = prompts[0] + prompts[1][:FIRST_CHUNK] + prompts[2]
    out["prefill1"], hidden = d.run(ForwardMode.EXTEND, ids, rows, [0, 0, 0], lens, slots, list(range(len(ids))))
    # chunk 2: the rest of prompt 1 over its cached prefix, alone
    rest = prompts[1][FIRST_CHUNK:]
    slots1 = [slots[1], d.kv.alloc(len(rest))]
    out["prefill2"], _ = d.run(ForwardMode.EXTEND, rest, [rows[1]], [FIRST_CHUNK], [len(rest)], slots1[1:],
                               list(range(len(rest))))
    last = torch.stack((out["prefill1"][lens[0] - 1], out["prefill2"][-1], out["prefill1"][-1]))
    tokens = [d.greedy(last)]
    seq = list(PROMPT_LENS)
    for step in range(DECODE_STEPS):
        new = [d.kv.alloc(1) for _ in rows]
        logits, _ = d.run(ForwardMode.DECODE, tokens[-1], rows, seq, [1, 1, 1], new, [0, 1, 2])
        out[f"decode{step}"] = logits
        tokens.append(d.greedy(logits))
        seq = [n + 1 for n in seq]
    # MTP draft-extend over prompt 0: next tokens (shifted by one, then its first greedy token) + its hidden states
    nxt = prompts[0][1:] + [tokens[0][0]]
    out["mtp"], _ = d.run(ForwardMode.DRAFT_EXTEND, nxt, [rows[0]], [0], [len(nxt)], [slots[0]],
                          list(range(len(nxt))), spec_hidden=hidden[: lens[0]], mtp=True)
    out["tokens"] = tokens
    unique = {id(p): p for m in (d.model, d.mtp) for p in m.parameters()}  # the MTP layer shares embed / head
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in unique.values())
    return out


def rank_main(local_rank: int, pc, cases: list[Case], out_dir: str) -> None:
    from engine.distributed.groups import init_parallel

    torch.set_num_threads(1)  # 2-4 ranks share 2 cores
    if any(c.attention == "flashinfer" for c in cases):
        import pytest

        from tests.engine import fake_flashinfer

        fake_flashinfer.install(pytest.MonkeyPatch())  # this process only; never undone
    state = init_parallel(pc, local_rank, "cpu")
    try:
        for case in cases:
            out = run_workload(case, state.tp)
            torch.save(out, os.path.join(out_dir, f"{case.tag}.rank{state.tp.rank}.pt"))
    finally:
        state.destroy()


def load_rank_outputs(out_dir: str, case: Case, tp_size: int) -> list[Optional[dict]]:
    return [torch.load(os.path.join(out_dir, f"{case.tag}.rank{r}.pt")) for r in range(tp_size)]
