"""Attention and MoE backends by name: one registry per kind, with start-up checks and factories.

Each backend registers a start-up check (raises `UsageError` saying why it cannot run in
this setup and what to use instead) and a factory. `resolve` turns a flag value into a
registered name ('auto' is decided by `default_backend`, here only) and runs the check;
`build` makes the backend object the runner puts into the `ForwardContext`.

  attention (--attention-backend): torch (reference), triton (kernels/mla_*), flashinfer;
                                   with --disable-mla (BackendSetup.expanded_kv) torch and triton
                                   build the non-absorbed backends of engine/model/attention_expanded.py
  moe (--moe-backend):             torch (reference), triton (kernels/fused_moe)

Factories import their modules lazily, so FlashInfer and the Triton kernels are only
imported when their backend is used. Attention factories take (setup, kv_pool,
req_to_token); MoE factories take (setup).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.config import ModelConfig
from engine.errors import UsageError
from engine.memory.pools import KVPool, ReqToTokenPool

AUTO = "auto"
TRITON_NEEDS_GPU = ("the Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 for slow CPU checks); "
                    "use --attention-backend torch --moe-backend torch on CPU")
TORCH_NO_GRAPHS = ("the torch reference backends loop over requests on the host and cannot be "
                   "captured in CUDA graphs: add --disable-cuda-graph, or use the triton backends")


@dataclass(frozen=True)
class BackendSetup:
    """Where the backends will run: what the start-up checks and the factories read."""

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype  # activations
    kv_dtype: torch.dtype  # the KV cache
    graph_batch_sizes: tuple[int, ...] = ()  # decode batch sizes captured in CUDA graphs (empty: eager)
    interpret: bool = False  # Triton runs its CPU interpreter (kernels/interpret.py)
    tp_size: int = 1  # tensor-parallel ranks: each rank's attention runs num_attention_heads / tp_size heads
    expanded_kv: bool = False  # --disable-mla: per-head K/V in the cache, no weight absorption

    @property
    def cuda_graphs(self) -> bool:
        return bool(self.graph_batch_sizes)

    @property
    def local_heads(self) -> int:
        """Attention heads of one TP rank (the head count the attention backends see)."""
        return self.config.num_attention_heads // self.tp_size


@dataclass(frozen=True)
class Backend:
    name: str
    check: Callable[[BackendSetup], None]
    build: Callable[..., object]


def default_backend(device: torch.device) -> str:
    """What 'auto' means: the Triton kernels on CUDA, the torch reference elsewhere."""
    return "triton" if device.type == "cuda" else "torch"


class BackendRegistry:
    """The backends of one kind ('attention' or 'moe'), chosen with --<kind>-backend."""

    def __init__(self, kind: str):
        self.kind = kind
        self.backends: dict[str, Backend] = {}

    @property
    def flag(self) -> str:
        return f"--{self.kind}-backend"

    def register(self, name: str, check: Callable[[BackendSetup], None], build: Callable[..., object]) -> None:
        if name == AUTO or name in self.backends:
            raise ValueError(f"{self.kind} backend name {name!r} is taken")
        self.backends[name] = Backend(name, check, build)

    def choices(self) -> list[str]:
        return [AUTO, *self.backends]

    def resolve(self, name: str, setup: BackendSetup) -> str:
        """The registered backend `name` stands for in this setup, after its start-up check."""
        if name == AUTO:
            name = default_backend(setup.device)
        if name not in self.backends:
            raise UsageError(f"{self.flag} {name}: no such backend; choose one of {', '.join(self.choices())}")
        self.backends[name].check(setup)
        return name

    def build(self, name: str, *args) -> object:
        """A new backend object (name: a resolved name)."""
        return self.backends[name].build(*args)


# ---- start-up checks -----------------------------------------------------------------------

def check_torch(setup: BackendSetup) -> None:
    if setup.device.type == "cuda" and setup.cuda_graphs:
        raise UsageError(TORCH_NO_GRAPHS)


def check_triton(setup: BackendSetup) -> None:
    if setup.device.type != "cuda" and not setup.interpret:
        raise UsageError(TRITON_NEEDS_GPU)


def check_flashinfer(setup: BackendSetup) -> None:
    from engine.model.attention_flashinfer import check_supported

    if setup.expanded_kv:
        raise UsageError("--disable-mla keeps expanded per-head K/V, which FlashInfer's MLA wrapper cannot read: "
                         "use --attention-backend triton or torch with it")

    cfg = setup.config
    check_supported(setup.device, setup.dtype, setup.kv_dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim)


# ---- factories -------------------------------------------------------------------------------

def torch_attention(setup: BackendSetup, kv_pool: KVPool, req_to_token: ReqToTokenPool):
    if setup.expanded_kv:
        from engine.model.attention_expanded import TorchExpandedAttention

        return TorchExpandedAttention()
    from engine.model.attention import TorchAttentionBackend

    return TorchAttentionBackend()


def triton_attention(setup: BackendSetup, kv_pool: KVPool, req_to_token: ReqToTokenPool):
    cfg = setup.config
    per_token = setup.local_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    if setup.expanded_kv:
        from engine.model.attention_expanded import TritonExpandedAttention

        return TritonExpandedAttention(per_token * setup.dtype.itemsize)
    from engine.model.attention_triton import TritonAttentionBackend

    return TritonAttentionBackend(per_token * setup.dtype.itemsize)


def flashinfer_attention(setup: BackendSetup, kv_pool: KVPool, req_to_token: ReqToTokenPool):
    from engine.model.attention_flashinfer import FlashInferAttentionBackend

    cfg = setup.config
    return FlashInferAttentionBackend(
        setup.local_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.softmax_scale, setup.dtype,
        kv_pool.dtype, kv_pool.scale, setup.device, req_to_token.table.shape[1],
        max_graph_bs=max(setup.graph_batch_sizes, default=0))


def torch_moe(setup: BackendSetup):
    from engine.model.moe import TorchMoEBackend

    return TorchMoEBackend()


def triton_moe(setup: BackendSetup):
    from engine.model.moe import TritonMoEBackend

    return TritonMoEBackend()


ATTENTION_BACKENDS = BackendRegistry("attention")
ATTENTION_BACKENDS.register("torch", check_torch, torch_attention)
ATTENTION_BACKENDS.register("triton", check_triton, triton_attention)
ATTENTION_BACKENDS.register("flashinfer", check_flashinfer, flashinfer_attention)

MOE_BACKENDS = BackendRegistry("moe")
MOE_BACKENDS.register("torch", check_torch, torch_moe)
MOE_BACKENDS.register("triton", check_triton, triton_moe)
