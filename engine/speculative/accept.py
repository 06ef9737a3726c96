"""Which draft tokens the target accepts: greedy argmax match, or tree speculative sampling.

Both walk the verified tree from the root (the last accepted token). At the current node the target's
distribution p for the next token is the verify logits of that node.

- Greedy: the target's argmax y; if a child of the node carries y, it is accepted and the walk goes
  on from it, else y is the bonus token and the walk ends. The output is exactly the target's greedy
  continuation. `accept_greedy_batch` does the same for every greedy request of a step at once on the
  device (the decoder's path); `accept_greedy` is the per-request walk it is tested against.
- Sampling (temperature / top-k / top-p / min-p as the request asks): the children are deterministic
  candidates (the draft's top-k), tried in order. Child token x is accepted with probability
  r(x) / sum(r), where r starts as p and every rejected child's mass is removed (r(x) = 0); if every
  child is rejected the bonus token is drawn from r renormalised. By induction P(x_1) = p(x_1),
  P(x_2) = (1 - p(x_1)) * p(x_2) / (1 - p(x_1)) = p(x_2), ..., and the residual covers the rest, so
  every emitted token has exactly the target's distribution (the multi-draft recursive rejection
  scheme with point-mass drafts). tests/speculative/test_tree_sampling.py checks it with chi-square.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from engine.sampling import SamplingParams, _truncate


def children_of(parents: list[int]) -> list[list[int]]:
    """Children of each node, in node order (siblings come in the draft's descending-probability order)."""
    kids: list[list[int]] = [[] for _ in parents]
    for j, p in enumerate(parents):
        if p >= 0:
            kids[p].append(j)
    return kids


def accept_greedy(argmax: list[int], tokens: list[int], children: list[list[int]],
                  live: list[bool]) -> tuple[list[int], int]:
    """(accepted path of node indices from the root, bonus token) for target argmax per node."""
    path, cur = [0], 0
    while True:
        y = argmax[cur]
        nxt = next((c for c in children[cur] if live[c] and tokens[c] == y), None)
        if nxt is None:
            return path, y
        path.append(nxt)
        cur = nxt


def accept_greedy_batch(argmax: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                        live: torch.Tensor, anc: torch.Tensor, earlier: torch.Tensor,
                        is_root: torch.Tensor) -> torch.Tensor:
    """`accept_greedy` for every request at once, with tensor ops on the device (no host sync): [B, S + 3] rows
    of (accepted path length, bonus token, the path's node indices from the root, its last node repeated).

    argmax, tokens, parents (-1 at the root), depths [B, N]; live [B, N] bool; anc [B, N, S + 1]
    (tree_table.ancestors); earlier [N, N] bool ([i, j] = i < j); is_root [B, N] bool. A node is `chosen`
    when it is live, carries the target's argmax at its parent and no earlier sibling does (accept_greedy
    takes the first matching child in node order); the path is the chosen nodes all of whose ancestors
    are chosen (the root counts as chosen), one per depth."""
    b = tokens.shape[0]
    ok = live & (tokens == argmax.gather(1, parents.clamp(min=0))) | is_root
    shadowed = (ok[:, :, None] & (parents[:, :, None] == parents[:, None, :]) & earlier).any(1)
    on_path = (ok & ~shadowed).gather(1, anc.view(b, -1)).view(anc.shape).all(-1)
    count, end = ((depths + 1) * on_path).max(1)  # path length (the root: 1) and the path's last node
    path = anc.gather(1, end.view(b, 1, 1).expand(b, 1, anc.shape[2])).view(b, -1)
    return torch.cat((count[:, None], argmax.gather(1, end[:, None]), path), 1)


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from (temperature, then top-k / min-p / top-p), normalised."""
    probs = _truncate(torch.softmax(logits.float() / p.temperature, dim=-1), p)
    return probs / probs.sum()


def accept_sampled(probs_of: Callable[[int], torch.Tensor], tokens: list[int], children: list[list[int]],
                   live: list[bool], generator: Optional[torch.Generator]) -> tuple[list[int], int]:
    """Tree speculative sampling (module docstring): (accepted path, bonus token)."""
    path, cur = [0], 0
    while True:
        p = probs_of(cur)
        r = p.clone()
        accepted = None
        for c in children[cur]:
            if not live[c]:
                continue
            total = float(r.sum())
            if total <= 0:
                break
            x = tokens[c]
            if _uniform(generator, r.device) * total < float(r[x]):
                accepted = c
                break
            r[x] = 0
        if accepted is None:
            return path, _draw(r if float(r.sum()) > 0 else p, generator)
        path.append(accepted)
        cur = accepted


def _uniform(g: Optional[torch.Generator], device: torch.device) -> float:
    dev = g.device if g is not None else device
    return float(torch.rand((), generator=g, device=dev))


def _draw(probs: torch.Tensor, g: Optional[torch.Generator]) -> int:
    if g is not None and g.device != probs.device:
        probs = probs.to(g.device)
    return int(torch.multinomial(probs, 1, generator=g)[0])
