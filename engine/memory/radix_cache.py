"""Radix prefix cache over the token-granular KV pool.

A radix tree keyed by token ids. Each node holds a run of tokens (`key`) and the
KV-pool slots where their latent KV lives (`slots`, same length). A path from the
root spells a token prefix whose KV is cached, so a new request whose prompt
starts with that prefix reuses the slots instead of recomputing them.

Ownership: slots held by the tree belong to the tree. A request that reuses a
prefix locks the path to its last matched node (`inc_lock`), so that part can
not be evicted while the request runs; it unlocks it (`dec_lock`) when done.
`evict(n)` frees least-recently-used unlocked leaves (slots go back to the pool
through `free_slots`) until n tokens are freed or nothing unlocked is left.

Sizes: `total_size()` tokens held by the tree, `evictable_size()` of those in
unlocked nodes, `protected_size()` in locked ones (total = evictable + protected).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Optional

import torch

_EMPTY = torch.empty(0, dtype=torch.int64)


class RadixNode:
    __slots__ = ("key", "slots", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: list[int], slots: torch.Tensor, parent: Optional["RadixNode"]):
        self.key = key
        self.slots = slots
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"RadixNode(len={len(self.key)}, lock={self.lock_ref}, children={len(self.children)})"


def _common_len(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of a and b[start:] (blocks compared as list slices, at C speed)."""
    n = min(len(a), len(b) - start)
    if a[:n] == b[start:start + n]:
        return n
    i, block = 0, 64
    while i + block <= n and a[i:i + block] == b[start + i:start + i + block]:
        i += block
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, free_slots: Callable[[torch.Tensor], None]):
        self.free_slots = free_slots
        self.root = RadixNode([], _EMPTY, None)
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self._evictable = 0
        self._protected = 0
        self.evicted_tokens = 0  # cumulative

    # ---- sizes ---------------------------------------------------------------
    def total_size(self) -> int:
        return self._evictable + self._protected

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    # ---- lookup ------------------------------------------------------------------
    def match_prefix(self, ids: list[int], limit: Optional[int] = None) -> tuple[torch.Tensor, RadixNode]:
        """Slots of the longest cached prefix of ids[:limit] and the node where it ends.

        A match that ends inside a node splits it, so the returned node ends exactly
        at the match (lock it to protect precisely the matched tokens).
        """
        ids = ids if limit is None else ids[:limit]
        node, pos, parts, now = self.root, 0, [], next(self._clock)
        node.last_access = now
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common_len(child.key, ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.slots)
            node, pos = child, pos + n
        slots = torch.cat(parts) if parts else _EMPTY
        return slots, node

    def match_length(self, ids: list[int], limit: Optional[int] = None) -> int:
        """Length of the longest cached prefix, without changing the tree (no split, no LRU touch)."""
        ids = ids if limit is None else ids[:limit]
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common_len(child.key, ids, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    # ---- insertion ----------------------------------------------------------------
    def insert(self, ids: list[int], slots: torch.Tensor) -> int:
        """Cache ids with their slots; return how many leading tokens were cached already.

        For that already-cached part the tree keeps its own slots: the caller still owns
        (and must free or keep) the corresponding entries of `slots`. The rest of `slots`
        now belongs to the tree.
        """
        if len(ids) != slots.numel():
            raise ValueError(f"{len(ids)} token ids but {slots.numel()} slots")
        node, pos, now = self.root, 0, next(self._clock)
        node.last_access = now
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                leaf = RadixNode(list(ids[pos:]), slots[pos:].clone(), node)
                leaf.last_access = now
                node.children[ids[pos]] = leaf
                self._evictable += len(leaf)
                return pos
            n = _common_len(child.key, ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        return pos

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut node after its first n tokens; return the new upper part (node keeps the tail)."""
        parent = node.parent
        upper = RadixNode(node.key[:n], node.slots[:n], parent)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        parent.children[node.key[0]] = upper
        node.key, node.slots, node.parent = node.key[n:], node.slots[n:], upper
        upper.children[node.key[0]] = node
        return upper

    # ---- locking -------------------------------------------------------------------
    def inc_lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node)
                self._protected += len(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: unlocking a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node)
                self._protected -= len(node)
            node = node.parent

    # ---- eviction --------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from LRU unlocked leaves (fewer if not enough); return freed."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, node = heapq.heappop(heap)
            freed += self._remove_leaf(node)
            parent = node.parent
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.evicted_tokens += freed
        return freed

    def evict_all(self) -> int:
        """Free every unlocked cached token; return how many."""
        return self.evict(self._evictable)

    def _remove_leaf(self, node: RadixNode) -> int:
        self.free_slots(node.slots)
        del node.parent.children[node.key[0]]
        self._evictable -= len(node)
        return len(node)

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds (for accounting checks)."""
        parts, stack = [], [self.root]
        while stack:
            node = stack.pop()
            parts.append(node.slots)
            stack.extend(node.children.values())
        return torch.cat(parts) if parts else _EMPTY
