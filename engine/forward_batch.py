"""Forward-batch metadata: what one model forward computes and where its KV goes.

Tokens of all requests in a batch are packed into one flat sequence of length T.
Every mode shares this layout:

- EXTEND: prefill of new tokens on top of an (optionally cached) prefix.
- DECODE: one new token per request, attention over the latent cache (absorbed MLA).
- IDLE: no tokens (a data-parallel attention rank with no work still runs the
  collectives of the MoE layers).
- TARGET_VERIFY: score a block of draft tokens per request (an extend over the
  cached prefix, logits at every draft position).
- DRAFT_EXTEND: run the MTP/NextN layer over newly accepted tokens.
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass
from typing import Optional

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"
    IDLE = "idle"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    @property
    def is_extend_like(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token
    req_pool_indices: torch.Tensor  # [B] rows of the req->token table
    seq_lens: torch.Tensor  # [B] tokens in the cache after this forward (prefix + new)
    out_cache_loc: torch.Tensor  # [T] KV-pool slots the new tokens are written to
    extend_lens: torch.Tensor  # [B] new tokens per request (1 for decode)
    prefix_lens: torch.Tensor  # [B] tokens already cached before this forward
    logits_indices: torch.Tensor  # [N] which of the T tokens produce logits
    # Host copies for Python-side loops (reference backends) and planning.
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    # The MTP layer's input hidden states (DRAFT_EXTEND), one row per token.
    spec_hidden: Optional[torch.Tensor] = None
    # Host copy of req_pool_indices where the batch was built from host lists (extend planning reads it
    # instead of copying the device tensor back, which would wait for the forward in flight).
    req_rows_cpu: Optional[list[int]] = None
    # A padded static batch (a CUDA graph's): its rows before this one are real tokens, the rest padding
    # (None: every row is real).
    real_tokens: Optional[int] = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    def host_req_rows(self) -> list[int]:
        """req_pool_indices on the host: the host copy where the batch has one, else read back from the device
        (which waits for the queued work)."""
        return self.req_rows_cpu if self.req_rows_cpu is not None else self.req_pool_indices.tolist()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, mode: ForwardMode, input_ids: list[int], req_rows: list[int], prefix_lens: list[int],
              extend_lens: list[int], out_cache_loc: torch.Tensor, logits_indices: list[int],
              device: torch.device) -> "ForwardBatch":
        """Assemble a batch from host lists (positions follow from prefix and extend lengths).

        Costs O(batch) Python work plus C-speed copies of the token lists: a prefill of many long prompts
        packs tens of thousands of tokens per step."""
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        # Every host integer column in one non-blocking copy (columns_to_device): with overlap
        # scheduling this runs while the previous forward is still on the GPU.
        on_host = out_cache_loc.device.type == "cpu"
        packed = columns_to_device([_int64(input_ids), _positions(prefix_lens, extend_lens, len(input_ids)),
                                    req_rows, seq_lens, extend_lens, prefix_lens, logits_indices]
                                   + ([out_cache_loc] if on_host else []), device)
        ids, pos, rows, lens, ext, pre, logit_rows = packed[:7]
        loc = packed[7] if on_host else out_cache_loc.to(device=device, dtype=torch.int64)
        return cls(
            mode=mode, input_ids=ids, positions=pos, req_pool_indices=rows, seq_lens=lens, out_cache_loc=loc,
            extend_lens=ext, prefix_lens=pre, logits_indices=logit_rows,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(extend_lens),
            prefix_lens_cpu=list(prefix_lens),
            req_rows_cpu=list(req_rows),
        )


def to_device(values, device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor on `device` (`tensor_to_device`)."""
    return tensor_to_device(_int64(values), device)


def columns_to_device(columns: list, device: torch.device) -> list[torch.Tensor]:
    """Host int columns (lists of ints or CPU integer tensors) as int64 tensors on `device`, in one copy
    (`tensor_to_device` of their concatenation; the results are views of it)."""
    parts, flat = [], []
    for c in columns:
        if isinstance(c, torch.Tensor):
            if flat:
                parts.append(_int64(flat))
                flat = []
            parts.append(c.reshape(-1).to(torch.int64))
        else:
            flat += c
    if flat:
        parts.append(_int64(flat))
    packed = tensor_to_device(torch.cat(parts) if len(parts) > 1 else parts[0], device)
    return list(packed.split([c.numel() if isinstance(c, torch.Tensor) else len(c) for c in columns]))


def tensor_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device`. From the host to a GPU through pinned memory without blocking: a copy from
    pageable memory would first wait for all the work queued on the stream, so the host could not
    prepare the next forward while the GPU runs this one."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _int64(values) -> torch.Tensor:
    """Host ints as an int64 CPU tensor; long lists go through array('q'), several times faster than
    torch.tensor on a Python list."""
    if len(values) < 64:
        return torch.tensor(values, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _positions(prefix_lens: list[int], extend_lens: list[int], total: int) -> torch.Tensor:
    """Absolute position of every packed token: prefix_len + i for the i-th new token of its request."""
    if total == len(extend_lens) and max(extend_lens, default=1) == 1:  # one token per request: its prefix length
        return _int64(prefix_lens)
    ext = _int64(extend_lens)
    starts = torch.cumsum(ext, 0) - ext
    return torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(_int64(prefix_lens) - starts, ext,
                                                                            output_size=total)
