"""The speculative decode step: draft, verify, accept, commit, hand the tokens to the output processor.

The scheduler calls `after_extend` after every prefill forward and, in place of its plain decode
step, `step` on its decode batch (engine/scheduler/scheduler.py `_launch_spec`). Per request it keeps a
`SpecState` (Request.spec): the positions whose draft (MTP) KV is written, and the target hidden states
of the positions after them, whose draft KV needs the next token first.

One step, for the running requests with kv_len = m (the last accepted token, the root, at position m):
0. inputs: every host column the step needs goes to the device in one copy (step_batch.py);
1. draft extend: the MTP layer over the pending positions (up to m - 1), writing their draft KV; its
   last row starts the draft;
2. draft: the EAGLE-2 tree (draft.py), num_draft_tokens nodes per request, packed [3, B, N] on the
   device, scratch slots for the draft KV of expanded nodes;
3. verify: ONE target forward over every node (tree attention by per-node KV lists, tree_table.py),
   at position m + depth, KV written to one fresh slot per node; the lists, positions and ids are built
   with tensor ops from the packed tree; the host reads only the nodes' depths (the batch's host
   sequence lengths, which FlashInfer plans from and the torch backend loops over);
4. accept (accept.py): every greedy request at once with tensor ops, sampled requests by the host walk
   of tree speculative sampling; TP ranks take rank 0's packed result (one broadcast);
5. commit and 6. emit (commit.py), from one host copy of the packed result: the accepted nodes' slots
   become the request's positions m.. in its request-table row (the table is an indirection: writing
   the slot ids places them contiguously, no KV is copied); the other nodes' and the draft's scratch
   slots go back to the pool now; the accepted nodes' target hidden states become the next draft
   extend's input; the emitted tokens go through the OutputProcessor one position at a time, so EOS,
   stop ids, stop strings, max_new_tokens and the context limit end a request exactly where plain
   decode would, and later tokens of the run are dropped (the KV beyond is freed when the request is
   released).

The step synchronises twice (the tree's depths before verify, the acceptance after it), so with the
overlap scheduler on it first processes the step in flight. Its forwards (steps 1-3) are decode-mode
batches: with CUDA graphs on, the model's and the MTP layer's graphs (torch.compile'd where enabled) run
them, the tree rows' KV lists sitting in the request table's scratch rows (tree_forward.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.args import SpeculativeArgs
from engine.errors import UsageError
from engine.forward_batch import columns_to_device
from engine.speculative.accept import accept_greedy_batch, accept_sampled, children_of, target_probs
from engine.speculative.commit import commit_and_emit
from engine.speculative.draft import decode_draft, draft_tree, extend_draft
from engine.speculative.stats import SpecStats
from engine.speculative.step_batch import StepBatch, StepIndex, catch_up_pending
from engine.speculative.tree_forward import forward_tree
from engine.speculative.tree_table import ancestors, build_tree_table, tree_batch

CATCH_UP_EVERY = 16  # plain decode steps a request runs before its draft KV is caught up


@dataclass
class SpecState:
    mtp_len: int  # positions [0, mtp_len) have draft KV
    parts: list  # per position mtp_len..kv_len - 1: (tensor, row) holding the target's hidden state there
    # (one tensor serves every request of a step; plain decode steps append one position each)


class SpecDecoder:
    def __init__(self, runner, args: SpeculativeArgs):
        """runner: the ModelRunner, built with a draft (engine/speculative/draft_runner.py)."""
        self.runner, self.draft = runner, runner.draft
        self.steps, self.topk = args.speculative_num_steps, args.speculative_eagle_topk
        self.nodes = args.speculative_num_draft_tokens
        if self.topk > runner.config.vocab_size:
            raise UsageError(f"--speculative-eagle-topk {self.topk} exceeds the vocabulary "
                             f"({runner.config.vocab_size})")
        if self.draft is None:
            raise UsageError("speculative decoding needs an MTP/NextN draft layer")
        self.slots_per_req = self.nodes + (self.steps - 1) * self.topk  # verify nodes + draft scratch
        self.stats = SpecStats(self.steps + 1)
        self.disable_bs = args.speculative_disable_by_batch_size
        self._indices: dict[int, StepIndex] = {}  # per batch size

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
            rest = h[k:].clone() if c.final else None
            req.spec = SpecState(c.start + k, [(rest, j) for j in range(n - k)])
        if rows:
            extend_draft(self.draft, rows, starts, toks, torch.cat(hid))

    # ---- decode ----------------------------------------------------------------------
    def speculates(self, batch_size: int) -> bool:
        """Whether a decode step of `batch_size` requests speculates; else the scheduler runs a plain decode
        step and hands its hidden states to `after_plain_decode`."""
        return self.disable_bs is None or batch_size < self.disable_bs

    def after_plain_decode(self, reqs, hidden: torch.Tensor) -> None:
        """After a plain decode step of `reqs` (row i: request i's new position, the root it decoded): that
        position's draft KV waits for the sampled token, like the accepted positions after a spec step. The
        rows are copied (a CUDA graph's output buffer is overwritten by the next replay)."""
        h = hidden[:len(reqs)].clone()
        for i, r in enumerate(reqs):
            r.spec.parts.append((h, i))
        self.stats.plain_steps += 1

    def catch_up_due(self, reqs) -> bool:
        """Whether some request has run CATCH_UP_EVERY plain decode steps since its draft KV was complete."""
        return any(len(r.spec.parts) > CATCH_UP_EVERY for r in reqs)

    def catch_up(self, reqs, max_rows: int) -> None:
        """Draft KV for every pending position of `reqs` but each one's last (the next spec step's draft extend
        starts from it), in MTP forwards of at most `max_rows` rows (or one request's, if more). Needs every
        pending position's next token on the host (the scheduler syncs first)."""
        group, rows = [], 0
        for r in [r for r in reqs if len(r.spec.parts) > 1] + [None]:
            n = 0 if r is None else len(r.spec.parts) - 1
            if group and (r is None or rows + n > max_rows):
                decode_draft(self.draft, catch_up_pending(group, self.runner.device), every_row_logits=False)
                for g in group:
                    g.spec.mtp_len, g.spec.parts = g.kv_len - 1, g.spec.parts[-1:]
                group, rows = [], 0
            if r is not None:
                group.append(r)
                rows += n

    def step(self, reqs, outputs, mem) -> None:
        """One speculative step for `reqs` (the scheduler's decode batch, each with `slots_per_req` KV slots
        free for it); accepted slots go to the requests through `mem` (the scheduler's RequestMemory), the
        emitted tokens to `outputs`. Synchronous: nothing is left to process later."""
        self.stats.record(self._step(reqs, outputs, mem))

    def _step(self, reqs, outputs, mem) -> list[int]:
        runner, pool = self.runner, self.runner.kv_pool
        b = len(reqs)
        draft_slots = pool.alloc(b * (self.steps - 1) * self.topk)  # scratch: back to the pool in this step
        verify_slots = pool.alloc(b * self.nodes)
        try:
            batch = StepBatch.build(reqs, draft_slots, verify_slots, self._index(b), self.steps, self.topk,
                                    runner.device)
            first = self._draft_extend(reqs, batch)
            tree = runner.share_sampled(draft_tree(self.draft, *first, batch, self.steps, self.topk, self.nodes))
            out, anc, host_depths = self._verify(batch, tree)
            accepted = self._accept(reqs, batch, tree, anc, host_depths, out.logits)
        except BaseException:
            pool.free(verify_slots)
            raise
        finally:
            pool.free(draft_slots)
        return commit_and_emit(reqs, batch, tree, accepted, verify_slots, out, mem, outputs, pool)

    def _index(self, b: int) -> StepIndex:
        """The index tensors of a b-request step (built once per batch size)."""
        if b not in self._indices:
            self._indices[b] = StepIndex.build(b, self.steps, self.topk, self.nodes, self.runner.device)
        return self._indices[b]

    def _draft_extend(self, reqs, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft KV for each request's pending positions; (logits, hidden) of its last one."""
        out = decode_draft(self.draft, batch.pending)
        for r in reqs:
            r.spec.mtp_len, r.spec.parts = r.kv_len, []
        last = batch.pending.last
        return out.logits[last], out.hidden[last]

    def _verify(self, batch: StepBatch, tree: torch.Tensor):
        """One target forward over every tree node (node j of request i: row i * N + j); (output, the nodes'
        ancestors [B, N, S + 1], the depths on the host). The depths are the step's one read of the tree:
        the batch's host sequence lengths need them (FlashInfer plans from them, the torch backend loops)."""
        runner, index = self.runner, batch.index
        tokens, parents, depths = tree
        host_depths = depths.tolist()
        anc = ancestors(parents, depths, index.node_ids, index.levels)
        b, n, width = anc.shape
        table = build_tree_table(runner.req_to_token.table, batch.node_rows, batch.node_kv,
                                 batch.verify_slots.gather(1, anc.view(b, -1)).view(b * n, width), max(batch.kv))
        host_seq = [m + d + 1 for m, ds in zip(batch.kv, host_depths) for d in ds]
        fb = tree_batch(tokens.reshape(-1), batch.node_kv + depths.view(-1), batch.verify_slots.view(-1),
                        host_seq, index.nodes, runner.max_model_len, max(batch.kv) + self.steps)
        return forward_tree(runner, fb, table), anc, host_depths

    def _accept(self, reqs, batch: StepBatch, tree: torch.Tensor, anc: torch.Tensor, host_depths: list[list[int]],
                logits: torch.Tensor) -> torch.Tensor:
        """[B, S + 3] on the device: per request (accepted path length, bonus token, path node indices, the last
        repeated), rank 0's under TP. Greedy requests all at once on the device; sampled ones walk their trees
        on the host."""
        tokens, parents, depths = tree
        b, n = tokens.shape
        argmax = logits.argmax(-1).view(b, n)
        live = batch.node_kv.view(b, n) + depths <= self.runner.max_model_len - 1
        ix = batch.index
        result = accept_greedy_batch(argmax, tokens, parents, depths, live, anc, ix.earlier, ix.is_root)
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if sampled:
            result = self._accept_sampled(reqs, sampled, tree, batch.kv, host_depths, logits, result)
        return self.runner.share_sampled(result)

    def _accept_sampled(self, reqs, sampled: list[int], tree: torch.Tensor, kv: list[int],
                        host_depths: list[list[int]], logits: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """`result` with the rows of the `sampled` requests replaced by tree speculative sampling (host walks)."""
        n, limit = self.nodes, self.runner.max_model_len
        tokens, parents = tree[0].tolist(), tree[1].tolist()
        rows = []
        for i in sampled:
            live = [kv[i] + d <= limit - 1 for d in host_depths[i]]
            req, lg = reqs[i], logits[i * n:(i + 1) * n]
            path, bonus = accept_sampled(lambda j, lg=lg, p=req.params: target_probs(lg[j], p), tokens[i],
                                         children_of(parents[i]), live, req.generator)
            rows += [len(path), bonus, *path] + path[-1:] * (self.steps + 1 - len(path))
        sel, vals = columns_to_device([sampled, rows], result.device)
        return result.index_copy(0, sel, vals.view(len(sampled), -1))
