"""DeepSeek MoE: router (three gate methods), routed experts, shared experts.

Routed expert weights are stacked for grouped kernels: w13 [E, 2N, K] (gate rows
then up rows) and w2 [E, K, N]; FP8 checkpoints add block scales. The experts
computation goes through the MoE backend of the `ForwardContext` passed to
`MoE.forward` (`TorchMoEBackend`, the reference, or `TritonMoEBackend`, the fused
kernel; chosen by name in engine/model/kernel_registry.py; the protocol is in
engine/model/context.py). The router's top-k (`kernels.moe_gate`) and the all-reduce are the
`Kernels` the layer is given at construction (engine/model/kernel_set.py).

W4AFP8 (`cfg.experts_int4_group`: a w4afp8 checkpoint or --quantization w4afp8): the routed experts
are INT4, packed two per byte along K (kernels/int4.py): w13 int8 [E, 2N, K/2] with float32 scales
[E, 2N, K/G] and w2 int8 [E, K, N/2] with scales [E, K, N/G2], and run kernels/fused_moe_w4a8.py (FP8
activations); the shared experts stay what the other linears are. TP splits w13 by rows (scales with
them) and w2 by its packed K columns: a rank's N/tp columns are whole groups, or (N/tp < G, e.g. small
test models) lie inside one group, whose scale the rank keeps (G2 = min(G, N/tp)).

Tensor parallelism splits every routed expert along its intermediate size (w13: this
rank's N / tp gate rows then its N / tp up rows; w2: the matching columns) and the shared
experts like a dense MLP; the router stays replicated, so every rank routes every token
the same way. Routed and shared outputs are both partial sums over the intermediate
dimension: they are added locally and summed over the group by ONE all-reduce per layer.

Shared experts inside the routed launch (`kernels.shared_experts_fused`, --shared-experts-backend fused, the CUDA
default where the layout allows it: no EP, no W4AFP8, whole 128-row FP8 blocks per rank): after loading,
`fuse_shared_experts` moves each shared expert's rank share (n_shared_experts slices of this rank's routed N) into
w13 / w2 as experts E .. E + S - 1, and every token is routed to them with weight 1 besides its top-k: one fused MoE
launch instead of the shared MLP's two GEMMs, its activation and the add (the tuned configs are still looked up
by the routed E).

Expert parallelism (`tp.ep_size` = tp.size): each rank owns n_routed_experts / ep whole experts
(full intermediate size). Every rank still holds every token (plain TP: the attention output is
all-reduced; DP attention: the tokens of all DP groups are gathered before the MoE), routes all
of them with the replicated router, and computes only its own experts: the chosen ids are mapped
to local ids, and ids of other ranks' experts become -1, which the fused kernel's alignment and
the reference both skip (no work, no memory traffic for them). A token's output is then the sum
over ranks of its local experts' weighted outputs, which the same one all-reduce (routed partials
+ shared-expert partials) produces: "gather + local experts + reduce", no all-to-all.

All-to-all (`tp.exchanges_tokens`, --moe-a2a-backend torch): the layer gets only its rank's own tokens (no DP
gather; under plain TP each rank takes 1/tp of the rows, `token_share`), routes them and hands them to
`kernels.moe_a2a` (engine/distributed/token_exchange.py), which sends each token to the ranks of its experts,
runs them there through the MoE backend and brings the weighted outputs back. The shared experts are then
whole on every rank (the loader reads them unsplit) and run on the rank's own tokens; nothing is
all-reduced. Under CUDA graphs (`ctx.static_shapes`) the exchange runs its fixed-size mode.

Padding rows (`ctx.pad_rows`, engine/model/context.py: a padded forward, a CUDA graph's or a piecewise graph's
bucket) come out of the router with every expert id -1 (routed and fused shared: the gate reads the marks in its own
launch), so the experts do no work for them: under DP attention an idle group's padded rows would otherwise route
to experts of their own, and a decode batch padded to the next graph size reads the experts its padding picks.

Expert placement (`--expert-placement`, engine/distributed/expert_placement.py): under EP a layer may hold E + R
expert slots, S = (E + R) / ep per rank, the hottest experts with several copies. `to_slots` maps each routed
logical expert to one of its copies (row + column of the pick, mod its copies) right after routing; from there
slot ids stand for expert ids in both paths above. The routing counts (`--record-expert-load`,
engine/model/expert_load.py) take the slot ids of the rank's own rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from engine.checkpoint.config import ModelConfig
from engine.distributed import comm
from engine.distributed.groups import TPGroup
from engine.distributed.token_exchange import gather_shares, local_expert_ids, start_gather_shares, token_share
from engine.errors import UsageError
from engine.model.context import ForwardContext
from engine.model.gate_ops import torch_gate
from engine.model.kernel_set import REFERENCE, Gate, Kernels
from engine.model.layers import MLP, solo_group, tp_local
from kernels.fp8_math import FP8_DTYPE, WEIGHT_BLOCK, block_scale_shape
from kernels.fused_moe import fused_moe, fused_moe_ref
from kernels.fused_moe_w4a8 import fused_moe_w4a8, fused_moe_w4a8_ref


def replica_tables(slots: Sequence[int], num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(table [E, most copies] int32: the slots of each logical expert, its first slot repeated past its copies;
    count [E] int32: its copies), what `MoE.to_slots` maps routed logical ids with."""
    where: list[list[int]] = [[] for _ in range(num_experts)]
    for p, e in enumerate(slots):
        where[e].append(p)
    width = max(len(w) for w in where)
    table = torch.tensor([w + [w[0]] * (width - len(w)) for w in where], dtype=torch.int32)
    return table, torch.tensor([len(w) for w in where], dtype=torch.int32)


def select_experts(logits: torch.Tensor, cfg: ModelConfig, bias: Optional[torch.Tensor],
                   gate: Gate = torch_gate, n_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (float32) -> (weights [T, k] float32, ids [T, k] int32), by `gate`
    (engine/model/gate_ops.py); with n_shared, k + n_shared columns, the last ones the shared experts E, E + 1,
    ... at weight 1 (written by the same launch). A MoE layer routes from its hidden states (`MoE.route`)."""
    return gate(logits, None, cfg, bias, n_shared)


@dataclass
class ExchangeShare:
    """All-to-all EP: the rows of its attention group's tokens one rank exchanges (padded to `per` rows under
    static shapes; the first `rows` are real) and the token exchange's arguments for them."""

    mine: torch.Tensor
    rows: int
    per: int
    exchange: tuple


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fp8_block=None, tp: Optional[TPGroup] = None,
                 kernels: Kernels = REFERENCE, layer: int = 0, slots: Optional[Sequence[int]] = None):
        """layer: the checkpoint's layer index (the routing counts' key); slots: under EP, a placement's slot ->
        logical expert list for this layer (engine/distributed/expert_placement.py; None: the plain layout)."""
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        self.layer = layer
        self.tp = tp = tp or solo_group()
        e, k = cfg.n_routed_experts, cfg.hidden_size
        self.slots = tuple(slots) if slots is not None and tp.ep_size > 1 else None
        if tp.ep_size > 1:  # whole experts per rank
            e, n = (len(self.slots) if self.slots else e) // tp.ep_size, cfg.moe_intermediate_size
            self.first_expert = tp.ep_rank * e
        else:
            n = tp_local(cfg.moe_intermediate_size, tp, "moe_intermediate_size")  # this rank's share
            self.first_expert = 0
        self.num_local_experts = e
        table, count = replica_tables(self.slots, cfg.n_routed_experts) if self.slots else (None, None)
        self.register_buffer("replica_table", table, persistent=False)  # logical expert -> its slots
        self.register_buffer("replica_count", count, persistent=False)  # logical expert -> its copies
        self.fp8_block = fp8_block
        # the router's logits are float32 (as DeepSeek's reference computes them): its weight is kept in float32, so
        # that no step converts it again (a copy of the whole router per MoE layer and step)
        self.gate_weight = nn.Parameter(torch.empty(cfg.n_routed_experts, k, dtype=torch.float32),
                                        requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(cfg.n_routed_experts, dtype=torch.float32), requires_grad=False)
            if cfg.topk_method == "noaux_tc" else None
        )
        self.int4_groups = int4_groups(cfg.experts_int4_group, k, n) if cfg.experts_int4_group else None
        if self.int4_groups:
            self._int4_params(e, k, n)
        else:
            self._expert_params(e, k, n, FP8_DTYPE if fp8_block else dtype)
        if tp.exchanges_tokens and kernels.moe_a2a is None:
            raise UsageError("this TP group exchanges MoE tokens by all-to-all but the kernels have no exchange: "
                             "build the kernels for the group (kernel_registry.build_kernels with its setup)")
        shared_group = solo_group() if tp.exchanges_tokens else self.tp  # whole on every rank: its own tokens
        self.shared_experts = (
            MLP(k, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype, fp8_block, shared_group, reduce=False,
                kernels=kernels)
            if cfg.n_shared_experts else None
        )
        self.fused_shared = 0  # shared experts moved into w13 / w2 (fuse_shared_experts)

    def _expert_params(self, e: int, k: int, n: int, wdtype: torch.dtype) -> None:
        self.w13 = nn.Parameter(torch.empty(e, 2 * n, k, dtype=wdtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, k, n, dtype=wdtype), requires_grad=False)
        self.w13_scale = self.w2_scale = None
        if self.fp8_block:
            self.w13_scale = nn.Parameter(torch.empty(block_scale_shape(self.w13.shape, self.fp8_block)),
                                          requires_grad=False)
            self.w2_scale = nn.Parameter(torch.empty(block_scale_shape(self.w2.shape, self.fp8_block)),
                                         requires_grad=False)

    def _int4_params(self, e: int, k: int, n: int) -> None:
        """W4AFP8 routed experts: packed INT4 weights and their group scales."""
        g1, g2 = self.int4_groups
        self.w13 = nn.Parameter(torch.empty(e, 2 * n, k // 2, dtype=torch.int8), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, k, n // 2, dtype=torch.int8), requires_grad=False)
        self.w13_scale = nn.Parameter(torch.empty(e, 2 * n, k // g1), requires_grad=False)
        self.w2_scale = nn.Parameter(torch.empty(e, k, n // g2), requires_grad=False)

    def fuse_shared_experts(self) -> None:
        """With `kernels.shared_experts_fused` (after loading and after the shared MLP's gate / up merge): append
        the shared experts to w13 / w2 as S = n_shared_experts experts of this rank's routed width N (slice j of
        the shared MLP's gate rows, up rows and down columns) and drop the shared MLP; `route` then sends every
        token to experts E .. E + S - 1 at weight 1 too. The routed weights are copied once (a layer's worth of
        memory for a moment)."""
        mlp = self.shared_experts
        if not self.kernels.shared_experts_fused or mlp is None:
            return
        if reason := shared_fusion_blocker(self.cfg, self.tp, self.tp.size, self.fp8_block):
            raise UsageError(f"--shared-experts-backend fused: {reason}; use --shared-experts-backend separate")
        n, s = self.w2.shape[2], self.cfg.n_shared_experts
        gate, up = ((mlp.gate_up_proj.weight[: mlp.local], mlp.gate_up_proj.weight[mlp.local:])
                    if mlp.gate_up_proj is not None else (mlp.gate_proj.weight, mlp.up_proj.weight))
        shared13 = torch.stack([torch.cat((gate[j * n:(j + 1) * n], up[j * n:(j + 1) * n])) for j in range(s)])
        shared2 = torch.stack([mlp.down_proj.weight[:, j * n:(j + 1) * n] for j in range(s)])
        self._append("w13", shared13)
        self._append("w2", shared2)
        if self.fp8_block is not None:
            bn, bk = self.fp8_block
            g13 = (mlp.gate_up_proj.weight_scale_inv.split(mlp.local // bn) if mlp.gate_up_proj is not None
                   else (mlp.gate_proj.weight_scale_inv, mlp.up_proj.weight_scale_inv))
            rows = n // bn
            s13 = torch.stack([torch.cat((g13[0][j * rows:(j + 1) * rows], g13[1][j * rows:(j + 1) * rows]))
                               for j in range(s)])
            cols = n // bk
            s2 = torch.stack([mlp.down_proj.weight_scale_inv[:, j * cols:(j + 1) * cols] for j in range(s)])
            self._append("w13_scale", s13)
            self._append("w2_scale", s2)
        self.shared_experts = None
        self.fused_shared = s

    def _append(self, name: str, extra: torch.Tensor) -> None:
        """Parameter `name` with `extra` appended along dim 0. The old tensor's memory goes back to the driver at
        once: left cached, each layer's freed copy is a hole that the next, larger copy cannot use and that smaller
        allocations split, and at depth on a nearly full GPU the holes add up (V2 at TP 2 on 2 x H200 ran out of
        memory with 25 GB cached)."""
        old = getattr(self, name)
        setattr(self, name, nn.Parameter(torch.cat((old, extra)), requires_grad=False))
        if old.is_cuda:
            del old
            torch.cuda.empty_cache()

    def route(self, x: torch.Tensor, pad: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, global expert ids [T, k] int32) of the replicated router (float32 logits of
        x and the float32 router weight, then the gate: `kernels.moe_gate`, one launch at decode sizes); with the
        shared experts fused, k + S columns (every token also takes experts E .. E + S - 1 at weight 1); the rows
        `pad` marks (bool [<= T]) get ids -1."""
        return self.kernels.moe_gate(x, self.gate_weight, self.cfg, self.e_score_correction_bias, self.fused_shared,
                                     pad)

    def local_experts(self) -> tuple[int, ...]:
        """The logical expert each of this rank's expert slots holds (what the loader fills them with)."""
        if self.slots:
            return self.slots[self.first_expert: self.first_expert + self.num_local_experts]
        return tuple(range(self.first_expert, self.first_expert + self.num_local_experts))

    def to_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Routed logical ids [T, k] -> slot ids under a placement (a pick of an expert with several copies takes
        copy (row + column) mod copies); ids of no expert -> -1. Without a placement: `ids` as they are."""
        if self.replica_table is None:
            return ids
        valid = (ids >= 0) & (ids < self.cfg.n_routed_experts)
        safe = torch.where(valid, ids, torch.zeros_like(ids)).long()
        rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        cols = torch.arange(ids.shape[1], device=ids.device)
        pick = (rows + cols) % self.replica_count[safe]
        slot = self.replica_table[safe, pick]
        return torch.where(valid, slot, torch.full_like(slot, -1)).to(ids.dtype)

    def _record(self, ids: torch.Tensor, ctx: ForwardContext, first_row: int = 0) -> None:
        """--record-expert-load: count this rank's own rows' routed slots (engine/model/expert_load.py)."""
        top_k = self.cfg.num_experts_per_tok  # not the fused shared experts' columns
        ctx.expert_load.record(self.layer, ids[:, :top_k], ctx.static_shapes, first_row)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: every token of the step on every rank (gather path), or this rank's attention group's tokens
        (`tp.exchanges_tokens`); the output has x's rows."""
        if self.tp.exchanges_tokens:
            share = self._share(x, ctx)
            out = self.kernels.moe_a2a(*share.exchange)
            return gather_shares(self._add_shared(out, share), x.shape[0], share.per, self.tp.attention)
        return self.kernels.all_reduce(self._partial(x, ctx), self.tp)

    def stages(self, x: torch.Tensor, ctx: ForwardContext) -> comm.Stages:
        """`forward` of a two-batch-overlap micro-batch (engine/model/two_batch.py): its collectives started
        asynchronously (the all-reduce through torch.distributed: the custom one has no asynchronous form) and
        yielded."""
        if self.tp.exchanges_tokens:
            share = self._share(x, ctx)
            out = yield from self.kernels.moe_a2a.stages(*share.exchange)
            return (yield start_gather_shares(self._add_shared(out, share), x.shape[0], share.per, self.tp.attention))
        return (yield comm.start_all_reduce(self._partial(x, ctx), self.tp))

    def _partial(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Gather path: this rank's partial output for every token (its experts or its share of each expert, and
        its share of the shared experts), to be summed over the group."""
        weights, ids = self.route(x, ctx.padding_marks(x.shape[0]))
        ids = self.to_slots(ids)
        if ctx.expert_load is not None and self.tp.attention.is_first:  # the group's tokens, counted once
            self._record(ids if ctx.dp is None else ctx.dp.scatter(ids), ctx)
        if self.tp.ep_size > 1:
            ids = local_expert_ids(ids, self.first_expert, self.num_local_experts)
        out = ctx.moe_backend.experts(self, x, weights, ids)
        return out + self.shared_experts(x) if self.shared_experts is not None else out

    def _share(self, x: torch.Tensor, ctx: ForwardContext) -> ExchangeShare:
        """All-to-all EP: this rank's share of its attention group's rows, routed, and the exchange's arguments;
        the exchange sends them to their experts' ranks and back, then the group shares the outputs (no
        all-reduce)."""
        start, end, per = token_share(x.shape[0], self.tp.attention)
        mine = x[start:end]
        if ctx.static_shapes and mine.shape[0] < per:  # every rank exchanges the same row count
            mine = torch.cat((mine, mine.new_zeros((per - mine.shape[0], *mine.shape[1:]))))
        pad = ctx.padding_marks(self.tp.dp_size * x.shape[0])  # every group's block: this one's, this rank's share
        if pad is not None:
            first = self.tp.dp_rank * x.shape[0] + start
            pad = pad[first: first + end - start]
            if mine.shape[0] > pad.shape[0]:  # the rows the exchange appends are padding too
                pad = torch.cat((pad, pad.new_ones(mine.shape[0] - pad.shape[0])))
        weights, ids = self.route(mine, pad)
        ids = self.to_slots(ids)
        if ctx.expert_load is not None:
            self._record(ids, ctx, start)

        def experts(rows: torch.Tensor, w: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
            return ctx.moe_backend.experts(self, rows, w, local_ids)

        return ExchangeShare(mine, end - start, per,
                             (mine, weights, ids, experts, self.tp, self.num_local_experts, ctx.static_shapes))

    def _add_shared(self, out: torch.Tensor, share: ExchangeShare) -> torch.Tensor:
        """The exchange's output for this rank's share plus the shared experts, its padding rows dropped."""
        out = out + self.shared_experts(share.mine) if self.shared_experts is not None else out
        return out[: share.rows]


def shared_fusion_blocker(cfg: ModelConfig, group: Optional[TPGroup], tp_size: int, fp8_block) -> Optional[str]:
    """Why a MoE layer's shared experts cannot join the routed experts' launch in this layout (None: they can);
    `group` the model's TP group where one exists, else `tp_size` ranks without EP."""
    if not (cfg.n_routed_experts and cfg.n_shared_experts):
        return "the model has no shared experts"
    if cfg.experts_int4_group:
        return "W4AFP8 routed experts are INT4 and the shared experts FP8, so they run apart"
    if group is not None and (group.ep_size > 1 or group.exchanges_tokens):
        return ("under expert parallelism a rank holds whole routed experts but a share of the shared ones (or all "
                "of them, for its own tokens)")
    n = cfg.moe_intermediate_size // (group.size if group is not None else tp_size)  # the MoE splits over the group
    if fp8_block is not None and (n % fp8_block[0] or n % fp8_block[1]):
        return (f"this rank's routed expert width {n} is not whole {fp8_block[0]}-row FP8 blocks, so the shared "
                "experts' scales cannot be cut into experts")
    return None


def int4_groups(group: int, k: int, n: int) -> tuple[int, int]:
    """(G1, G2): the INT4 K groups of w13 (along hidden K) and of this rank's w2 (along its n columns)."""
    if k % group:
        raise UsageError(f"W4AFP8: hidden_size {k} is not a multiple of the INT4 group {group}")
    if n % group and group % n:
        raise UsageError(f"W4AFP8: this rank's moe_intermediate_size share {n} neither holds whole INT4 groups of "
                         f"{group} nor lies inside one: use another --tp, or --ep-size (whole experts per rank)")
    return group, min(group, n)


class TorchMoEBackend:
    """Reference: kernels.fused_moe_ref (a loop over the experts that received tokens), or
    kernels.fused_moe_w4a8_ref for W4AFP8 experts."""

    def experts(self, moe: MoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if moe.int4_groups:
            return fused_moe_w4a8_ref(x, moe.w13, moe.w2, ids, weights, w13_scale=moe.w13_scale,
                                      w2_scale=moe.w2_scale)
        return fused_moe_ref(x, moe.w13, moe.w2, ids, weights, w13_scale=moe.w13_scale, w2_scale=moe.w2_scale,
                             block_shape=moe.fp8_block or WEIGHT_BLOCK)


class TritonMoEBackend:
    """The fused Triton MoE kernel (CUDA, or CPU under TRITON_INTERPRET=1)."""

    @torch.compiler.disable
    def experts(self, moe: MoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if moe.int4_groups:
            return fused_moe_w4a8(x, moe.w13, moe.w2, ids, weights, w13_scale=moe.w13_scale, w2_scale=moe.w2_scale)
        return fused_moe(x, moe.w13, moe.w2, ids, weights, w13_scale=moe.w13_scale, w2_scale=moe.w2_scale,
                         block_shape=moe.fp8_block or WEIGHT_BLOCK, config_experts=moe.num_local_experts)
