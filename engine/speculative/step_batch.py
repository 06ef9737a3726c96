"""The device-side inputs of one speculative step, copied from the host at once, and the index tensors that
depend only on the batch size and the tree shape.

`StepBatch.build` packs every host column a step needs (each request's table row, kv_len and root token,
per verify node and per frontier node too; the draft extend's pending positions and the rows of their
target hidden states; the scratch slots of the draft and of the verified nodes) into one int64 host
tensor and copies it with one `columns_to_device` (pinned and non-blocking on a GPU), instead of one copy
per column and forward. `StepIndex` holds the aranges, ones and constant index maps of the step's batches,
built once per batch size (the SpecDecoder caches them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import columns_to_device


@dataclass(frozen=True)
class RowIndex:
    """The per-row constants of an R-row decode batch: rows 0..R-1 (scratch-table rows, logits rows) and
    ones (one new token per row)."""
    rows: torch.Tensor
    ones: torch.Tensor

    @classmethod
    def of(cls, r: int, device: torch.device) -> "RowIndex":
        return cls(torch.arange(r, device=device), torch.ones(r, dtype=torch.int64, device=device))


@dataclass(frozen=True)
class StepIndex:
    """Index tensors of a step over B requests (N nodes, K frontier nodes, S draft steps), on the device.
    Draft candidates are numbered as `draft._select` takes them: 0 the root, then K of step 1, K^2 per step."""
    nodes: RowIndex  # the verify batch's B x N rows
    frontier: RowIndex  # a draft step's B x K rows
    node_ids: torch.Tensor  # [B, N]: 0..N-1 per request
    levels: torch.Tensor  # [S + 1]: 0..S (depths)
    earlier: torch.Tensor  # [N, N] bool: [i, j] = i < j
    is_root: torch.Tensor  # [B, N] bool: node 0
    node_base: torch.Tensor  # [B, 1]: b x N (request b's first verify row)
    frontier_base: torch.Tensor  # [B, 1]: b x K (request b's first row in a draft step)
    frontier_req: torch.Tensor  # [B x K]: the request of each draft-step row
    first_ids: torch.Tensor  # [B, K]: 1..K, the candidate numbers of step 1's frontier
    child_of: torch.Tensor  # [B, K^2]: the frontier row (0..K-1) that proposed each of a step's children
    cand_depth: torch.Tensor  # [B, 1 + K + (S - 1) K^2]: each candidate's depth
    cand_first: torch.Tensor  # [B, 1 + K]: parents of the root (-1) and of step 1's candidates (0, the root)
    unselected: torch.Tensor  # [B, 1 + candidates]: -1 (`_select`'s parent -> node map, before it is filled)
    root_score: torch.Tensor  # [B, 1]: +inf, the root's score (selected first)

    @classmethod
    def build(cls, b: int, steps: int, topk: int, nodes: int, device: torch.device) -> "StepIndex":
        def t(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)

        k = topk
        ids, req = list(range(nodes)), list(range(b))
        depth = [0] + [1] * k + [d for d in range(2, steps + 1) for _ in range(k * k)]
        return cls(
            RowIndex.of(b * nodes, device), RowIndex.of(b * k, device), t([ids] * b), t(list(range(steps + 1))),
            t([[i < j for j in ids] for i in ids], torch.bool), t([[j == 0 for j in ids]] * b, torch.bool),
            t([[i * nodes] for i in req]), t([[i * k] for i in req]), t([i for i in req for _ in range(k)]),
            t([list(range(1, k + 1))] * b), t([[c // k for c in range(k * k)]] * b), t([depth] * b),
            t([[-1] + [0] * k] * b), t([[-1] * (len(depth) + 1)] * b),
            t([[float("inf")]] * b, torch.float32))


@dataclass(frozen=True)
class Pending:
    """The draft extend's rows, one per pending position (a request's positions mtp_len..kv_len - 1), on the
    device: token (the one after the position), position (= prefix length), table row, the target's hidden
    state there."""
    ids: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    hidden: torch.Tensor
    index: RowIndex
    last: torch.Tensor  # [B]: each request's last row (its first draft step)
    host_seq_lens: list[int]
    host_rows: list[int]  # `rows` on the host


@dataclass(frozen=True)
class StepBatch:
    rows: list[int]  # host: request-table rows
    kv: list[int]  # host: kv_len per request (the root sits at position kv)
    roots: torch.Tensor  # [B]: each request's last token
    node_rows: torch.Tensor  # [B x N]: the table row of each verify node's request
    node_kv: torch.Tensor  # [B x N]: its kv_len
    frontier_rows: torch.Tensor  # [B x K]: the same per draft-step row
    frontier_kv: torch.Tensor  # [B x K]
    draft_slots: torch.Tensor  # [B, S - 1, K]: scratch slots of the frontier nodes' draft KV
    verify_slots: torch.Tensor  # [B, N]: one fresh slot per verified node
    pending: Pending
    index: StepIndex

    @classmethod
    def build(cls, reqs, draft_slots: torch.Tensor, verify_slots: torch.Tensor, index: StepIndex, steps: int,
              topk: int, device: torch.device) -> "StepBatch":
        """reqs: the step's requests (Request.spec: their draft-KV progress and pending hidden rows); *_slots:
        host tensors from the pool. One host-to-device copy, then one gather of the pending hidden rows."""
        b, n = len(reqs), verify_slots.numel() // max(len(reqs), 1)
        rows, kv = [r.row for r in reqs], [r.kv_len for r in reqs]
        ids, pos, prow, last, source, hidden_rows = _pending_columns(reqs, kv)
        t = len(pos)
        cols = columns_to_device([[r.token_ids[-1] for r in reqs], _each(rows, n), _each(kv, n), _each(rows, topk),
                                  _each(kv, topk), last, ids, pos, prow, [1] * t, list(range(t)), hidden_rows,
                                  draft_slots, verify_slots], device)
        pending = Pending(cols[6], cols[7], cols[8], source[cols[11]], RowIndex(cols[10], cols[9]), cols[5],
                          [p + 1 for p in pos], prow)
        return cls(rows, kv, cols[0], cols[1], cols[2], cols[3], cols[4], cols[12].view(b, steps - 1, topk),
                   cols[13].view(b, n), pending, index)


def catch_up_pending(reqs, device: torch.device) -> Pending:
    """The draft extend's rows for every pending position of `reqs` but each one's last (SpecDecoder.catch_up,
    after plain decode steps); `last` and the host lengths as in a step's Pending."""
    ids, pos, prow, last, source, hidden_rows = _pending_columns(reqs, [r.kv_len - 1 for r in reqs])
    t = len(pos)
    cols = columns_to_device([ids, pos, prow, [1] * t, list(range(t)), hidden_rows, last], device)
    return Pending(cols[0], cols[1], cols[2], source[cols[5]], RowIndex(cols[4], cols[3]), cols[6],
                   [p + 1 for p in pos], prow)


def _pending_columns(reqs, ends: list[int]) -> tuple:
    """Host columns of the draft extend's rows, one per pending position mtp_len..end - 1 of each request:
    the token after it, its position, its table row, each request's last row; and the source tensor and rows
    of their target hidden states (`_hidden_source`)."""
    ids, pos, prow, last, parts = [], [], [], [], []
    for r, k in zip(reqs, ends):
        m = r.spec.mtp_len
        ids += r.token_ids[m + 1:k + 1]
        pos += range(m, k)
        prow += [r.row] * (k - m)
        last.append(len(pos) - 1)
        parts.append(r.spec.parts[:k - m])
    return (ids, pos, prow, last, *_hidden_source(parts))


def _each(values: list[int], times: int) -> list[int]:
    return [v for v in values for _ in range(times)]


def _hidden_source(parts_per_req: list[list]) -> tuple[torch.Tensor, list[int]]:
    """The requests' pending target hidden states (SpecState.parts: rows of tensors that several requests
    share: the last commit's gather, a prefill's last rows, one per plain decode step) as rows of one tensor:
    their distinct tensors concatenated (usually just one), and the row of each pending position in it, in
    batch order."""
    offsets: dict[int, int] = {}
    tensors, rows, total = [], [], 0
    for parts in parts_per_req:
        for h, row in parts:
            if id(h) not in offsets:
                offsets[id(h)] = total
                tensors.append(h)
                total += h.shape[0]
            rows.append(offsets[id(h)] + row)
    return (tensors[0] if len(tensors) == 1 else torch.cat(tensors)), rows
