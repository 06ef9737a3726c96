"""Train the `tiny-py` model (DeepSeek-V3 architecture, main model + MTP layer) on the Python stdlib's sources.

    python scripts/train_tiny.py --out DIR [--device cpu|cuda] [--steps N] [--threads N]

Writes DIR/ as a checkpoint the engine loads (`dsctl generate --model DIR -p "def "`): HF-layout
bf16 safetensors + index, config.json (engine/model_configs/tiny-py.json), the byte-level
tokenizer files, and training.json (the recipe, the wall time and the held-out numbers). The
shipped model engine/model_weights/tiny-py/ is this script's output at the default settings.

Corpus and split: scripts/tiny_corpus.py. Model and export: scripts/tiny_train_model.py. Loss:
next-token CE + MTP_WEIGHT x MTP CE (DeepSeek-V3's lambda = 0.3). The held-out numbers are
computed on the exported (bf16-rounded) weights.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from importlib import resources
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

from engine.checkpoint.config import parse_config  # noqa: E402
from scripts import tiny_corpus  # noqa: E402
from scripts.tiny_train_model import TinyDeepseek, hf_state_dict, load_hf_state_dict, update_router_bias  # noqa: E402

CONFIG_NAME = "tiny-py"
MTP_WEIGHT = 0.3
BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed (gamma)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="output checkpoint directory")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (bytes)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows for the final numbers")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


def config_dict() -> dict:
    return json.loads(resources.files("engine").joinpath("model_configs", f"{CONFIG_NAME}.json").read_text())


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def make_optimizer(model: TinyDeepseek, lr: float) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
def evaluate(model: TinyDeepseek, windows: torch.Tensor, batch: int = 16) -> dict:
    """Held-out numbers over windows [N, T+2]: main / MTP loss (nats per byte), MTP top-1 / top-4
    accuracy against the text, and how often the MTP's top-1 equals the main model's own greedy
    next-next token (what greedy speculative decoding accepts)."""
    model.eval()
    sums = {"main_loss": 0.0, "mtp_loss": 0.0, "mtp_top1": 0.0, "mtp_top4": 0.0, "mtp_agree_main": 0.0}
    n = n_agree = 0
    for i in range(0, len(windows), batch):
        tok = windows[i:i + batch]
        main_loss, mtp_loss, main, mtp = model(tok)
        k = tok[:, :-2].numel()
        target2 = tok[:, 2:]
        top4 = mtp.topk(4, dim=-1).indices
        sums["main_loss"] += main_loss.item() * k
        sums["mtp_loss"] += mtp_loss.item() * k
        sums["mtp_top1"] += (top4[..., 0] == target2).sum().item()
        sums["mtp_top4"] += (top4 == target2[..., None]).any(-1).sum().item()
        # the main model's prediction for position i+2 comes from its logits at i+1
        sums["mtp_agree_main"] += (top4[:, :-1, 0] == main[:, 1:].argmax(-1)).sum().item()
        n += k
        n_agree += k - len(tok)
    model.train()
    return {key: v / (n_agree if key == "mtp_agree_main" else n) for key, v in sums.items()}


def export(model: TinyDeepseek, out: Path, config: dict) -> None:
    from engine.checkpoint.tiny import write_checkpoint
    from engine.checkpoint.tiny_tokenizer import write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out, config, hf_state_dict(model), num_shards=1)
    write_tokenizer(out, parse_config(config), pad=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    torch.manual_seed(args.seed)
    config = config_dict()
    cfg = parse_config(config)
    t0 = time.time()
    train_files, held_files = tiny_corpus.split_files()
    stream = torch.from_numpy(tiny_corpus.encode_files(train_files))
    windows = torch.from_numpy(tiny_corpus.held_out_windows(args.seq_len + 2, args.eval_windows)).to(device)
    print(f"corpus {tiny_corpus.stdlib_dir()}: {len(train_files)} train files ({len(stream) / 1e6:.1f} M bytes), "
          f"{len(held_files)} held out", flush=True)
    model = TinyDeepseek(cfg, args.seq_len).to(device)
    model.set_dense_experts(device.type == "cuda")
    opt = make_optimizer(model, args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    offsets = torch.arange(args.seq_len + 2)
    for step in range(args.steps):
        starts = torch.randint(0, len(stream) - args.seq_len - 2, (args.batch,), generator=gen)
        tok = stream[starts[:, None] + offsets].to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        with amp:
            main_loss, mtp_loss, _, _ = model(tok)
            loss = main_loss + MTP_WEIGHT * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        update_router_bias(model, BIAS_RATE)
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:5d}  main {main_loss.item():.3f}  mtp {mtp_loss.item():.3f}  "
                  f"{time.time() - t0:.0f}s", flush=True)
    train_s = time.time() - t0
    export(model, args.out, config)
    # the final numbers: the exported bf16 weights, in float32
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(args.out.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    load_hf_state_dict(model, sd)
    model.set_dense_experts(False)
    metrics = evaluate(model.float(), windows)
    report = {
        "command": "python scripts/train_tiny.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "python": sys.version.split()[0],
        "train_files": len(train_files), "train_bytes": int(len(stream)), "held_out_files": len(held_files),
        "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr, "seed": args.seed,
        "mtp_weight": MTP_WEIGHT, "train_seconds": round(train_s, 1), "held_out": metrics,
        "uniform_loss": math.log(cfg.vocab_size), "wall_seconds": round(time.time() - t0, 1),
    }
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2), flush=True)
    return report


if __name__ == "__main__":
    main()
