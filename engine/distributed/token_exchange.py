"""Expert-parallel token exchange by all-to-all (--moe-a2a-backend): each token goes only to the ranks that
hold its chosen experts, and their outputs come back to the token's rank.

Without it (--moe-a2a-backend none) every rank sees every token of the step: plain TP holds them all, and DP
attention gathers every group's tokens before each MoE layer; each rank computes its own experts on all of
them and one all-reduce sums the ranks' partial outputs. With it, a rank works on its own share of the
tokens only (`token_share`: under DP attention with one rank per group, all of its group's tokens; when an
attention group has several ranks, which hold the same tokens, each takes 1/size of the rows and the group
all-gathers the outputs afterwards), routes them with the replicated router and calls `exchange`:

    dispatch  token t of rank s -> every rank r holding one of t's top-k experts, with t's expert ids mapped
              to r's local ids (-1 for the slots r does not hold: the expert kernels skip them) and the
              routing weights;
    experts   rank r runs its local experts over what it received (the MoE backend, weights applied);
    combine   each output row goes back to its token's rank, which sums the rows of every rank that holds
              one of the token's experts (float32 sum, cast back).

Two modes, the same result:
- `variable` (eager forwards: prefill, and decode outside CUDA graphs): a token is sent once to each rank
  that holds at least one of its experts, no padding. The per-rank counts are exchanged first and read on
  the host (one synchronisation), as `all_to_all_single` needs its split sizes there.
- `fixed` (forwards under CUDA graphs: every rank has the same padded token count C): no host
  synchronisation and static shapes, so the collectives are captured in the graph. Over
  torch.distributed a fixed-size send moves the whole capacity whether or not the rows are used, so the
  dispatch is an all-gather of the C rows of every rank (each rank masks the ids to its own experts) and
  the combine an all-to-all of C rows per rank, summed on arrival: half the bytes of the all-reduce the
  gather path runs over all ep x C rows. A DeepEP-class library (RDMA writes of the used rows only into
  fixed buffers) would be another implementation of the `TokenExchange` protocol, registered in
  engine/model/kernel_registry.py under its own --moe-a2a-backend name.

Both modes are written as steps (`comm.Stages`): they yield each collective they start. Called (`__call__`)
the exchange waits for each at once; two-batch overlap (engine/model/two_batch.py) runs `stages` with the
collectives started asynchronously and the other micro-batch's compute between them.

An id outside [0, ranks x experts_per_rank) is no expert: the slot is dropped, as the expert kernels skip
it (the start-up's recording forwards, engine/runner/triton_precompile.py, run with the Triton kernels not
launched, so their router output is whatever memory held).

Group size 1 never gets here (the flag needs --ep-size = --tp > 1). Everything runs on the group's device
process group: NCCL on CUDA, gloo on CPU (the tests' oracle is the gather path and TP 1).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.distributed as dist

from engine.distributed import comm
from engine.distributed.groups import TPGroup

# (x rows [R, H], routing weights [R, k] float32, local expert ids [R, k] int32, -1 = not here) -> [R, H]
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TokenExchange(Protocol):
    """Dispatch a rank's routed tokens to the ranks of their experts, run `experts` there, combine back."""

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts,
                 group: TPGroup, experts_per_rank: int, fixed: bool) -> torch.Tensor:
        """x [T, H] (this rank's tokens), weights / ids [T, k] (global expert ids) -> [T, H]: the sum over the
        token's experts of weight x expert(x). `fixed`: static shapes, no host synchronisation (CUDA graphs;
        every rank passes the same T)."""

    def stages(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts,
               group: TPGroup, experts_per_rank: int, fixed: bool) -> comm.Stages:
        """The same exchange as steps whose collectives are started, not waited for (two-batch overlap runs
        the other micro-batch's compute between them)."""


def owner_ranks(ids: torch.Tensor, experts_per_rank: int) -> torch.Tensor:
    """[T, k] global expert ids -> [T, k] the EP rank that holds each (whole experts, rank-major blocks)."""
    return torch.div(ids, experts_per_rank, rounding_mode="floor")


def local_expert_ids(ids: torch.Tensor, first: torch.Tensor | int, count: int) -> torch.Tensor:
    """Global expert ids [N, k] -> the local ids [0, count) of the rank whose experts start at `first` (an int,
    or a tensor [N, 1]: one rank per row); the experts of other ranks, and ids of no expert, -> -1 (skipped)."""
    local = ids - first
    return torch.where((local >= 0) & (local < count), local, torch.full_like(local, -1))


def pack_routing(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Routing weights (float32) and int32 ids [N, k] as one float32 [N, 2k] tensor (ids bit-cast), so one
    collective moves both."""
    return torch.cat((weights.float(), ids.to(torch.int32).view(torch.float32)), dim=1)


def unpack_routing(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = packed.shape[1] // 2
    return packed[:, :k].contiguous(), packed[:, k:].contiguous().view(torch.int32)


def exchange_counts(send: torch.Tensor, group: TPGroup) -> list[int]:
    """Every rank's row count for this rank (int64 [size]) -> what this rank receives from each (host list)."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group.device_group)
    return recv.tolist()


class TorchAllToAll:
    """`TokenExchange` over torch.distributed's all_to_all_single / all_gather (NCCL, gloo)."""

    @torch.compiler.disable
    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts, group: TPGroup,
                 experts_per_rank: int, fixed: bool) -> torch.Tensor:
        return comm.finish(self.stages(x, weights, ids, experts, group, experts_per_rank, fixed, async_op=False))

    def stages(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts, group: TPGroup,
               experts_per_rank: int, fixed: bool, async_op: bool = True) -> comm.Stages:
        run = fixed_exchange if fixed else variable_exchange
        return run(x, weights, ids, experts, group, experts_per_rank, async_op)


torch_all_to_all = TorchAllToAll()


def all_to_all_start(x: torch.Tensor, send: list[int], recv: list[int], group: TPGroup,
                     async_op: bool) -> comm.Pending:
    """Rows [sum(send), ...] with rank r's block of send[r] rows -> [sum(recv), ...], rank r's block from r (its
    `wait()`); not waited for when async_op."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    return comm.Pending(out, comm.issue(dist.all_to_all_single, async_op, out, x.contiguous(),
                                        output_split_sizes=recv, input_split_sizes=send, group=group.device_group))


def variable_exchange(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts, group: TPGroup,
                      experts_per_rank: int, async_op: bool = False) -> comm.Stages:
    """Each token once to each rank holding one of its experts; counts read on the host."""
    owners = owner_ranks(ids, experts_per_rank)
    ranks = torch.arange(group.size, device=x.device, dtype=owners.dtype)
    wanted = (owners.unsqueeze(-1) == ranks).any(1)  # [T, ranks]: does rank r hold one of token t's experts
    dest, token = wanted.t().nonzero(as_tuple=True)  # rank-major, then token order: the send order
    send_counts = wanted.sum(0)
    send = send_counts.tolist()
    recv = exchange_counts(send_counts, group)
    first = (dest * experts_per_rank).unsqueeze(-1).to(ids.dtype)  # each sent row's destination's first expert
    routing = pack_routing(weights[token], local_expert_ids(ids[token], first, experts_per_rank))
    sent_x = all_to_all_start(x[token], send, recv, group, async_op)
    got_routing = yield all_to_all_start(routing, send, recv, group, async_op)
    got_x = yield sent_x
    got_w, got_ids = unpack_routing(got_routing)
    y = experts(got_x, got_w, got_ids) if got_x.shape[0] else got_x
    back = yield all_to_all_start(y, recv, send, group, async_op)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, token, back.float())
    return out.to(x.dtype)


def fixed_exchange(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts, group: TPGroup,
                   experts_per_rank: int, async_op: bool = False) -> comm.Stages:
    """Static shapes (every rank's T equal): all-gather the rows, experts on every row with the ids masked to
    this rank's, then an all-to-all of T rows per rank back to their owners, summed there."""
    t = x.shape[0]
    every_x = comm.start_all_gather_rows(x, group, async_op)
    every_routing = yield comm.start_all_gather_rows(pack_routing(weights, ids), group, async_op)
    every_x = yield every_x
    every_w, every_ids = unpack_routing(every_routing)
    local = local_expert_ids(every_ids, group.rank * experts_per_rank, experts_per_rank)
    y = experts(every_x, every_w, local)
    back = yield all_to_all_start(y, [t] * group.size, [t] * group.size, group, async_op)
    return back.view(group.size, t, *x.shape[1:]).float().sum(0).to(x.dtype)


def token_share(t: int, group: TPGroup) -> tuple[int, int, int]:
    """This rank's rows of the T tokens its attention group holds (the same T on every member): (start, end,
    per) with per = ceil(T / size) rows per member (the last ones may hold fewer, or none)."""
    per = -(-t // group.size)
    start = min(group.rank * per, t)
    return start, min(start + per, t), per


def gather_shares(out: torch.Tensor, t: int, per: int, group: TPGroup) -> torch.Tensor:
    """Every member's share [<= per, H] of the outputs -> all T rows, in row order, on every member."""
    if group.size == 1:
        return out
    return comm.all_gather_padded_rows(out, per, group)[:t]


def start_gather_shares(out: torch.Tensor, t: int, per: int, group: TPGroup) -> comm.Pending:
    """`gather_shares`, started asynchronously (two-batch overlap)."""
    if group.size == 1:
        return comm.Pending(out)
    return comm.start_all_gather_padded_rows(out, per, group).map(lambda every: every[:t])
