"""KV memory of scheduled requests: request-table rows, pool slots and the radix prefix cache.

`RequestMemory` is the only place that moves slots between the KV pool, the
radix cache and requests. A request's slots are `req.slots` (a tensor: the
prompt's, reserved at admission) followed by `req.decode_slots` (a list: one slot
per decode step, appended in O(1) so a step never copies a request's slots);
`slots_of` joins them. The first prefix_len belong to the cache (locked through
`last_node`); the rest are the request's own until it is released, when its
computed KV is inserted into the cache (or freed when the cache is disabled).
A request that failed is released with `keep=False`: nothing it computed is
cached (a failed step may have left its KV half written). Invariant when nothing
runs: pool.available() + cache.total_size() == pool.size.
"""

from __future__ import annotations

from array import array
from typing import Optional, Protocol

import torch

from engine.forward_batch import to_device
from engine.memory.pools import KVPool, ReqToTokenPool
from engine.memory.radix_cache import RadixCache

_EMPTY = torch.empty(0, dtype=torch.int64)
EVICT_FRACTION = 256


class Request(Protocol):
    """What RequestMemory reads and writes of a request (engine/scheduler/request.py `Request` has it)."""

    token_ids: list[int]  # the prompt, then each generated token
    row: Optional[int]  # its request-table row (None: not reserved)
    slots: torch.Tensor  # host tensor: the prompt's slots (set at admission and after the prefill)
    decode_slots: list[int]  # one per decode step, after `slots`
    kv_len: int  # slots whose KV is computed (or launched)
    prefix_len: int  # slots that belong to the radix cache, locked through `last_node`
    last_node: Optional[object]

    @property
    def wants_prompt_logprobs(self) -> bool: ...


class RequestMemory:
    def __init__(self, pool: KVPool, table: ReqToTokenPool, enable_cache: bool):
        self.pool, self.table = pool, table
        self.cache: Optional[RadixCache] = RadixCache(pool.free) if enable_cache else None

    # ---- sizes ---------------------------------------------------------------------
    def headroom(self) -> int:
        """Slots that can be had now: free ones plus those the cache could evict."""
        return self.pool.available() + (self.cache.evictable_size() if self.cache else 0)

    def cache_tokens(self) -> int:
        return self.cache.total_size() if self.cache else 0

    def make_room(self, n: int) -> bool:
        """Evict from the cache until n slots are free; False when that is impossible.

        An eviction walks the whole tree, so when it must run it frees at least 1/EVICT_FRACTION of the
        pool: with a full cache, steps then evict once in a while instead of every step."""
        short = n - self.pool.available()
        if short > 0 and self.cache is not None:
            self.cache.evict(max(short, self.pool.size // EVICT_FRACTION))
        return self.pool.available() >= n

    # ---- admission ---------------------------------------------------------------------
    def match(self, req: Request) -> None:
        """Reuse the cached prefix of req's tokens (locking it). At most len-1 tokens match, so the
        prefill computes at least the last token (its logits give the next token)."""
        ids = req.token_ids
        if self.cache is None or req.wants_prompt_logprobs or len(ids) < 2:
            req.slots, req.last_node = _EMPTY, None
        else:
            req.slots, req.last_node = self.cache.match_prefix(ids, len(ids) - 1)
            self.cache.inc_lock(req.last_node)
        req.prefix_len = req.kv_len = int(req.slots.numel())

    def unmatch(self, req: Request) -> None:
        """Undo `match` for a request that could not be admitted after all."""
        if self.cache is not None and req.last_node is not None:
            self.cache.dec_lock(req.last_node)
        req.slots, req.last_node, req.prefix_len, req.kv_len = _EMPTY, None, 0, 0

    def reserve(self, req: Request) -> bool:
        """A table row and slots for every not-yet-cached token of req (after `match`)."""
        need = len(req.token_ids) - req.prefix_len
        if self.table.available() == 0 or not self.make_room(need):
            return False
        req.row = self.table.alloc()
        req.slots = torch.cat((req.slots, self.pool.alloc(need)))
        self.table.set(req.row, 0, req.slots)
        return True

    # ---- decode ---------------------------------------------------------------------------
    def append_decode_slots(self, reqs: list[Request]) -> torch.Tensor:
        """One new slot per request at position kv_len (caller made room); returns them."""
        slots = self.pool.alloc(len(reqs))
        self.append_slots(reqs, [[slot] for slot in slots.tolist()])
        return slots

    def append_slots(self, reqs: list[Request], slots: list[list[int]]) -> None:
        """Give each request its slots (already taken from the pool: a decode step's, or a speculative step's
        accepted tree nodes) at positions kv_len.. in order. O(tokens added): one table write for the batch,
        one list extend per request."""
        rows = [r.row for r, s in zip(reqs, slots) for _ in s]
        pos = [p for r, s in zip(reqs, slots) for p in range(r.kv_len, r.kv_len + len(s))]
        flat = [x for s in slots for x in s]
        # one copy that does not wait for the forward in flight (overlap): rows, positions, slots
        cols = to_device(rows + pos + flat, self.table.table.device).view(3, len(flat))
        self.table.table[cols[0], cols[1]] = cols[2].to(torch.int32)
        for req, s in zip(reqs, slots):
            req.decode_slots.extend(s)
            req.kv_len += len(s)

    def drop_decode_slots(self, reqs: list[Request]) -> None:
        """Undo `append_decode_slots` for reqs (their step failed before computing the token): free the last
        slot of each. Its table entry stays, beyond kv_len, unread until the next append overwrites it."""
        slots = []
        for req in reqs:
            slots.append(req.decode_slots.pop())
            req.kv_len -= 1
        self.pool.free(torch.tensor(slots, dtype=torch.int64))

    @staticmethod
    def slots_of(req: Request) -> torch.Tensor:
        """All of req's slots, in token order."""
        if not req.decode_slots:
            return req.slots
        # through array('q'): torch.tensor(list) costs ~0.15 us per int, 37 us for 256 decode slots, paid for every
        # request a step finishes (256 at once when a wave of equal requests ends) before its outputs go out
        return torch.cat((req.slots, torch.frombuffer(array("q", req.decode_slots), dtype=torch.int64)))

    # ---- caching -------------------------------------------------------------------------------
    def cache_prefill(self, req: Request) -> None:
        """After req's whole prompt is computed: put it in the cache and lock it.

        Where the cache already held some of these tokens (cached meanwhile by another
        request), the request switches to the cache's slots and frees its duplicates.
        """
        if self.cache is None:
            return
        assert not req.decode_slots, "cache_prefill runs before the first decode step"
        k = req.kv_len
        ids = req.token_ids[:k]
        present = self.cache.insert(ids, req.slots[:k])
        if present > req.prefix_len:
            self.pool.free(req.slots[req.prefix_len:present])
        slots, node = self.cache.match_prefix(ids)
        if present > req.prefix_len:
            self.table.set(req.row, req.prefix_len, slots[req.prefix_len:present])
        req.slots = torch.cat((slots, req.slots[k:]))
        self.cache.inc_lock(node)
        if req.last_node is not None:
            self.cache.dec_lock(req.last_node)
        req.last_node, req.prefix_len = node, k

    def release(self, req: Request, keep: bool = True) -> None:
        """Give back req's row and slots. With `keep` its computed KV goes into the cache when there is
        one; without, only the cached prefix it started from stays cached (its own slots are freed)."""
        if req.row is None:
            if req.last_node is not None:
                self.unmatch(req)
            return
        slots = self.slots_of(req)
        k = min(req.kv_len, len(req.token_ids))
        if self.cache is not None and keep:
            present = self.cache.insert(req.token_ids[:k], slots[:k])
            self.pool.free(slots[req.prefix_len:present])  # duplicates of what the cache already had
            self.pool.free(slots[k:])  # reserved but never computed
        elif self.cache is not None:
            self.pool.free(slots[req.prefix_len:])
        else:
            self.pool.free(slots)
        if self.cache is not None and req.last_node is not None:
            self.cache.dec_lock(req.last_node)
        self.table.free(req.row)
        req.row, req.slots, req.kv_len, req.prefix_len, req.last_node = None, _EMPTY, 0, 0, None
        req.decode_slots = []
