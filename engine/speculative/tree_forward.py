"""Tree forwards: a decode-mode batch whose row i attends to the KV slots of row i of a `TreeTable`
(tree_table.py: one KV index list per draft-tree node), of the model (verify) or of the draft (draft steps).

The lists go to the request table's scratch rows (reserved when the CUDA graphs are built), so the
decode CUDA graphs run the batch; when they do not fit there, it runs eagerly with the tree table in place
of the request table (under DP attention, agreed with the other groups as an eager forward).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from engine.distributed.dp_attention import MTP, TARGET
from engine.forward_batch import ForwardBatch
from engine.runner.model_runner import ForwardOutput, ModelRunner
from engine.speculative.draft_runner import DraftRunner
from engine.speculative.tree_table import TreeTable


@torch.inference_mode()
def forward_tree(runner: ModelRunner, fb: ForwardBatch, table: TreeTable,
                 draft: Optional[DraftRunner] = None) -> ForwardOutput:
    """The model's (or, with `draft`, the draft's) forward of tree batch `fb` over `table`."""
    rows = runner.req_to_token.write_scratch(table.table)
    if rows is not None:
        first = runner.req_to_token.first_scratch
        fb = replace(fb, req_pool_indices=rows, req_rows_cpu=list(range(first, first + rows.numel())))
        return draft.forward(fb) if draft is not None else runner.forward(fb)
    if runner.dp is not None:
        runner.dp.before_forward(MTP if draft is not None else TARGET, fb.num_tokens)
    if draft is None:
        runner.count_forward("eager")
    ctx = replace(runner.forward_ctx, req_to_token=table)
    ctx.begin_forward(fb)
    if draft is not None:
        hidden = draft.layer(fb, ctx)
        return ForwardOutput(logits=draft.layer.logits(hidden[fb.logits_indices]), hidden=hidden)
    hidden = runner.model.hidden_states(fb, ctx)
    return ForwardOutput(logits=runner.model.logits(hidden[fb.logits_indices]), hidden=hidden)
