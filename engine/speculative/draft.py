"""The draft's batches (run by draft_runner.py) and the EAGLE-2 token tree they produce.

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

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.runner.model_runner import ForwardOutput
from engine.speculative.draft_runner import DraftRunner
from engine.speculative.step_batch import Pending, StepBatch
from engine.speculative.tree_forward import forward_tree
from engine.speculative.tree_table import build_tree_table, tree_batch


def extend_draft(draft: DraftRunner, rows: list[int], starts: list[int], tokens: list[list[int]],
                 hidden: torch.Tensor) -> ForwardOutput:
    """MTP layer over positions [start, start + len(tokens)) of each request (logits: last row of each)."""
    runner = draft.runner
    lens = [len(t) for t in tokens]
    ids = [x for t in tokens for x in t]
    slots = torch.cat([runner.req_to_token.slots(r, s + n, s) for r, s, n in zip(rows, starts, lens)])
    last = torch.tensor(lens).cumsum(0) - 1
    fb = ForwardBatch.build(ForwardMode.DRAFT_EXTEND, ids, rows, starts, lens, slots, last.tolist(), runner.device)
    fb.spec_hidden = hidden
    return draft.forward(fb)


def decode_draft(draft: DraftRunner, pending: Pending, every_row_logits: bool = True) -> ForwardOutput:
    """`extend_draft` as a decode-mode batch, for a decode step's few pending positions: one row per
    position (its request's table row, sequence length position + 1; the MTP layer writes every row's KV
    before attending), so the MTP layer's CUDA graphs run it. Logits for every row, or (every_row_logits
    False: a catch-up wants only the KV) for each request's last row where it runs eagerly; a CUDA graph
    computes its rows' logits either way."""
    p, runner = pending, draft.runner
    slots = runner.req_to_token.table[p.rows, p.positions].to(torch.int64)
    fb = tree_batch(p.ids, p.positions, slots, p.host_seq_lens, p.index, runner.max_model_len,
                    max(p.host_seq_lens, default=1) - 1, req_rows=p.rows, spec_hidden=p.hidden,
                    host_rows=p.host_rows)
    if not every_row_logits:
        fb.logits_indices = p.last
    return draft.forward(fb)


def draft_tree(draft: DraftRunner, first_logits: torch.Tensor, first_hidden: torch.Tensor, batch: StepBatch, steps: int,
               topk: int, num_nodes: int) -> torch.Tensor:
    """The EAGLE-2 tree (module docstring), packed [3, B, N] (tokens, parents, depths) on the device, where TP
    ranks can share rank 0's. first_*: the MTP output at each request's last position; batch: the step's
    device inputs (its draft_slots [B, steps - 1, topk] take the frontier nodes' draft KV). Candidates are
    numbered 0 (the root, score +inf so that it is always selected first), then in generation order."""
    b, k, ix = len(batch.rows), topk, batch.index
    score, tok = torch.log_softmax(first_logits.float(), -1).topk(k, dim=-1)  # [B, K]
    cand_tok, cand_score, cand_parent = [batch.roots[:, None], tok], [ix.root_score, score], [ix.cand_first]
    f = _Frontier(ix.first_ids, tok, score, first_hidden[ix.frontier_req],
                  torch.empty(b, k, 0, dtype=torch.int64, device=tok.device))
    offset = 1 + k
    for d in range(2, steps + 1):
        out, anc = _draft_step(draft, batch, f, d)
        s, t = torch.log_softmax(out.logits.float(), -1).view(b, k, -1).topk(k, dim=-1)  # [B, K, K]
        ch_score = (f.score[..., None] + s).view(b, k * k)
        ch_tok = t.view(b, k * k)
        cand_tok.append(ch_tok)
        cand_score.append(ch_score)
        cand_parent.append(f.idx.gather(1, ix.child_of))
        order = torch.sort(ch_score, dim=1, descending=True, stable=True).indices[:, :k]
        prow = order.div(k, rounding_mode="floor") + ix.frontier_base  # the proposing frontier row
        f = _Frontier(offset + order, ch_tok.gather(1, order), ch_score.gather(1, order), out.hidden[prow.view(-1)],
                      anc.view(b * k, -1)[prow])
        offset += k * k
    return _select(torch.cat(cand_tok, 1), torch.cat(cand_score, 1), torch.cat(cand_parent, 1), ix.cand_depth,
                   ix.unselected, ix.node_ids)


@dataclass(frozen=True)
class _Frontier:
    """The nodes a draft step expands, K per request: candidate number, token, cumulative log-prob, the MTP
    hidden state that proposed it ([B x K, H]) and its ancestors' draft slots ([B, K, depth - 1])."""
    idx: torch.Tensor
    tok: torch.Tensor
    score: torch.Tensor
    hidden: torch.Tensor
    anc: torch.Tensor


def _draft_step(draft: DraftRunner, batch: StepBatch, f: _Frontier, d: int) -> tuple[ForwardOutput, torch.Tensor]:
    """Draft step d: the MTP layer over the frontier nodes (depth d - 1, at MTP position kv_len + d - 2: tree
    attention over the request's draft KV, its ancestors' scratch slots and its own); (output, those slots)."""
    b, k = f.tok.shape
    runner = draft.runner
    own = batch.draft_slots[:, d - 2, :]
    anc = torch.cat((f.anc, own[..., None]), dim=-1)  # [B, K, d - 1]: ancestors' draft slots, then its own
    max_kv = max(batch.kv)
    table = build_tree_table(runner.req_to_token.table, batch.frontier_rows, batch.frontier_kv,
                             anc.view(b * k, d - 1), max_kv)
    host_seq = [m + d - 1 for m in batch.kv for _ in range(k)]
    fb = tree_batch(f.tok.reshape(-1), batch.frontier_kv + (d - 2), own.reshape(-1), host_seq, batch.index.frontier,
                    runner.max_model_len, max_kv + d - 2, spec_hidden=f.hidden)
    return forward_tree(runner, fb, table, draft), anc


def _select(tok, score, parent, depth, unselected: torch.Tensor, node_ids: torch.Tensor) -> torch.Tensor:
    """The N best candidates by cumulative log-prob (the root first: its score is +inf), in generation order,
    packed [3, B, N] (tokens, parents as node indices, depths). tok / score / parent (candidate numbers, -1
    for the root) / depth [B, C]; unselected [B, C + 1] all -1; node_ids [B, N] 0..N-1 per row."""
    n = node_ids.shape[1]
    sel = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :n].sort(dim=1).values
    node_of = unselected.clone().scatter_(1, sel + 1, node_ids)  # column c + 1: candidate c's node (-1: none)
    parents = node_of.gather(1, parent.gather(1, sel) + 1)  # the root's parent -1 reads column 0: -1
    return torch.stack((tok.gather(1, sel), parents, depth.gather(1, sel)))
