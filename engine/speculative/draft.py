"""The draft: the MTP layer's forwards and the EAGLE-2 token tree they produce.

`extend_draft` runs the MTP layer over the positions of each request whose draft KV is missing (the
target's hidden state at position i and the token at i + 1 in, the draft KV of position i out, at the
request's own slots in the pool's MTP layer); its last row per request is the first draft step. After
a prefill it runs as an extend; in a decode step (a few positions per request) `decode_draft` runs it
as a decode-mode batch, which the MTP layer's CUDA graphs hold.
`draft_tree` then runs the remaining steps: each of the top-k frontier nodes feeds its token and the
hidden state that predicted it back into the MTP layer (tree attention over the request's draft KV,
its ancestors' scratch slots and its own), every frontier node proposes its top-k children, the
frontier becomes the k children with the best cumulative draft log-probability, and finally the
num_draft_tokens - 1 best candidates of all steps by cumulative log-probability (EAGLE-2's re-ranking)
become the tree under the root. A child's cumulative log-prob is at most its parent's and ties keep
generation order, so that selection always contains every selected node's parent.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.forward_batch import ForwardBatch, ForwardMode, to_device
from engine.runner import ForwardOutput
from engine.speculative.tree_table import build_tree_table, tree_batch


@dataclass
class DraftTree:
    """Per request, N nodes: node 0 is the root (the last accepted token), parents precede children."""
    tokens: list[list[int]]
    parents: list[list[int]]  # -1 for the root
    depths: list[list[int]]


def extend_draft(runner, rows: list[int], starts: list[int], tokens: list[list[int]],
                 hidden: torch.Tensor) -> ForwardOutput:
    """MTP layer over positions [start, start + len(tokens)) of each request (logits: last row of each)."""
    lens = [len(t) for t in tokens]
    ids = [x for t in tokens for x in t]
    slots = torch.cat([runner.req_to_token.slots(r, s + n, s) for r, s, n in zip(rows, starts, lens)])
    last = torch.tensor(lens).cumsum(0) - 1
    fb = ForwardBatch.build(ForwardMode.DRAFT_EXTEND, ids, rows, starts, lens, slots, last.tolist(), runner.device)
    fb.spec_hidden = hidden
    return runner.forward_mtp(fb)


def decode_draft(runner, rows: list[int], starts: list[int], tokens: list[list[int]],
                 hidden: torch.Tensor) -> ForwardOutput:
    """`extend_draft` as a decode-mode batch, for a decode step's few pending positions: one row per
    position (its request's table row, sequence length position + 1; the MTP layer writes every row's KV
    before attending), so the MTP layer's CUDA graphs run it. Logits for every row."""
    dev = runner.device
    pos = [s + i for s, t in zip(starts, tokens) for i in range(len(t))]
    req_rows = to_device([r for r, t in zip(rows, tokens) for _ in t], dev)
    slots = runner.req_to_token.table[req_rows, to_device(pos, dev)].to(torch.int64)
    ids = to_device([x for t in tokens for x in t], dev)
    fb = tree_batch(ids, pos, [p + 1 for p in pos], slots, dev, runner.max_model_len)
    return runner.forward_mtp(replace(fb, req_pool_indices=req_rows, spec_hidden=hidden))


def draft_tree(runner, first_logits: torch.Tensor, first_hidden: torch.Tensor, roots: list[int],
               rows: list[int], kv_lens: list[int], draft_slots: torch.Tensor, steps: int, topk: int,
               num_nodes: int) -> torch.Tensor:
    """The EAGLE-2 tree (module docstring), packed [3, B, N] (tokens, parents, depths) on the device so that
    TP ranks can share rank 0's (`unpack_tree` makes it a DraftTree). first_*: the MTP output at each
    request's last position; draft_slots [B, steps - 1, topk]: scratch slots for the frontier nodes' draft KV."""
    dev = first_logits.device
    b, k = len(rows), topk
    score, tok = torch.log_softmax(first_logits.float(), -1).topk(k, dim=-1)  # [B, K]
    cand_tok, cand_score = [tok], [score]
    cand_parent = [torch.full((b, k), -1, dtype=torch.int64, device=dev)]
    cand_depth = [torch.ones((b, k), dtype=torch.int64, device=dev)]
    f_idx = torch.arange(k, device=dev).expand(b, k)
    f_tok, f_score = tok, score
    f_hidden = first_hidden[:, None, :].expand(b, k, first_hidden.shape[-1])
    f_anc = torch.empty(b, k, 0, dtype=torch.int64, device=dev)
    req_rows = to_device(rows, dev).repeat_interleave(k)
    prefix = to_device(kv_lens, dev).repeat_interleave(k)
    draft_slots = draft_slots.to(dev)
    offset = k
    for d in range(2, steps + 1):
        own = draft_slots[:, d - 2, :]
        anc = torch.cat((f_anc, own[..., None]), dim=-1)  # [B, K, d - 1]: ancestors' draft slots, then its own
        table = build_tree_table(runner.req_to_token.table, req_rows, prefix, anc.reshape(b * k, d - 1),
                                 torch.full((b * k,), d - 1, device=dev), max(kv_lens))
        seq = [m + d - 1 for m in kv_lens for _ in range(k)]
        fb = tree_batch(f_tok.reshape(-1), [s - 1 for s in seq], seq, own.reshape(-1), dev, runner.max_model_len)
        fb.spec_hidden = f_hidden.reshape(b * k, -1)
        out = runner.forward_tree(fb, table, mtp=True)
        s, t = torch.log_softmax(out.logits.float(), -1).view(b, k, -1).topk(k, dim=-1)  # [B, K, K]
        ch_score = (f_score[..., None] + s).reshape(b, k * k)
        ch_tok = t.reshape(b, k * k)
        cand_tok.append(ch_tok)
        cand_score.append(ch_score)
        cand_parent.append(f_idx[..., None].expand(b, k, k).reshape(b, k * k))
        cand_depth.append(torch.full((b, k * k), d, dtype=torch.int64, device=dev))
        order = torch.sort(ch_score, dim=1, descending=True, stable=True).indices[:, :k]
        prow = order // k  # the frontier row that proposed each new frontier node
        f_idx, f_tok, f_score = offset + order, ch_tok.gather(1, order), ch_score.gather(1, order)
        f_hidden = out.hidden.view(b, k, -1).gather(1, prow[..., None].expand(b, k, out.hidden.shape[-1]))
        f_anc = anc.gather(1, prow[..., None].expand(b, k, d - 1))
        offset += k * k
    return _select(torch.cat(cand_tok, 1), torch.cat(cand_score, 1), torch.cat(cand_parent, 1),
                   torch.cat(cand_depth, 1), roots, num_nodes)


def _select(tok, score, parent, depth, roots: list[int], num_nodes: int) -> torch.Tensor:
    """The num_nodes - 1 best candidates by cumulative log-prob, in generation order, under the root."""
    b, dev = tok.shape[0], tok.device
    sel = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :num_nodes - 1].sort(dim=1).values
    node_of = torch.full_like(tok, -1)
    node_of.scatter_(1, sel, torch.arange(1, num_nodes, device=dev).expand(b, num_nodes - 1))
    par = parent.gather(1, sel)
    par_node = torch.where(par < 0, 0, node_of.gather(1, par.clamp(min=0)))
    col = to_device(roots, dev)[:, None]
    zero = torch.zeros_like(col)
    packed = torch.stack((torch.cat((col, tok.gather(1, sel)), 1), torch.cat((zero - 1, par_node), 1),
                          torch.cat((zero, depth.gather(1, sel)), 1)))
    return packed


def unpack_tree(packed: torch.Tensor) -> DraftTree:
    """[3, B, N] (tokens, parents, depths) -> host lists (one copy)."""
    tokens, parents, depths = packed.tolist()
    return DraftTree(tokens, parents, depths)
