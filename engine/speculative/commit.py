"""The end of a speculative step: commit the accepted nodes' KV slots and hand the tokens to the output processor.

Everything the host needs comes from ONE copy of a small packed tensor, [B, 2 + 2 (S + 1)] ints per step:
accepted path length, bonus token, the path's node indices and their tokens. From it:
- commit: the accepted nodes' slots become the requests' positions kv_len.. (`mem.append_slots`, one table
  write for the batch), every other verified node's slot goes back to the pool in one `free`; the
  accepted nodes' target hidden states (the next draft extend's input) are gathered on the device at once;
- emit: the emitted tokens (accepted drafts, then the bonus) go through the `OutputProcessor` one position
  at a time, so EOS, stop ids, stop strings, max_new_tokens and the context limit end a request exactly
  where plain decoding would (later tokens of a run are dropped). Log-probs (and top log-probs) come
  from the verify logits of the node that decided each token, gathered for the whole step at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import to_device
from engine.sampling import SampleResult


@dataclass(frozen=True)
class Accepted:
    """The host copy: per request the accepted nodes (from the root), the emitted tokens, the slots."""
    nodes: list[list[int]]
    tokens: list[list[int]]  # the accepted draft tokens, then the bonus token
    slots: list[list[int]]


def commit_and_emit(reqs, batch, tree: torch.Tensor, accepted: torch.Tensor, verify_slots: torch.Tensor, out,
                    mem, outputs, pool) -> list[int]:
    """accepted: [B, S + 3] (length, bonus, path, its last node repeated; decoder._accept) on the device;
    tree: the packed [3, B, N] tree; verify_slots: the nodes' slots (host); out: the verify forward's output.
    Returns the tokens emitted per request (before a stop cuts them)."""
    b, n = tree.shape[1:]
    path = accepted[:, 2:]
    width = path.shape[1]
    hidden = out.hidden[(batch.index.node_base + path).view(-1)]  # row i * width + t: node t of i's path
    host = torch.cat((accepted, tree[0].gather(1, path)), 1).cpu()  # the step's one host copy of its result
    acc = _commit(reqs, host, verify_slots.view(b, n), mem, pool)
    for i, req in enumerate(reqs):  # the next draft extend's inputs
        req.spec.parts = [(hidden, j) for j in range(i * width, i * width + len(acc.nodes[i]))]
    _emit(reqs, acc, n, out.logits, outputs)
    return [len(t) for t in acc.tokens]


def _commit(reqs, host: torch.Tensor, slots: torch.Tensor, mem, pool) -> Accepted:
    """Accepted nodes' slots to the requests (`mem.append_slots`), every other node's back to the pool."""
    width = (host.shape[1] - 2) // 2
    path = host[:, 2:2 + width]
    keep = torch.zeros(slots.shape, dtype=torch.bool).scatter_(1, path, True)
    pool.free(slots[~keep])
    nodes, tokens, kept = [], [], []
    for row, s in zip(host.tolist(), slots.gather(1, path).tolist()):
        k, bonus = row[0], row[1]
        nodes.append(row[2:2 + k])
        tokens.append(row[3 + width:2 + width + k] + [bonus])
        kept.append(s[:k])
    mem.append_slots(reqs, kept)
    return Accepted(nodes, tokens, kept)


def _emit(reqs, acc: Accepted, n: int, logits: torch.Tensor, outputs) -> None:
    """Hand the tokens to the output processor one position at a time (stops cut a run exactly)."""
    lps, tops = _logprobs(reqs, acc, n, logits)
    emitted = acc.tokens
    for k in range(max(len(e) for e in emitted)):
        idx = [i for i, e in enumerate(emitted) if len(e) > k]
        outputs.process([reqs[i] for i in idx], SampleResult(
            tokens=[emitted[i][k] for i in idx], logprobs=[lps[i][k] if lps else 0.0 for i in idx],
            top=[tops[i][k] if tops[i] else [] for i in idx] if tops else [[] for _ in idx]))


def _logprobs(reqs, acc: Accepted, n: int, logits: torch.Tensor):
    """Per request and emitted token: its log-prob and top log-probs under the verify logits of the node that
    decided it (None when no request asks). One gather for the whole step, one top-k per distinct count."""
    if not any(r.params.logprobs or r.params.top_logprobs for r in reqs):
        return None, None
    logp = torch.log_softmax(logits.float(), dim=-1)
    rows = [i * n + j for i, nodes in enumerate(acc.nodes) for j in nodes]
    toks = [t for e in acc.tokens for t in e]
    flat = logp[to_device(rows, logp.device), to_device(toks, logp.device)].tolist()
    lps, start = [], 0
    for e in acc.tokens:
        lps.append(flat[start:start + len(e)])
        start += len(e)
    tops: list[list] = [[] for _ in reqs]
    for count in {r.params.top_logprobs for r in reqs if r.params.top_logprobs}:
        mine = [i for i, r in enumerate(reqs) if r.params.top_logprobs == count]
        sel = [i * n + j for i in mine for j in acc.nodes[i]]
        v, ix = logp[to_device(sel, logp.device)].topk(count)
        pairs = [list(zip(a, b)) for a, b in zip(ix.tolist(), v.tolist())]
        for i in mine:
            tops[i], pairs = pairs[:len(acc.nodes[i])], pairs[len(acc.nodes[i]):]
    return lps, tops
