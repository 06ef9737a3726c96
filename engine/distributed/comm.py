"""The collectives the TP model and scheduler use, over a `TPGroup` (engine.distributed.groups).

Tensor collectives (device group: NCCL on CUDA, gloo on CPU):
- `all_reduce(x, group)`: sum in place (o_proj, MLP down, MoE output, vocab-parallel embedding);
- `all_gather_last_dim(x, group)`: concatenate along the last dim in rank order (vocab-parallel
  logits: rank r holds vocab rows [r * V / tp, (r + 1) * V / tp));
- `all_gather_rows(x, group)`: stack every rank's equally shaped x along dim 0, rank order;
  `all_gather_padded_rows(x, width, group)` the same for up to `width` rows per rank, zero-padded (DP
  attention gathers every DP group's hidden states before an MLP, the MoE token exchange its shares);
- `broadcast_tensor(x, src, group)`: in place from group rank `src` (e.g. sampled token ids).
Host-side collectives (the gloo `cpu_group`):
- `broadcast_object(obj, src, group)`: a picklable object (scheduler messages);
- `all_reduce_min_int(value, group)`: agree on the smallest int (the KV pool size every rank can hold);
- `all_reduce_max_int(value, group)`: the largest int (DP attention: "does any rank have work");
- `all_gather_ints(value, group)`: every rank's int, rank order (DP attention: tokens per forward);
- `gather_objects(obj, group)`: every rank's picklable object on group rank 0 (None elsewhere);
- `barrier(group)`.

Two-batch overlap (engine/model/two_batch.py) starts the device collectives it hides behind the other
micro-batch's compute without waiting: `start_all_reduce`, `start_all_gather_rows` and
`start_all_gather_padded_rows` return a `Pending` (its `wait()` gives the result; with async_op=False the
collective has finished before it returns). Code with such collectives is written as `Stages` (a generator that
yields each `Pending` it starts); `finish` runs one, waiting at each yield. The plain functions do not go through
them: the decode forward that torch.compile traces calls those (a collective traced there returns no work
handle), and torch.compile gives up on a generator's whole frame at its first graph break.

`all_reduce` is the 'torch' all-reduce backend; --all-reduce-backend custom
(engine/distributed/custom_all_reduce.py) runs peer-memory kernels for small messages between the GPUs
of one node and calls it for everything else.

Every function returns at once at group size 1, touching no torch.distributed state, so the
single-process path costs nothing and needs no process group.

CUDA graphs (for the wiring): `all_reduce`, `all_gather_last_dim` and `broadcast_tensor` issue
one NCCL call on the current stream with `async_op=False`, which CUDA graph capture records
(PyTorch's NCCL process group supports capture). What the caller must do:
- create the NCCL communicator before capture (init_parallel's warm-up all-reduce does);
- capture with fixed shapes (the padded graph batch); the output buffers allocated here come
  from the graph's memory pool, which is fine;
- never call .item(), .tolist() or a host-side collective (`broadcast_object`,
  `all_reduce_min_int`, `barrier`) inside the captured region: they synchronise with the host;
- every rank must capture and replay the same graphs in the same order (same batch sizes),
  or the NCCL calls of different ranks pair up wrongly and hang.
torch.compile: collectives break the graph (or are traced as functional collectives,
depending on the torch version); check the compiled decode path on several GPUs before
relying on it, and fall back to marking the caller `torch.compiler.disable`.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Optional

import torch
import torch.distributed as dist

from engine.distributed.groups import TPGroup


class Pending:
    """A device collective that may still be running: `wait()` waits for it (on CUDA: makes the current stream
    wait; a no-op once done) and returns its result, `then` applied to the collective's output."""

    def __init__(self, out: Any, work: Any = None, then: Callable[[Any], Any] = lambda out: out):
        self.out, self.work, self.then = out, work, then

    def wait(self) -> Any:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.then(self.out)

    def map(self, fn: Callable[[Any], Any]) -> Pending:
        """The same collective, its result passed through `fn` when waited for."""
        then = self.then
        return Pending(self.out, self.work, lambda out: fn(then(out)))


# Steps of a computation that starts collectives: a generator that yields each `Pending` it starts, is sent back
# its result, and returns the computation's result (`finish` runs one; engine/model/two_batch.py interleaves two).
Stages = Generator[Pending, Any, Any]


def finish(stages: Stages) -> Any:
    """Run `stages` to its end, waiting for each collective as soon as it is yielded."""
    try:
        pending = stages.send(None)
        while True:
            pending = stages.send(pending.wait())
    except StopIteration as done:
        return done.value


def all_reduce(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Sum x over the group, in place; returns x."""
    if group.size == 1:
        return x
    dist.all_reduce(x, group=group.device_group)
    return x


def all_gather_last_dim(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """[..., D] on every rank -> [..., size * D], rank r's block at columns [r * D, (r + 1) * D)."""
    if group.size == 1:
        return x
    # ranks' blocks stacked along dim 0 (the layout both NCCL and gloo accept), then moved to the last dim
    out = all_gather_rows(x, group).view(group.size, *x.shape)
    return out.movedim(0, -2).reshape(*x.shape[:-1], group.size * x.shape[-1])


def all_gather_rows(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """[T, ...] on every rank (same shape) -> [size * T, ...], rank r's rows at [r * T, (r + 1) * T)."""
    if group.size == 1:
        return x
    x = x.contiguous()
    out = _gathered(x, group)
    _all_gather()(out, x, group=group.device_group)
    return out


def all_gather_padded_rows(x: torch.Tensor, width: int, group: TPGroup) -> torch.Tensor:
    """[n <= width, ...] on every rank (n may differ) -> [size * width, ...]: each rank's rows zero-padded to
    `width`, rank r's block at [r * width, (r + 1) * width)."""
    return all_gather_rows(_padded(x, width), group)


# The asynchronous forms. The plain functions above do not go through them: under torch.compile a collective
# called with async_op=False is traced as a functional collective whose return value is no work handle.

def start_all_reduce(x: torch.Tensor, group: TPGroup, async_op: bool = True) -> Pending:
    """`all_reduce`, not waited for (async_op=False: finished before it returns)."""
    if group.size == 1:
        return Pending(x)
    return Pending(x, issue(dist.all_reduce, async_op, x, group=group.device_group))


def start_all_gather_rows(x: torch.Tensor, group: TPGroup, async_op: bool = True) -> Pending:
    """`all_gather_rows`, not waited for (async_op=False: finished before it returns)."""
    if group.size == 1:
        return Pending(x)
    x = x.contiguous()
    out = _gathered(x, group)
    return Pending(out, issue(_all_gather(), async_op, out, x, group=group.device_group))


def start_all_gather_padded_rows(x: torch.Tensor, width: int, group: TPGroup, async_op: bool = True) -> Pending:
    """`all_gather_padded_rows`, not waited for (async_op=False: finished before it returns)."""
    return start_all_gather_rows(_padded(x, width), group, async_op)


def issue(collective: Callable, async_op: bool, *args, **kwargs) -> Any:
    """Call a torch.distributed collective: its work handle when async_op, else None once it has run."""
    if async_op:
        return collective(*args, async_op=True, **kwargs)
    collective(*args, **kwargs)
    return None


def _all_gather() -> Callable:
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gathered(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """The output of an all-gather of x's rows over the group."""
    return torch.empty((group.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    return padded


def broadcast_tensor(x: torch.Tensor, src: int, group: TPGroup) -> torch.Tensor:
    """Overwrite x on every rank with group rank `src`'s x (same shape and dtype everywhere); returns x."""
    if group.size == 1:
        return x
    dist.broadcast(x, src=group.world_rank(src), group=group.device_group)
    return x


def broadcast_object(obj: Any, src: int, group: TPGroup) -> Any:
    """Group rank `src`'s `obj` (pickled over the gloo cpu_group) on every rank; others pass anything."""
    if group.size == 1:
        return obj
    box = [obj if group.rank == src else None]
    dist.broadcast_object_list(box, src=group.world_rank(src), group=group.cpu_group)
    return box[0]


def all_reduce_min_int(value: int, group: TPGroup) -> int:
    """The smallest `value` over the group (e.g. KV tokens that fit on every rank)."""
    if group.size == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(t[0])


def all_reduce_max_int(value: int, group: TPGroup) -> int:
    """The largest `value` over the group (host side)."""
    if group.size == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.cpu_group)
    return int(t[0])


def all_gather_ints(value: int, group: TPGroup) -> list[int]:
    """Every rank's `value`, in group-rank order (host side)."""
    if group.size == 1:
        return [int(value)]
    parts = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size)]
    dist.all_gather(parts, torch.tensor([int(value)], dtype=torch.int64), group=group.cpu_group)
    return [int(p[0]) for p in parts]


def gather_objects(obj: Any, group: TPGroup) -> Optional[list]:
    """Every rank's picklable `obj` (rank order) on group rank 0; None on the other ranks."""
    if group.size == 1:
        return [obj]
    box = [None] * group.size if group.rank == 0 else None
    dist.gather_object(obj, box, dst=group.world_rank(0), group=group.cpu_group)
    return box


def barrier(group: TPGroup) -> None:
    """Wait until every rank of the group gets here (host side)."""
    if group.size == 1:
        return
    dist.barrier(group=group.cpu_group)
