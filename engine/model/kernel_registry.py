"""The kernel registry: for every op the engine runs, its implementations by name, each with a start-up
check and a factory, and what 'auto' means for it.

  op          flag                  implementations
  attention   --attention-backend   torch (reference), triton (kernels/mla_*), flashinfer, flashinfer-decode
                                    (FlashInfer for decode steps, Triton for the rest; 'auto' on CUDA where
                                    `flashinfer_decode_blocker` finds nothing against it); with --disable-mla
                                    (KernelSetup.expanded_kv) torch and triton build the non-absorbed backends
                                    of engine/model/attention_expanded.py
  moe         --moe-backend         torch (reference), triton (kernels/fused_moe; W4AFP8 experts:
                                    kernels/fused_moe_w4a8, labelled "triton w4afp8")
  gemm        --gemm-backend        block-FP8 linear: cublas (Triton, cuBLASLt where the tuned config says
                                    CUBLAS), triton (Triton only), torch (dequantised reference)
  rms_norm    --rms-norm-backend    triton (kernels/rms_norm.py outside torch.compile), torch; a decoder layer's
                                    residual add runs in the norm after it (Kernels.add_rms_norm, and with
                                    norm_quant Kernels.add_norm_quant)
  norm_quant  --norm-quant-backend  an RMSNorm that feeds a block-FP8 GEMM fused with the GEMM's activation
                                    quantisation: triton (kernels/rms_norm_quant.py), torch (its reference),
                                    off (norm, then the GEMM quantises)
  act_quant   --act-quant-backend   SwiGLU's SiLU(gate) * up fused with the FP8 quantisation of the block-FP8 down
                                    GEMM after it: triton (kernels/silu_mul_quant.py), torch (its reference), off
  moe_gate    --moe-gate-backend    triton (kernels/moe_gate.py), torch
  rope_cache  --rope-cache-backend  MLA's latent RMSNorm, the rope of q_pe and k_pe and the KV-cache write:
                                    triton (one kernel, kernels/mla_rope_cache.py), torch (op by op)
  all_reduce  --all-reduce-backend  torch (torch.distributed: NCCL on CUDA, gloo on CPU), custom (peer-memory
                                    one-shot / two-shot kernels for small messages within a node, NCCL
                                    otherwise: engine/distributed/custom_all_reduce.py)
  shared_experts --shared-experts-backend  the MoE's shared experts: fused (inside the routed experts' launch, as
                                    extra experts every token takes with weight 1; engine/model/moe.py) or
                                    separate (their own MLP); 'auto' fuses on CUDA where the layout allows it
  moe_a2a     --moe-a2a-backend     none (EP by gather + all-reduce), torch (all-to-all through torch.distributed:
                                    engine/distributed/token_exchange.py). The flag is a layout flag
                                    (ParallelArgs: it also puts the shared experts whole on every rank), so it
                                    reaches the registry through the TP group: 'auto' = `TPGroup.moe_a2a`

`resolve_kernels` turns the requested names (KernelArgs.requested_kernels) into a `KernelChoice`:
'auto' is decided by `auto_name`, here only, and every chosen implementation's check raises
`UsageError` saying why it cannot run in this setup and what to use instead. `build_kernels` makes the
per-call ops' `Kernels` (engine/model/kernel_set.py) the model's modules are built with; the
attention and MoE backend objects are built with `OpRegistry.build` once the KV pool exists, for the
`ForwardContext`. `describe` is the start-up log line's list of what runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Optional

import torch

from engine.checkpoint.config import ModelConfig
from engine.distributed import comm
from engine.distributed.custom_all_reduce import AllReduceOp
from engine.distributed.groups import TPGroup
from engine.distributed.token_exchange import torch_all_to_all
from engine.errors import UsageError
from engine.memory.pools import KVPool, ReqToTokenPool
from engine.model import act_ops, fp8_ops, gate_ops, norm_ops, rope_cache_ops
from engine.model.attention import TorchAttentionBackend
from engine.model.attention_expanded import TorchExpandedAttention, TritonExpandedAttention
from engine.model.attention_flashinfer import FlashInferAttentionBackend, check_supported
from engine.model.attention_triton import TritonAttentionBackend
from engine.model.kernel_set import Kernels
from engine.model.moe import TorchMoEBackend, TritonMoEBackend, shared_fusion_blocker
from engine.model.prefill_attention import (
    FlashInferPrefill,
    TorchPrefill,
    TritonPrefill,
    flashinfer_prefill_unavailable,
)
from kernels.fp8 import cublas_unavailable_reason

AUTO = "auto"
TRITON_NEEDS_GPU = ("the Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 for slow CPU checks); "
                    "use {flag} torch on CPU")
TORCH_NO_GRAPHS = ("the torch reference backends loop over requests on the host and cannot be "
                   "captured in CUDA graphs: add --disable-cuda-graph, or use the triton backends")


@dataclass(frozen=True)
class KernelSetup:
    """Where the kernels will run: what the start-up checks, 'auto' and the factories read."""

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype  # activations
    kv_dtype: torch.dtype  # the KV cache
    graph_batch_sizes: tuple[int, ...] = ()  # decode batch sizes captured in CUDA graphs (empty: eager)
    interpret: bool = False  # Triton runs its CPU interpreter (kernels/interpret.py)
    tp_size: int = 1  # tensor-parallel ranks: each rank's attention runs num_attention_heads / tp_size heads
    expanded_kv: bool = False  # --disable-mla: per-head K/V in the cache, no weight absorption
    fp8_block: Optional[tuple[int, int]] = None  # the block of weights kept FP8 (None: no FP8 linear runs)
    group: Optional[TPGroup] = field(default=None, compare=False)  # the model's TP group (custom all-reduce)
    micro_batches: bool = False  # --enable-two-batch-overlap: each micro-batch plans its own attention

    @property
    def cuda_graphs(self) -> bool:
        return bool(self.graph_batch_sizes)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def local_heads(self) -> int:
        """Attention heads of one TP rank (the head count the attention backends see)."""
        return self.config.num_attention_heads // self.tp_size


@dataclass(frozen=True)
class Kernel:
    """One implementation of an op: its start-up check, its factory and what the log line calls it."""

    name: str
    check: Callable[[KernelSetup], None]
    build: Callable[..., object]
    label: Callable[[KernelSetup], str]


class OpRegistry:
    """The implementations of one op, chosen with --<op>-backend (where the op has that flag)."""

    def __init__(self, op: str):
        self.op = op
        self.kernels: dict[str, Kernel] = {}

    @property
    def flag(self) -> str:
        return f"--{self.op.replace('_', '-')}-backend"

    def register(self, name: str, check: Callable[[KernelSetup], None], build: Callable[..., object],
                 label: Optional[Callable[[KernelSetup], str]] = None) -> None:
        if name == AUTO or name in self.kernels:
            raise ValueError(f"{self.op} kernel name {name!r} is taken")
        self.kernels[name] = Kernel(name, check, build, label or (lambda setup: name))

    def choices(self) -> list[str]:
        return [AUTO, *self.kernels]

    def resolve(self, name: str, setup: KernelSetup) -> str:
        """The registered implementation `name` stands for in this setup, after its start-up check."""
        if name == AUTO:
            name = auto_name(self.op, setup)
        if name not in self.kernels:
            raise UsageError(f"{self.flag} {name}: no such backend; choose one of {', '.join(self.choices())}")
        self.kernels[name].check(setup)
        return name

    def build(self, name: str, *args) -> object:
        """The implementation `name` (a resolved name) makes: a backend object or a callable."""
        return self.kernels[name].build(*args)

    def label(self, name: str, setup: KernelSetup) -> str:
        return self.kernels[name].label(setup)


def auto_name(op: str, setup: KernelSetup) -> str:
    """What 'auto' means for each op: the Triton kernels on CUDA (the block-FP8 GEMM with cuBLASLt where it
    is available), the torch reference elsewhere; under the Triton interpreter the FP8 GEMM still runs
    Triton (the engine's CPU tests run it so); 'torch' for the GEMM of a model without FP8 weights (its
    linears are F.linear) and for the one all-reduce."""
    if op == "moe_a2a":
        return setup.group.moe_a2a if setup.group is not None else "none"
    if op == "all_reduce" or (op == "gemm" and setup.fp8_block is None):  # no FP8 weights: F.linear only
        return "torch"
    if op == "gemm" and setup.cuda:
        return "triton" if cublas_unavailable_reason(setup.device) else "cublas"
    if op == "gemm":
        return "triton" if setup.interpret else "torch"
    if op == "shared_experts":
        return "fused" if setup.cuda and shared_fusion_blocked(setup) is None else "separate"
    if op in ("norm_quant", "act_quant"):  # with the Triton FP8 GEMM (resolve_kernels: off with the torch GEMM)
        return "triton" if setup.fp8_block is not None and (setup.cuda or setup.interpret) else "off"
    if op == "attention" and setup.cuda and flashinfer_decode_blocker(setup) is None:
        return "flashinfer-decode"
    if op == "prefill_attention" and setup.cuda and flashinfer_prefill_auto_blocker(setup) is None:
        return "flashinfer"
    if op == "prefill_attention" and setup.interpret:
        return "triton"
    return "triton" if setup.cuda else "torch"


FLASHINFER_DECODE_MIN_HEADS = 32  # the fewest heads per rank FlashInfer's decode was measured faster at (docs/perf.md)


def flashinfer_decode_blocker(setup: KernelSetup) -> Optional[str]:
    """Why 'auto' keeps the Triton decode here instead of FlashInfer's (None: FlashInfer's is the faster one);
    whatever `check_flashinfer` refuses is a reason too, so 'auto' never picks a backend that cannot start.

    Measured (docs/perf.md, "MLA decode at 128 heads" and "at 32 and 64 heads"): over a bf16 cache FlashInfer's fa3
    MLA decode is 2-3x faster than the Triton kernel with 128 heads per rank (H100 and H200), 1.2-2.6x with 64 and
    1.1-1.4x with 32 (H200, batch 1-128, context 1k-16k; one case of 24 at 0.98x), within +-5% at 16 heads; it is
    slower over an FP8 cache (the Triton "fp8dot" kernel is 1.6x faster than fa3's FP8 path at 128 heads, H200).
    DP attention (a whole group's heads per rank) gives the tokens of one GPU with it (2 x H200)."""
    if setup.micro_batches:
        return "two-batch overlap (each micro-batch plans its own attention)"
    if setup.local_heads < FLASHINFER_DECODE_MIN_HEADS:
        return f"{setup.local_heads} heads per rank (FlashInfer measured faster from {FLASHINFER_DECODE_MIN_HEADS})"
    if setup.kv_dtype not in (torch.bfloat16, torch.float16):
        return "not a 16-bit KV cache"
    try:
        check_flashinfer(setup)
    except UsageError as why:
        return str(why)
    if torch.cuda.get_device_capability(setup.device) < (9, 0):
        return "not a Hopper GPU (measured there only)"
    return None


def prefill_head_dims(setup: KernelSetup) -> tuple[int, int]:
    """(qk, v) values per head of the expanded prefill attention."""
    cfg = setup.config
    return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim


def flashinfer_prefill_blocker(setup: KernelSetup) -> Optional[str]:
    """Why FlashInfer's prefill cannot run in this setup (None: it can)."""
    if setup.micro_batches:
        return "two-batch overlap (its micro-batches plan apart; FlashInfer's wrappers hold one forward's plan)"
    return flashinfer_prefill_unavailable(prefill_head_dims(setup), setup.dtype, setup.device)


def flashinfer_prefill_auto_blocker(setup: KernelSetup) -> Optional[str]:
    """Why 'auto' keeps the Triton extend kernel here (None: FlashInfer's prefill is the faster one). Measured
    (docs/perf.md, "extend against FlashInfer's prefill"): fa3 1.6-2.3x faster than the Triton kernel at 16 and
    128 heads from 1k new tokens (H200); on other GPUs FlashInfer would run its fa2 kernel, within -20% / +35%
    of Triton's, so 'auto' keeps Triton there."""
    if why := flashinfer_prefill_blocker(setup):
        return why
    if torch.cuda.get_device_capability(setup.device) < (9, 0):
        return "not a Hopper GPU (FlashInfer's fa3 prefill measured faster there only)"
    return None


# ---- start-up checks -----------------------------------------------------------------------

def no_check(setup: KernelSetup) -> None:
    pass


def check_torch_graphs(setup: KernelSetup) -> None:
    if setup.cuda and setup.cuda_graphs:
        raise UsageError(TORCH_NO_GRAPHS)


def check_triton(flag: str) -> Callable[[KernelSetup], None]:
    def check(setup: KernelSetup) -> None:
        if not setup.cuda and not setup.interpret:
            raise UsageError(TRITON_NEEDS_GPU.format(flag=flag))
    return check


def check_flashinfer(setup: KernelSetup) -> None:
    if setup.expanded_kv:
        raise UsageError("--disable-mla keeps expanded per-head K/V, which FlashInfer's MLA wrapper cannot read: "
                         "use --attention-backend triton or torch with it")
    cfg = setup.config
    check_supported(setup.device, setup.dtype, setup.kv_dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim)


def check_flashinfer_prefill(setup: KernelSetup) -> None:
    if why := flashinfer_prefill_blocker(setup):
        raise UsageError(f"--prefill-attention-backend flashinfer: {why}; use --prefill-attention-backend triton")


def check_token_exchange(setup: KernelSetup) -> None:
    group = setup.group
    if group is None or group.ep_size == 1 or not group.exchanges_tokens:
        raise UsageError("--moe-a2a-backend: the all-to-all exchange needs expert parallelism (--ep-size equal to "
                         "--tp, 2 or more) and the layout built for it; use --moe-a2a-backend none otherwise")


def shared_fusion_blocked(setup: KernelSetup) -> Optional[str]:
    return shared_fusion_blocker(setup.config, setup.group, setup.tp_size, setup.fp8_block)


def check_shared_fusion(setup: KernelSetup) -> None:
    if why := shared_fusion_blocked(setup):
        raise UsageError(f"--shared-experts-backend fused: {why}; use --shared-experts-backend separate (or auto)")


def check_cublas(setup: KernelSetup) -> None:
    why = cublas_unavailable_reason(setup.device)
    if why:
        raise UsageError(f"--gemm-backend cublas: {why}; use --gemm-backend triton (or torch)")


# ---- attention / MoE factories: backend objects for the ForwardContext -------------------------

# `prefill` is what the prefill_attention op built (PREFILL_ATTENTION.build): the expanded prefill the Triton
# backends run for extends.
def torch_attention(setup: KernelSetup, kv_pool: KVPool, req_to_token: ReqToTokenPool, prefill=None):
    return TorchExpandedAttention() if setup.expanded_kv else TorchAttentionBackend()


def triton_attention(setup: KernelSetup, kv_pool: KVPool, req_to_token: ReqToTokenPool, prefill=None):
    per_token = setup.local_heads * sum(prefill_head_dims(setup))
    backend = TritonExpandedAttention if setup.expanded_kv else TritonAttentionBackend
    return backend(per_token * setup.dtype.itemsize, prefill=prefill)


def flashinfer_attention(setup: KernelSetup, kv_pool: KVPool, req_to_token: ReqToTokenPool, prefill=None,
                         decode_only: bool = False):
    cfg = setup.config
    return FlashInferAttentionBackend(
        setup.local_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.softmax_scale, setup.dtype,
        kv_pool.dtype, kv_pool.scale, setup.device, req_to_token.table.shape[1],
        max_graph_bs=max(setup.graph_batch_sizes, default=0), decode_only=decode_only, prefill=prefill)


def flashinfer_decode_attention(setup: KernelSetup, kv_pool: KVPool, req_to_token: ReqToTokenPool, prefill=None):
    return flashinfer_attention(setup, kv_pool, req_to_token, prefill, decode_only=True)


def flashinfer_prefill(setup: KernelSetup) -> FlashInferPrefill:
    qk, v = prefill_head_dims(setup)
    return FlashInferPrefill(setup.local_heads, qk, v, setup.config.softmax_scale, setup.dtype, setup.device)


def returns(value: object) -> Callable[[KernelSetup], object]:
    """A factory of a per-call op: the function itself, whatever the setup."""
    return lambda setup: value


def process_group_backend(setup: KernelSetup) -> str:
    """What torch.distributed runs the collectives with (engine/distributed/groups.py)."""
    return "nccl" if setup.cuda else "gloo"


ATTENTION = OpRegistry("attention")
ATTENTION.register("torch", check_torch_graphs, torch_attention)
ATTENTION.register("triton", check_triton("--attention-backend"), triton_attention)
ATTENTION.register("flashinfer", check_flashinfer, flashinfer_attention)
ATTENTION.register("flashinfer-decode", check_flashinfer, flashinfer_decode_attention)
PREFILL_ATTENTION = OpRegistry("prefill_attention")
PREFILL_ATTENTION.register("torch", no_check, lambda setup: TorchPrefill())
PREFILL_ATTENTION.register("triton", check_triton("--prefill-attention-backend"), lambda setup: TritonPrefill())
PREFILL_ATTENTION.register("flashinfer", check_flashinfer_prefill, flashinfer_prefill)
PREFILL_USERS = ("triton", "flashinfer-decode")  # the attention backends whose extends run the prefill op

def moe_label(name: str) -> Callable[[KernelSetup], str]:
    """The MoE backend's name, with "w4afp8" when the routed experts are INT4 (their own kernel and reference)."""
    return lambda setup: f"{name} w4afp8" if setup.config.experts_int4_group else name


MOE = OpRegistry("moe")
MOE.register("torch", check_torch_graphs, lambda setup: TorchMoEBackend(), label=moe_label("torch"))
MOE.register("triton", check_triton("--moe-backend"), lambda setup: TritonMoEBackend(), label=moe_label("triton"))

GEMM = OpRegistry("gemm")
GEMM.register("torch", no_check, returns(fp8_ops.torch_linear))
GEMM.register("triton", check_triton("--gemm-backend"), returns(fp8_ops.triton_linear))
GEMM.register("cublas", check_cublas, returns(fp8_ops.cublas_linear), label=lambda setup: "triton+cublas")

RMS_NORM = OpRegistry("rms_norm")
RMS_NORM.register("torch", no_check, returns(norm_ops.torch_rms_norm))
RMS_NORM.register("triton", check_triton("--rms-norm-backend"), returns(norm_ops.triton_rms_norm))

NORM_QUANT = OpRegistry("norm_quant")
NORM_QUANT.register("off", no_check, returns(None), label=lambda setup: "off")
NORM_QUANT.register("torch", no_check, returns(norm_ops.torch_norm_quant))
NORM_QUANT.register("triton", check_triton("--norm-quant-backend"), returns(norm_ops.triton_norm_quant))
ACT_QUANT = OpRegistry("act_quant")
ACT_QUANT.register("off", no_check, returns(None), label=lambda setup: "off")
ACT_QUANT.register("torch", no_check, returns(act_ops.torch_act_quant))
ACT_QUANT.register("triton", check_triton("--act-quant-backend"), returns(act_ops.triton_act_quant))
ADD_NORM = {"torch": norm_ops.torch_add_rms_norm, "triton": norm_ops.triton_add_rms_norm}  # with rms_norm
ADD_NORM_QUANT = {"off": None, "torch": norm_ops.torch_add_norm_quant, "triton": norm_ops.triton_add_norm_quant}
GEMM_Q = {"torch": fp8_ops.torch_linear_q, "triton": fp8_ops.triton_linear_q, "cublas": fp8_ops.cublas_linear_q}

MOE_GATE = OpRegistry("moe_gate")
MOE_GATE.register("torch", no_check, returns(gate_ops.torch_gate))
MOE_GATE.register("triton", check_triton("--moe-gate-backend"), returns(gate_ops.triton_gate))

ALL_REDUCE = OpRegistry("all_reduce")
ALL_REDUCE.register("torch", no_check, returns(comm.all_reduce), label=process_group_backend)
ALL_REDUCE.register("custom", no_check, lambda setup: AllReduceOp.open(setup.group, setup.device),
                    label=lambda setup: "custom+nccl" if setup.cuda else "gloo (custom needs CUDA)")

ROPE_CACHE = OpRegistry("rope_cache")
ROPE_CACHE.register("torch", no_check, returns(None))
ROPE_CACHE.register("triton", check_triton("--rope-cache-backend"), returns(rope_cache_ops.triton_rope_cache))

SHARED_EXPERTS = OpRegistry("shared_experts")
SHARED_EXPERTS.register("separate", no_check, returns(False))
SHARED_EXPERTS.register("fused", check_shared_fusion, returns(True))

MOE_A2A = OpRegistry("moe_a2a")
MOE_A2A.register("none", no_check, returns(None))
MOE_A2A.register("torch", check_token_exchange, returns(torch_all_to_all), label=process_group_backend)

REGISTRIES: dict[str, OpRegistry] = {r.op: r for r in (ATTENTION, MOE, GEMM, RMS_NORM, MOE_GATE, ALL_REDUCE,
                                                        NORM_QUANT, ACT_QUANT, ROPE_CACHE, SHARED_EXPERTS, MOE_A2A,
                                                        PREFILL_ATTENTION)}


@dataclass(frozen=True)
class KernelChoice:
    """One name per op: what was asked for ('auto' allowed), or after `resolve_kernels`, what runs."""

    attention: str = AUTO
    moe: str = AUTO
    gemm: str = AUTO
    rms_norm: str = AUTO
    moe_gate: str = AUTO
    all_reduce: str = AUTO
    norm_quant: str = AUTO
    act_quant: str = AUTO
    rope_cache: str = AUTO
    shared_experts: str = AUTO
    moe_a2a: str = AUTO
    prefill_attention: str = AUTO

    def names(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def resolve_kernels(requested: dict[str, str], setup: KernelSetup) -> KernelChoice:
    """Each op's implementation ('auto' resolved; ops not in `requested` are 'auto') after its start-up
    check, which rejects what cannot run here."""
    asked = KernelChoice(**requested).names()
    chosen = {op: REGISTRIES[op].resolve(name, setup) for op, name in asked.items()}
    for fused in ("norm_quant", "act_quant"):
        if asked[fused] == AUTO and chosen["gemm"] == "torch":  # the exact product quantises nothing
            chosen[fused] = "off"
    if asked["prefill_attention"] == AUTO and chosen["attention"] == "torch":  # the reference all through
        chosen["prefill_attention"] = "torch"
    if asked["prefill_attention"] != AUTO and chosen["attention"] not in PREFILL_USERS:
        raise UsageError(f"--prefill-attention-backend {asked['prefill_attention']}: the expanded prefill runs "
                         f"under --attention-backend {' or '.join(PREFILL_USERS)}; --attention-backend "
                         f"{chosen['attention']} attends prefills its own way (drop --prefill-attention-backend)")
    return KernelChoice(**chosen)


def build_kernels(choice: KernelChoice, setup: KernelSetup) -> Kernels:
    """The per-call ops' callables of a resolved choice, for the model's modules."""
    return Kernels(gemm=GEMM.build(choice.gemm, setup), rms_norm=RMS_NORM.build(choice.rms_norm, setup),
                   moe_gate=MOE_GATE.build(choice.moe_gate, setup),
                   all_reduce=ALL_REDUCE.build(choice.all_reduce, setup),
                   norm_quant=NORM_QUANT.build(choice.norm_quant, setup),
                   act_quant=ACT_QUANT.build(choice.act_quant, setup),
                   gemm_q=GEMM_Q[choice.gemm] if (choice.norm_quant, choice.act_quant) != ("off", "off") else None,
                   moe_a2a=MOE_A2A.build(choice.moe_a2a, setup),
                   rope_cache=ROPE_CACHE.build(choice.rope_cache, setup),
                   add_rms_norm=ADD_NORM[choice.rms_norm], add_norm_quant=ADD_NORM_QUANT[choice.norm_quant],
                   shared_experts_fused=SHARED_EXPERTS.build(choice.shared_experts, setup))


def auto_kernels(setup: KernelSetup) -> Kernels:
    """The kernels 'auto' gives every per-call op in this setup."""
    return build_kernels(resolve_kernels({}, setup), setup)


def describe(choice: KernelChoice, setup: KernelSetup) -> str:
    """'attention triton, moe triton, gemm triton+cublas, ...': what runs for each op."""
    return ", ".join(f"{op} {REGISTRIES[op].label(name, setup)}" for op, name in choice.names().items())
