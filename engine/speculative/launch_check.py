"""The start-up checks of speculative decoding: before any weight is read, whether the target (or the
--speculative-draft checkpoint) has an MTP/NextN layer that can draft for it. Every mismatch is a
one-line UsageError. Light on purpose: the launch checks run it in the serving process, which builds
no model."""

from __future__ import annotations

from engine.args import EngineArgs, ModelArgs
from engine.checkpoint.resolve import resolve_model
from engine.errors import UsageError
from engine.weights.loader import has_mtp_layer


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
