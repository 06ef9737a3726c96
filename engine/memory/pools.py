"""Token-granular paged KV cache and the request -> token-slot table.

`KVPool` holds, for every layer, one row per cached token. With MLA (the default) a
row is kv_lora_rank + qk_rope_head_dim values (the latent c_kv and the shared rope
key). With --disable-mla (no weight absorption) a row is every local head's expanded
key and value, laid out [heads, qk_head_dim + v_head_dim] (`kv_row_dim`; under TP only
this rank's heads). Slot 0 is a scratch slot that padded tokens write to; real tokens
get slots 1..size. `ReqToTokenPool` maps (request row, position) -> slot.

Each layer's cache is its own tensor, not a slice of one [layers, slots, dim] tensor: under
torch.compile a write into a slice (a view of a graph input) is functionalised into a copy of the
whole slice, scatter, copy back, i.e. two passes over the layer's cache per step (and an
allocation of its size: an OOM when the pool has the memory), where a write into a graph input
itself stays in place (tests/engine/test_kv_pool_compile.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.checkpoint.config import ModelConfig
from engine.forward_batch import tensor_to_device


def kv_row_dim(cfg: ModelConfig, local_heads: int, expanded: bool = False) -> int:
    """Values one token holds per layer: the latent (kv_lora + rope), or with --disable-mla
    (`expanded`) each of this rank's heads' k (qk_nope + qk_rope) and v."""
    if expanded:
        return local_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    return cfg.kv_cache_dim


class KVPool:
    def __init__(self, num_layers: int, size: int, dim: int, dtype: torch.dtype, device: torch.device,
                 scale: float = 1.0):
        self.size, self.dim, self.dtype = size, dim, dtype
        self.scale = scale  # dequantised value = stored * scale (FP8 caches)
        self.device = torch.device(device)
        self.buffer = [torch.zeros(size + 1, dim, dtype=dtype, device=device) for _ in range(num_layers)]
        # Host-side free list: `alloc` takes from the head; freed slots queue behind it in `_freed`
        # and join the head only when it runs short, so a free costs O(freed), not O(pool).
        self._free = torch.arange(1, size + 1, dtype=torch.int64)
        self._freed: list[torch.Tensor] = []
        self._num_freed = 0

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffer)

    def available(self) -> int:
        return int(self._free.numel()) + self._num_freed

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots (host int64 tensor), or None when the pool cannot hold them."""
        if n > self._free.numel():
            if n > self.available():
                return None
            self._join_freed()
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._freed.append(slots.to("cpu", torch.int64))
            self._num_freed += int(slots.numel())

    def free_slots(self) -> torch.Tensor:
        """Every free slot, in the order `alloc` hands them out (for accounting checks)."""
        self._join_freed()
        return self._free

    def _join_freed(self) -> None:
        if self._freed:
            self._free = torch.cat((self._free, *self._freed))
            self._freed, self._num_freed = [], 0

    def write(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        if self.dtype != values.dtype:
            values = (values.float() / self.scale).to(self.dtype)
        if self.dtype.itemsize == 1:  # no index_copy_ kernel for float8 on CUDA: copy the bytes
            self.buffer[layer].view(torch.uint8).index_copy_(0, slots, values.view(torch.uint8))
        else:
            self.buffer[layer].index_copy_(0, slots, values)

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = self.buffer[layer][slots]
        if rows.dtype != dtype:
            rows = (rows.float() * self.scale).to(dtype)
        return rows


class ReqToTokenPool:
    """max_reqs allocatable rows, one padding row (all slot 0) for padded CUDA-graph batches, then
    `reserve_scratch` rows: speculative decoding writes one KV index list per draft-tree node there
    (engine/speculative/tree_table.py), so that tree forwards run through the decode CUDA graphs,
    which hold this table's address."""

    def __init__(self, max_reqs: int, max_context: int, device: torch.device):
        self.table = torch.zeros(max_reqs + 1, max_context, dtype=torch.int32, device=device)
        self.padding_row = max_reqs
        self.num_scratch = 0
        self._free_rows = list(range(max_reqs - 1, -1, -1))

    def reserve_scratch(self, rows: int) -> None:
        """Grow the scratch region to `rows` rows (reallocates the table: call before any CUDA graph
        capture that reads it)."""
        if rows <= self.num_scratch:
            return
        grown = torch.zeros(self.padding_row + 1 + rows, self.table.shape[1], dtype=self.table.dtype,
                            device=self.table.device)
        grown[:self.table.shape[0]] = self.table
        self.table, self.num_scratch = grown, rows

    def write_scratch(self, lists: torch.Tensor) -> Optional[torch.Tensor]:
        """Write KV index lists [R, W] into the first R scratch rows and return those rows' indices, or
        None when they do not fit (more rows than reserved, or wider than the table)."""
        r, w = lists.shape
        if r > self.num_scratch or w > self.table.shape[1]:
            return None
        self.table[self.first_scratch:self.first_scratch + r, :w] = lists
        return torch.arange(self.first_scratch, self.first_scratch + r, dtype=torch.int64, device=self.table.device)

    @property
    def first_scratch(self) -> int:
        """The first scratch row: `write_scratch` of R lists writes rows first_scratch .. first_scratch + R - 1."""
        return self.padding_row + 1

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def set(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start:start + slots.numel()] = tensor_to_device(slots.to(torch.int32), self.table.device)

    def slots(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        return self.table[row, start:end].to(torch.int64)
