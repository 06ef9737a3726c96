"""Where the draft comes from (the start-up checks are in launch_check.py).

The draft is an MTP/NextN layer: by default the target checkpoint's own; with --speculative-draft, the
MTP layer of a separate checkpoint (any checkpoint directory / alias in HF layout whose config has
num_nextn_predict_layers and whose weights ship that layer). Its KV cache is the pool's extra layer
after the target's decoder layers, so it must have the target's latent width, hidden size and
vocabulary. Every mismatch is a one-line UsageError at start-up, before the first request.
"""

from __future__ import annotations

from engine.errors import UsageError
from engine.model.builder import build_model
from engine.speculative.launch_check import check_draft_config, resolve_draft
from engine.weights.loader import has_mtp_layer


def attach_draft(runner, own_mtp):
    """The MTP layer that drafts for `runner` (its own, or --speculative-draft's), or a UsageError."""
    args = runner.args
    if args.speculative.speculative_draft is None:
        if own_mtp is None:
            raise UsageError(f"--speculative-algorithm {args.speculative.speculative_algorithm}: "
                             f"{args.model.model} has no MTP/NextN layer; give a draft with --speculative-draft")
        return own_mtp
    draft = resolve_draft(args)
    check_draft_config(draft.config, runner.resolved.config)
    ckpt = None if draft.dummy else draft.path
    if not has_mtp_layer(draft.config, ckpt):
        raise UsageError(f"--speculative-draft {args.speculative.speculative_draft}: its weights have no "
                         "MTP/NextN layer")
    _, mtp = build_model(draft.config, 1, runner.dtype, runner.device, runner.fp8_block, runner.parallel.tp,
                         checkpoint=ckpt, seed=args.model.seed, mtp=True, kernels=runner.kernels)
    mtp.layer.self_attn.layer_id = runner.num_layers  # the pool's layer after the target's decoder layers
    return mtp
