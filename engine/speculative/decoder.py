"""The speculative decode step: draft, verify, accept, commit, hand the tokens to the output processor.

The scheduler calls `after_extend` after every prefill forward and, in place of its plain decode
step, `step` on its decode batch (engine/scheduler/scheduler.py `_launch_spec`). Per request it keeps a `SpecState` (Request.spec): the
positions whose draft (MTP) KV is written, and the target hidden states of the positions after them,
whose draft KV needs the next token first.

One step, for the running requests with kv_len = m (the last accepted token, the root, at position m):
1. draft extend: the MTP layer over the pending positions (up to m - 1), writing their draft KV; its
   last row starts the draft;
2. draft: the EAGLE-2 tree (draft.py), num_draft_tokens nodes per request, scratch slots for the
   draft KV of expanded nodes;
3. verify: ONE target forward over every node (tree attention by per-node KV lists, tree_table.py),
   at position m + depth, KV written to one fresh slot per node;
4. accept (accept.py): greedy or tree speculative sampling; TP ranks take rank 0's result;
5. commit: the accepted nodes' slots become the request's positions m.. in its request-table row (the
   table is an indirection: writing the slot ids places them contiguously, no KV is copied); the
   other nodes' and the draft's scratch slots go back to the pool now; the accepted nodes' target
   hidden states become the next draft extend's input;
6. the emitted tokens go through the OutputProcessor one position at a time, so EOS, stop ids, stop
   strings, max_new_tokens and the context limit end a request exactly where plain decode would, and
   later tokens of the run are dropped (the KV beyond is freed when the request is released).

The step synchronises (it reads the tree and the acceptance on the host), so with the overlap
scheduler on it first processes the step in flight. Its forwards (steps 1-3) are decode-mode batches:
with CUDA graphs on, the model's and the MTP layer's graphs (torch.compile'd where enabled) run them,
the tree rows' KV lists sitting in the request table's scratch rows (ModelRunner.forward_tree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.args import SpeculativeArgs
from engine.errors import UsageError
from engine.forward_batch import tensor_to_device, to_device
from engine.sampling import SampleResult
from engine.speculative.accept import accept_greedy, accept_sampled, children_of, target_probs
from engine.speculative.draft import decode_draft, draft_tree, extend_draft, unpack_tree
from engine.speculative.stats import SpecStats
from engine.speculative.tree_table import build_tree_table, tree_batch


@dataclass
class SpecState:
    mtp_len: int  # positions [0, mtp_len) have draft KV
    hidden: Optional[torch.Tensor]  # target hidden states of positions [mtp_len, kv_len)


class SpecDecoder:
    def __init__(self, runner, args: SpeculativeArgs):
        self.runner = runner
        self.steps, self.topk = args.speculative_num_steps, args.speculative_eagle_topk
        self.nodes = args.speculative_num_draft_tokens
        if self.topk > runner.config.vocab_size:
            raise UsageError(f"--speculative-eagle-topk {self.topk} exceeds the vocabulary "
                             f"({runner.config.vocab_size})")
        if runner.mtp is None:
            raise UsageError("speculative decoding needs an MTP/NextN draft layer")
        self.slots_per_req = self.nodes + (self.steps - 1) * self.topk  # verify nodes + draft scratch
        self.stats = SpecStats(self.steps + 1)

    # ---- prefill ---------------------------------------------------------------------
    def after_extend(self, chunks, out) -> None:
        """After a prefill forward: draft KV for every position whose next token is known (all of a
        chunk but a final chunk's last position, whose hidden state waits for the sampled token)."""
        rows, starts, toks, hid, t = [], [], [], [], 0
        for c in chunks:
            req, n = c.req, c.end - c.start
            h = out.hidden[t:t + n]
            t += n
            k = n - 1 if c.final else n
            if k > 0:
                rows.append(req.row)
                starts.append(c.start)
                toks.append(req.token_ids[c.start + 1:c.start + 1 + k])
                hid.append(h[:k])
            req.spec = SpecState(c.start + k, h[k:].clone() if c.final else None)
        if rows:
            extend_draft(self.runner, rows, starts, toks, torch.cat(hid))

    # ---- decode ----------------------------------------------------------------------
    def step(self, reqs, outputs, mem) -> None:
        """One speculative step for `reqs` (the scheduler's decode batch, each with `slots_per_req` KV slots
        free for it); accepted slots go to the requests through `mem` (the scheduler's RequestMemory), the
        emitted tokens to `outputs`. Synchronous: nothing is left to process later."""
        self.stats.record(self._step(reqs, outputs, mem))

    def _step(self, reqs, outputs, mem) -> list[int]:
        runner, pool = self.runner, self.runner.kv_pool
        b, n = len(reqs), self.nodes
        kv = [r.kv_len for r in reqs]
        rows = [r.row for r in reqs]
        first = self._draft_extend(reqs)
        draft_slots = pool.alloc(b * (self.steps - 1) * self.topk)  # scratch: back to the pool in this step
        verify_slots = pool.alloc(b * n)
        try:
            packed = draft_tree(runner, first[0], first[1], [r.token_ids[-1] for r in reqs], rows, kv,
                                draft_slots.view(b, self.steps - 1, self.topk), self.steps, self.topk, n)
            tree = unpack_tree(runner.share_sampled(packed))
            out = self._verify(tree, rows, kv, verify_slots)
            paths, bonus = self._accept(reqs, tree, kv, out.logits)
        except BaseException:
            pool.free(verify_slots)
            raise
        finally:
            pool.free(draft_slots)
        emitted = self._commit(reqs, tree, paths, bonus, verify_slots, out.hidden, mem)
        self._emit(reqs, emitted, paths, out.logits, outputs)
        return [len(e) for e in emitted]

    def _draft_extend(self, reqs) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft KV for each request's pending positions; (logits, hidden) of its last one."""
        starts = [r.spec.mtp_len for r in reqs]
        toks = [r.token_ids[r.spec.mtp_len + 1:r.kv_len + 1] for r in reqs]
        out = decode_draft(self.runner, [r.row for r in reqs], starts, toks, torch.cat([r.spec.hidden for r in reqs]))
        last = to_device([len(t) for t in toks], out.hidden.device).cumsum(0) - 1
        for r in reqs:
            r.spec.mtp_len, r.spec.hidden = r.kv_len, None
        return out.logits[last], out.hidden[last]

    def _verify(self, tree, rows: list[int], kv: list[int], verify_slots: torch.Tensor):
        """One target forward over every tree node (node j of request i: row i * N + j)."""
        runner, n, dev = self.runner, self.nodes, self.runner.device
        width = self.steps + 1
        anc = torch.zeros(len(rows) * n, width, dtype=torch.int64)
        lens, seq, pos = [], [], []
        vs = verify_slots.view(len(rows), n)
        for i, (parents, depths) in enumerate(zip(tree.parents, tree.depths)):
            paths = _paths(parents)
            for j, path in enumerate(paths):
                anc[i * n + j, :len(path)] = vs[i, path]
                lens.append(len(path))
                pos.append(kv[i] + depths[j])
                seq.append(kv[i] + depths[j] + 1)
        table = build_tree_table(runner.req_to_token.table, to_device(rows, dev).repeat_interleave(n),
                                 to_device(kv, dev).repeat_interleave(n), tensor_to_device(anc, dev), to_device(lens, dev), max(kv))
        ids = to_device([t for toks in tree.tokens for t in toks], dev)
        fb = tree_batch(ids, pos, seq, verify_slots, dev, runner.max_model_len)
        return runner.forward_tree(fb, table)

    def _accept(self, reqs, tree, kv: list[int], logits: torch.Tensor) -> tuple[list[list[int]], list[int]]:
        """Per request the accepted path (node indices from the root) and the bonus token, rank 0's under TP."""
        n, limit = self.nodes, self.runner.max_model_len
        argmax = logits.argmax(-1).view(len(reqs), n).tolist()
        packed = [[-1] * (self.steps + 3) for _ in reqs]
        for i, req in enumerate(reqs):
            kids = children_of(tree.parents[i])
            live = [kv[i] + d <= limit - 1 for d in tree.depths[i]]
            if req.params.greedy:
                path, bonus = accept_greedy(argmax[i], tree.tokens[i], kids, live)
            else:
                rows = logits[i * n:(i + 1) * n]
                path, bonus = accept_sampled(lambda j, rows=rows, p=req.params: target_probs(rows[j], p),
                                             tree.tokens[i], kids, live, req.generator)
            packed[i][:2 + len(path)] = [len(path), bonus, *path]
        packed = self.runner.share_sampled(to_device(packed, self.runner.device).view(len(reqs), -1)).tolist()
        return [row[2:2 + row[0]] for row in packed], [row[1] for row in packed]

    def _commit(self, reqs, tree, paths, bonus, verify_slots: torch.Tensor, hidden: torch.Tensor,
                mem) -> list[list[int]]:
        """Accepted nodes' slots become the requests' positions kv_len.. (`mem.append_slots`), the other
        nodes' go back to the pool; the emitted tokens per request."""
        n = self.nodes
        vs = verify_slots.view(len(reqs), n)
        keep_mask = torch.zeros(len(reqs), n, dtype=torch.bool)
        emitted, hid_rows = [], []
        for i, path in enumerate(paths):
            keep_mask[i, path] = True
            hid_rows += [i * n + j for j in path]
            emitted.append([tree.tokens[i][j] for j in path[1:]] + [bonus[i]])
        mem.append_slots(reqs, [vs[i, path].tolist() for i, path in enumerate(paths)])
        self.runner.kv_pool.free(vs[~keep_mask])
        kept = hidden[to_device(hid_rows, hidden.device)].split([len(p) for p in paths])  # one gather for all
        for req, h in zip(reqs, kept):
            req.spec.hidden = h
        return emitted

    def _emit(self, reqs, emitted, paths, logits: torch.Tensor, outputs) -> None:
        """Hand the tokens to the output processor one position at a time (stops cut a run exactly)."""
        n = self.nodes
        logp = None
        if any(r.params.logprobs or r.params.top_logprobs for r in reqs):
            logp = torch.log_softmax(logits.float(), dim=-1)
        for k in range(max(len(e) for e in emitted)):
            idx = [i for i, e in enumerate(emitted) if len(e) > k]
            toks = [emitted[i][k] for i in idx]
            lps, tops = [0.0] * len(idx), [[] for _ in idx]
            if logp is not None:
                rows = [i * n + paths[i][k] for i in idx]  # the node whose logits decided the token
                lps = logp[rows, toks].tolist()
                for m, (i, row) in enumerate(zip(idx, rows)):
                    if reqs[i].params.top_logprobs:
                        v, ix = logp[row].topk(reqs[i].params.top_logprobs)
                        tops[m] = list(zip(ix.tolist(), v.tolist()))
            outputs.process([reqs[i] for i in idx], SampleResult(tokens=toks, logprobs=lps, top=tops))


def _paths(parents: list[int]) -> list[list[int]]:
    """Node indices from the root to each node (parents precede children)."""
    paths: list[list[int]] = []
    for j, p in enumerate(parents):
        paths.append([0] if p < 0 else paths[p] + [j])
    return paths
