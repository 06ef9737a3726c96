"""Where the draft comes from, and the start-up checks of speculative decoding.

The draft is an MTP/NextN layer: by default the target checkpoint's own; with --speculative-draft, the
MTP layer of a separate checkpoint (any checkpoint directory / alias in HF layout whose config has
num_nextn_predict_layers and whose weights ship that layer). Its KV cache is the pool's extra layer
after the target's decoder layers, so it must have the target's latent width, hidden size and
vocabulary. Every mismatch is a one-line UsageError at start-up, before the first request.
"""

from __future__ import annotations

from engine.args import EngineArgs, ModelArgs
from engine.checkpoint.resolve import resolve_model
from engine.errors import UsageError
from engine.model.builder import build_model, has_mtp_layer


def check_spec_launch(args: EngineArgs, resolved) -> None:
    """Reject, before any weight is read, speculative decoding this launch cannot run."""
    spec = args.speculative
    if not spec.enabled:
        return
    if spec.speculative_draft is None:
        if not has_mtp_layer(resolved.config, None if resolved.dummy else resolved.path):
            raise UsageError(f"--speculative-algorithm {spec.speculative_algorithm}: {args.model.model} has no "
                             "MTP/NextN layer; give a draft with --speculative-draft")
    else:
        check_draft_config(resolve_draft(args).config, resolved.config)


def resolve_draft(args: EngineArgs):
    return resolve_model(ModelArgs(model=args.speculative.speculative_draft, load_format=args.model.load_format,
                                   revision=None))


def check_draft_config(draft, target) -> None:
    """The draft's MTP layer must read the target's hidden states and KV layout and share its vocabulary."""
    if not draft.num_nextn_predict_layers:
        raise UsageError("--speculative-draft: that checkpoint has no MTP/NextN layer (num_nextn_predict_layers "
                         "is 0)")
    if draft.vocab_size != target.vocab_size:
        raise UsageError(f"--speculative-draft: its vocabulary has {draft.vocab_size} tokens, the target's "
                         f"{target.vocab_size}; a draft must share the target's tokenizer")
    for name in ("hidden_size", "kv_lora_rank", "qk_rope_head_dim"):
        a, b = getattr(draft, name), getattr(target, name)
        if a != b:
            raise UsageError(f"--speculative-draft: its {name} is {a}, the target's {b}; the draft's MTP layer "
                             "reads the target's hidden states and shares its KV pool")


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
