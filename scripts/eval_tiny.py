"""Held-out numbers of a model with an MTP layer, measured through the engine itself.

    python scripts/eval_tiny.py [--model tiny-py] [--windows 64] [--seq-len 256]

Windows of the held-out stdlib files (scripts/tiny_corpus.py). Per window the engine's model runs
one extend over the window, then its MTP layer one draft-extend with row i = (token i+1, the main
model's hidden state at i), as speculative decoding feeds it. Reported: main next-token loss and
MTP loss (nats per byte), MTP top-1 / top-4 accuracy against the text, and how often the MTP's
top-1 equals the main model's own greedy prediction for the same position (the rate at which
greedy speculative decoding accepts a one-token draft).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script


def _forward(runner, mode, ids: list[int], spec_hidden=None, mtp: bool = False):
    from engine.forward_batch import ForwardBatch
    from engine.speculative.draft_runner import DraftRunner

    row = runner.req_to_token.alloc()
    slots = runner.kv_pool.alloc(len(ids))
    try:
        fb = ForwardBatch.build(mode, ids, [row], [0], [len(ids)], slots, list(range(len(ids))), runner.device)
        fb.spec_hidden = spec_hidden
        runner.req_to_token.set(row, 0, slots)
        return DraftRunner(runner).forward(fb) if mtp else runner.forward(fb)
    finally:
        runner.kv_pool.free(slots)
        runner.req_to_token.free(row)


@torch.no_grad()
def engine_metrics(engine, windows) -> dict:
    """The held-out numbers over windows [N, T+2] (token ids) for an `engine.engine.Engine`."""
    from engine.forward_batch import ForwardMode

    r = engine.runner
    if r.mtp is None:
        raise ValueError("the model has no MTP layer")
    sums = dict(main_loss=0.0, mtp_loss=0.0, mtp_top1=0.0, mtp_top4=0.0, mtp_agree_main=0.0)
    n = n_agree = 0
    for w in torch.as_tensor(windows).tolist():
        main = _forward(r, ForwardMode.EXTEND, w[:-2])
        tgt1, tgt2 = torch.tensor(w[1:-1]), torch.tensor(w[2:])
        draft = _forward(r, ForwardMode.DRAFT_EXTEND, w[1:-1], main.hidden, mtp=True)
        main_logits, mtp_logits = main.logits.float().cpu(), draft.logits.float().cpu()
        top4 = mtp_logits.topk(4, dim=-1).indices
        sums["main_loss"] += torch.nn.functional.cross_entropy(main_logits, tgt1, reduction="sum").item()
        sums["mtp_loss"] += torch.nn.functional.cross_entropy(mtp_logits, tgt2, reduction="sum").item()
        sums["mtp_top1"] += (top4[:, 0] == tgt2).sum().item()
        sums["mtp_top4"] += (top4 == tgt2[:, None]).any(-1).sum().item()
        sums["mtp_agree_main"] += (top4[:-1, 0] == main_logits[1:].argmax(-1)).sum().item()
        n += len(tgt1)
        n_agree += len(tgt1) - 1
    return {k: v / (n_agree if k == "mtp_agree_main" else n) for k, v in sums.items()}


def load_training_model(path: Path):
    """The checkpoint at path as a scripts/tiny_train_model.TinyDeepseek in float32, eval mode."""
    from safetensors.torch import load_file

    from engine.checkpoint.config import load_config
    from scripts.tiny_train_model import TinyDeepseek, load_hf_state_dict

    cfg = load_config(path)
    model = TinyDeepseek(cfg, cfg.max_position_embeddings)
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    load_hf_state_dict(model, sd)
    return model.eval()


@torch.no_grad()
def chain_acceptance(model, prompts: list[list[int]], new_tokens: int, steps: int) -> float:
    """Mean tokens per target step of greedy speculative decoding with a chain draft (top-1, `steps` MTP
    steps, each fed the previous MTP step's hidden state), by full recomputation: 1 + the number of
    leading draft tokens equal to the target's own greedy continuation, averaged over every decode
    position of each prompt's greedy continuation."""
    total = count = 0
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(new_tokens + steps):  # the target's greedy continuation (the reference)
            h = model.hidden(torch.tensor([seq]))
            seq.append(int(model.main_logits(h[:, -1:]).argmax(-1)))
        h = model.hidden(torch.tensor([seq]))[0]
        for n in range(len(prompt) - 1, len(prompt) - 1 + new_tokens):
            # x_{n+1} is the target's token; draft x_{n+2}.. from (x_{n+1}, h_n), then from the MTP's own states
            toks, hid = seq[1:n + 2], h[:n + 1]
            accepted = 0
            for k in range(steps):
                m = model.mtp_hidden(torch.tensor([toks]), hid[None])[0]
                d = int(model.mtp_logits(m[-1:]).argmax(-1))
                if d != seq[n + 2 + k]:
                    break
                accepted += 1
                toks, hid = toks + [d], torch.cat((hid, m[-1:]))
            total += 1 + accepted
            count += 1
    return total / count


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-py")
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--chain-steps", type=int, default=0,
                   help="also estimate greedy chain speculative decoding's tokens per step with this many MTP steps")
    p.add_argument("--chain-prompts", type=int, default=8)
    p.add_argument("--chain-tokens", type=int, default=48)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.engine import Engine
    from scripts.tiny_corpus import held_out_windows, split_files

    eng = Engine(model=args.model, device="cpu", dtype="float32")
    windows = held_out_windows(args.seq_len + 2, args.windows)
    out = {"model": args.model, "held_out_files": len(split_files()[1]), "windows": args.windows,
           "seq_len": args.seq_len, **engine_metrics(eng, windows)}
    if args.chain_steps:
        model = load_training_model(eng.runner.resolved.path)
        prompts = [w[:64] for w in held_out_windows(64, args.chain_prompts).tolist()]
        out[f"chain{args.chain_steps}_tokens_per_step"] = chain_acceptance(model, prompts, args.chain_tokens,
                                                                          args.chain_steps)
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
