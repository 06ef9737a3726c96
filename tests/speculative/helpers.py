"""Shared set-up of the speculative-decoding tests: flags, prompts, KV accounting, an oracle draft."""

from __future__ import annotations

from contextlib import contextmanager

import torch

import engine.speculative.decoder as decoder_mod

# Radix cache on (shared prefixes below), small chunked prefill, overlap scheduler on: the setting.
FLAGS = dict(device="cpu", dtype="float32", chunked_prefill_size=16, max_prefill_tokens=48,
             max_running_requests=32, max_total_tokens=4096, attention_backend="torch", moe_backend="torch")
SPEC = dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=4,
            speculative_num_draft_tokens=8)


def prompts(vocab: int, n: int = 32, seed: int = 3) -> list[list[int]]:
    """n prompts: a third share a 20-token prefix, some repeat exactly, the rest are unrelated."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, min(vocab, 256), (20,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(3, min(vocab, 256), (1 + (5 * i) % 23,), generator=g).tolist()
        out.append(shared + tail if i % 3 == 0 else tail)
    out[-1] = list(out[0])
    return out


def check_pool(eng) -> None:
    """After a run: every KV slot is free or held by the radix cache, exactly once."""
    sched = eng.scheduler
    sched.flush()
    assert not sched.has_work()
    pool = eng.runner.kv_pool
    free = pool.free_slots()
    held = sched.cache.all_slots() if sched.cache else torch.empty(0, dtype=torch.int64)
    assert free.unique().numel() == free.numel(), "a slot was freed twice"
    assert pool.available() + sched.mem.cache_tokens() == pool.size
    assert torch.cat((free, held)).sort().values.tolist() == list(range(1, pool.size + 1))


@contextmanager
def oracle_draft(monkeypatch, eng, refs: dict[tuple, list[int]], corrupt_every: int = 3):
    """Replace the random MTP layer's guesses by the target's own greedy continuation (refs: prompt ->
    reference output), so that long runs get accepted; every `corrupt_every`-th step one chain token is
    wrong at depth 2, so rejections in the middle of a path happen too. Siblings keep the draft's tokens."""
    real = decoder_mod.draft_tree
    calls = [0]

    def fake(runner, first_logits, first_hidden, batch, steps, topk, n):
        packed = real(runner, first_logits, first_hidden, batch, steps, topk, n)
        calls[0] += 1
        by_row = {r.row: r for r in eng.scheduler.running}
        tokens, parents, depths = packed.tolist()
        vocab = first_logits.shape[-1]
        for i, row in enumerate(batch.rows):
            req = by_row[row]
            ref = refs[tuple(req.prompt_ids)]
            chain = ref[req.num_output:req.num_output + steps]
            chain += [(t * 7 + 1) % vocab for t in range(steps - len(chain))]
            if calls[0] % corrupt_every == 0 and steps >= 2:
                chain[1] = (chain[1] + 1) % vocab
            for j in range(1, n):
                if j <= steps:
                    tokens[i][j], parents[i][j], depths[i][j] = chain[j - 1], j - 1, j
                else:
                    p = (j - steps - 1) % steps  # siblings hang off the chain's nodes 0..steps-1
                    parents[i][j], depths[i][j] = p, p + 1
        return torch.tensor([tokens, parents, depths], dtype=packed.dtype, device=packed.device)

    monkeypatch.setattr(decoder_mod, "draft_tree", fake)
    yield calls
    monkeypatch.setattr(decoder_mod, "draft_tree", real)


def same_up_to_ties(got: list[list[int]], ref, tie: float = 0.3) -> int:
    """Greedy outputs on a GPU, where a verify forward batches other rows than a decode step and may round
    differently: each of `got` must equal its `ref` (GenerateOutputs with top_logprobs >= 2) or first leave
    it at a near-tie, where ref's two best log-probs are within `tie` (a fault leaves it at clear choices).
    The default allows for bf16 logits (the LM head's output): between 16 and 32 they step by 0.125, so
    one rounding difference in the last hidden state moves a gap by a step or two. Returns how many
    tokens are equal before any such flip."""
    same = 0
    for i, (g, r) in enumerate(zip(got, ref)):
        n = next((j for j, (a, b) in enumerate(zip(g, r.token_ids)) if a != b), None)
        if n is None:
            assert len(g) == len(r.token_ids), f"prompt {i}: {len(g)} tokens vs {len(r.token_ids)}"
            same += len(g)
            continue
        (_, best), (_, second) = r.top_logprobs[n][:2]
        assert best - second < tie, (f"prompt {i} leaves the reference at a clear choice: position {n}, "
                                     f"log-prob gap {best - second:.3f}: {g} vs {r.token_ids}")
        same += n
    return same
