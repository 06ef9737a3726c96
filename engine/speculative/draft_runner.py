"""The draft's forwards: the MTP layer run on the ModelRunner's KV pool and forward context.

`DraftRunner` is the `draft` a ModelRunner is built with when speculative decoding is on (engine/engine.py):
the runner makes it once its model is built, keeps its MTP layer (draft_model.py `attach_draft`: the
checkpoint's own or --speculative-draft's) and captures its CUDA graphs right after the model's. Its
forwards (a draft-KV extend, eagerly; decode-mode batches, through its graphs when they hold them) go
through `ModelRunner.run_forward`, which agrees them with the other groups under DP attention; it also
tells the DP agreement how this rank runs an MTP forward it has no tokens for.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.distributed.dp_attention import MTP
from engine.distributed.dp_sync import IdleForward
from engine.forward_batch import ForwardBatch
from engine.runner.cuda_graph import CudaGraphRunner
from engine.runner.model_runner import ForwardOutput, ModelRunner
from engine.speculative.draft_model import attach_draft


class DraftRunner:
    def __init__(self, runner: ModelRunner):
        """The draft of `runner`, whose model is built (its KV pool and forward context come next)."""
        self.runner = runner
        self.layer = attach_draft(runner, runner.mtp)
        self.graphs: Optional[CudaGraphRunner] = None
        if runner.dp is not None:
            runner.dp.add_idle(MTP, IdleForward(self._idle_forward, self._replay_padding))

    def build_graphs(self, batch_sizes: list[int], capture: bool) -> None:
        """CUDA graphs of the MTP layer's decode forward at the model's graph sizes (ModelRunner.build_graph_runner)."""
        hidden = (self.runner.config.hidden_size, self.runner.dtype)
        self.graphs = self.runner.graph_runner(self._forward_eager, batch_sizes, capture, spec_hidden=hidden)

    def release(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ForwardOutput:
        """The MTP layer: a draft-KV extend (eager) or a decode-mode batch (its CUDA graph when one holds it)."""
        return self.runner.run_forward(MTP, fb, self.graphs, self._forward_eager)

    def _forward_eager(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.layer(fb, self.runner.forward_ctx)
        return self.layer.logits(hidden[fb.logits_indices]), hidden

    def _idle_forward(self) -> None:
        """DP attention: the MTP layer's gather / MLP / scatter with no tokens of this group's."""
        fb = self.runner.idle_batch()
        fb.spec_hidden = torch.empty(0, self.runner.config.hidden_size, dtype=self.runner.dtype,
                                     device=self.runner.device)
        self.runner.forward_ctx.begin_forward(fb)  # as every forward: no padding marks of an earlier one
        self.layer(fb, self.runner.forward_ctx)

    def _replay_padding(self, bs: int) -> None:
        self.graphs.replay_padding(bs)
