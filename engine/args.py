"""Every engine flag, defined once, grouped by the layer that reads it.

Each group is a plain dataclass whose fields carry their CLI metadata (help text,
allowed values, aliases): `ModelArgs` (what to load and how), `CacheArgs` (the KV
pool and the prefix cache), `SchedulerArgs` (what runs each step), `KernelArgs`
(kernel choices per op, CUDA graphs, torch.compile, tuned configs),
`ParallelArgs` (one process per GPU: TP, DP attention, EP, multi-node), `SpeculativeArgs` (NextN /
MTP speculative decoding) and `ServerArgs` (HTTP). `EngineArgs` holds one
of each; a layer receives only its group (the scheduler gets `args.scheduler`, the
server `args.server`, ...).

`dsctl` builds its command-line options and `--help` panels from these fields
(`dsctl/flags.py`); nothing else parses flags. `EngineArgs.of(**flat)` and
`args.replace(**flat)` take flag names (`tp_size=2`) and route each to its group.
`validate()` rejects bad values and combinations with a message that says why and what
to use instead.

This module must stay importable without torch so that `dsctl --help` is fast.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.distributed.parallel_config import ParallelConfig
from engine.errors import UsageError

# Environment variable an operator may set instead of --kernel-config-dir (read here, once).
KERNEL_CONFIG_DIR_ENV = "DSCTL_KERNEL_CONFIG_DIR"
# Environment variable an operator may set instead of --api-key (not visible in the process list; read here).
API_KEY_ENV = "DSCTL_API_KEY"
PIECEWISE_DEFAULT_MAX_TOKENS = 8192  # the piecewise CUDA graphs' largest default token bucket


def flag(default: Any, help: str, choices: tuple | None = None, aliases: tuple = ()) -> Any:
    """A dataclass field carrying its CLI metadata."""
    meta = {"help": help, "choices": choices, "aliases": aliases}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def cli_name(field_name: str) -> str:
    return field_name.replace("_", "-")


def _check_choices(group: Any) -> None:
    for f in dataclasses.fields(group):
        choices = f.metadata.get("choices")
        value = getattr(group, f.name)
        if choices and value is not None and value not in choices:
            raise UsageError(f"--{cli_name(f.name)} must be one of {', '.join(choices)} (got {value!r})")


@dataclass
class ModelArgs:
    """What to load, in which dtype, on which device."""

    model: str = flag(
        "tiny-py",
        "Model: a registry alias (see `dsctl models`), a local checkpoint directory, "
        "or a hub repo id already in the local cache. Default: tiny-py, a small model trained on "
        "Python's own sources that runs anywhere (tiny: the same architecture with random weights).",
    )
    revision: Optional[str] = flag(None, "Hub revision (branch, tag or commit) when MODEL is a repo id.")
    load_format: str = flag(
        "auto",
        "How to get weights: 'safetensors' from the checkpoint, 'dummy' for random weights "
        "of the real shapes (no download), 'auto' = safetensors.",
        choices=("auto", "safetensors", "dummy"),
    )
    num_layers: Optional[int] = flag(
        None,
        "Override num_hidden_layers (keeps the first N layers), e.g. 5 to fit a truncated "
        "DeepSeek-V3 on one GPU with --load-format dummy.",
    )
    dtype: str = flag(
        "auto",
        "Activation/weight dtype: 'auto' = bfloat16 on CUDA, float32 on CPU.",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str = flag("auto", "Device: 'auto' = cuda when available, else cpu.", choices=("auto", "cpu", "cuda"))
    quantization: Optional[str] = flag(
        None,
        "Weight quantisation. Default: whatever the checkpoint ships (FP8 block for V3/R1). "
        "'none' dequantises an FP8 checkpoint to --dtype. 'w4afp8': INT4 routed experts (groups of 128 "
        "along K) with FP8 activations, quantised at load from the FP8 (or bf16) checkpoint, or read from a "
        "W4AFP8 checkpoint; the other linears stay as the checkpoint ships them.",
        choices=("none", "fp8", "w4afp8"),
    )
    seed: int = flag(0, "Seed for dummy weights and for sampling when a request gives none.")
    max_model_len: Optional[int] = flag(
        None, "Context length limit (prompt + output). Default: the model's max_position_embeddings."
    )

    def validate(self) -> None:
        _check_choices(self)
        if self.num_layers is not None and self.num_layers < 1:
            raise UsageError(f"--num-layers must be >= 1 (got {self.num_layers})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise UsageError(f"--max-model-len must be >= 2 (got {self.max_model_len})")
        if self.device == "cpu" and self.dtype == "float16":
            raise UsageError("--dtype float16 is not supported on CPU; use float32 or bfloat16")


@dataclass
class CacheArgs:
    """The KV pool (size, dtype, memory share) and the radix prefix cache."""

    max_total_tokens: Optional[int] = flag(
        None, "Size of the KV cache pool in tokens. Default: 32768 on CPU; what --mem-fraction-static leaves "
        "after the weights on CUDA.",
    )
    kv_cache_dtype: str = flag(
        "auto", "KV cache dtype: 'auto' = the model dtype; 'fp8_e4m3' / 'fp8_e5m2' halve the latent cache's "
        "bytes (e4m3: more mantissa, the usual choice; e5m2: more range).",
        choices=("auto", "fp8_e4m3", "fp8_e5m2"),
    )
    mem_fraction_static: float = flag(
        0.85, "Fraction of GPU memory for weights + KV cache (the rest: activations, CUDA graphs).",
    )
    min_kv_tokens: int = flag(
        4096, "Smallest useful KV pool, in tokens per DP group: start-up (and serve --dry-run) refuses a layout "
        "whose pool is smaller, naming the flags that would give more (docs/memory_plan.md).",
    )
    gpu_memory_gb: Optional[float] = flag(
        None, "With serve --dry-run: the GPU memory to plan for, in GB (10^9 bytes, a card's total as CUDA "
        "reports it: 85.0 for an H100 80GB, 150.0 for an H200 141GB). Default: this machine's GPU, its free memory.",
    )
    disable_radix_cache: bool = flag(
        False, "Turn off the radix prefix cache (prompt prefixes shared between requests, or turns of a "
        "conversation, are then recomputed every time).",
    )

    def validate(self) -> None:
        _check_choices(self)
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise UsageError(f"--max-total-tokens must be >= 1 (got {self.max_total_tokens})")
        if not 0 < self.mem_fraction_static < 1:
            raise UsageError(f"--mem-fraction-static must be in (0, 1) (got {self.mem_fraction_static})")
        if self.min_kv_tokens < 1:
            raise UsageError(f"--min-kv-tokens must be >= 1 (got {self.min_kv_tokens})")
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise UsageError(f"--gpu-memory-gb must be a positive size in GB (got {self.gpu_memory_gb})")


@dataclass
class SchedulerArgs:
    """What runs each step: batch limits, chunked prefill, queue order, overlap."""

    max_running_requests: int = flag(256, "Most requests in the running batch at once.")
    max_prefill_tokens: int = flag(
        16384, "Most new prompt tokens computed in one prefill step; a longer prompt is still admitted "
        "(alone, or in chunks). Under DP attention the groups share it (each group's step takes 1 / --dp of it: "
        "the MoE layers run every group's tokens at once).",
    )
    chunked_prefill_size: int = flag(
        8192, "Prefill long prompts in chunks of at most this many tokens per step, the running requests "
        "decoding alongside (mixed batches: their tokens count in it) or in between (-1 disables chunking). "
        "Under DP attention the groups share it, as --max-prefill-tokens.",
    )
    schedule_policy: str = flag(
        "fcfs", "Order of waiting requests: 'fcfs' (arrival order) or 'lpm' (longest cached prefix first; "
        "needs the radix cache).", choices=("fcfs", "lpm"),
    )
    disable_overlap_schedule: bool = flag(
        False, "Process each step's results before launching the next forward (by default the host work of "
        "step N overlaps the device work of step N+1).",
    )
    enable_mixed_chunk: bool = flag(
        True, "Mixed batches: while a prompt is prefilled, the running requests decode their next token in the "
        "same forward (one token each, counted in --chunked-prefill-size / --max-prefill-tokens) instead of "
        "in a decode step of their own between prefill steps (--no-enable-mixed-chunk: alternate them).",
    )

    itl_target_ms: float = flag(
        0.0, "While requests decode, cap each prefill step's prompt tokens so that the gap a stream sees (the "
        "mixed step, or the prefill step plus its own decode step) stays within this many ms, predicted from "
        "the measured step times (0, the default: 3x the recent decode step; -1: no cap, only "
        "--chunked-prefill-size). Needs chunking.",
    )
    prefill_burst: bool = flag(
        True, "When more waiting requests could start now than are decoding (a burst of arrivals), prefill them "
        "at the full step budget back to back before the running requests' next token (at most 32 steps, then "
        "as many steps for the decodes), instead of capped by --itl-target-ms: a running stream then waits once "
        "for the burst, not once per capped step (--no-prefill-burst: the cap holds in bursts too).",
    )
    min_prefill_tokens: int = flag(
        512, "The smallest prefill step the --itl-target-ms cap allows, so prompts progress under any decode "
        "load.",
    )

    def step_budget(self, groups: int = 1) -> int:
        """Most tokens one prefill step computes: --max-prefill-tokens, and --chunked-prefill-size when chunking.
        Under DP attention the `groups` share it (each group's step takes its share): the MoE layers run every
        group's tokens at once, so a step's activations are those of one budget, as without DP attention."""
        chunk = self.chunked_prefill_size
        budget = min(self.max_prefill_tokens, chunk) if chunk is not None and chunk > 0 else self.max_prefill_tokens
        return max(1, budget // groups)

    def validate(self) -> None:
        _check_choices(self)
        if self.max_running_requests < 1:
            raise UsageError(f"--max-running-requests must be >= 1 (got {self.max_running_requests})")
        if self.max_prefill_tokens < 1:
            raise UsageError(f"--max-prefill-tokens must be >= 1 (got {self.max_prefill_tokens})")
        if self.min_prefill_tokens < 1:
            raise UsageError(f"--min-prefill-tokens must be >= 1 (got {self.min_prefill_tokens})")
        if self.chunked_prefill_size is not None and (self.chunked_prefill_size == 0
                                                      or self.chunked_prefill_size < -1):
            raise UsageError("--chunked-prefill-size must be a positive number of tokens, or -1 to disable "
                             f"chunking (got {self.chunked_prefill_size})")


@dataclass
class KernelArgs:
    """Kernel choices per op (attention, MoE, FP8 GEMM, RMSNorm, MoE gate), CUDA graphs, torch.compile and tuned
    kernel configs."""

    attention_backend: str = flag(
        "auto", "MLA attention kernels: 'triton' (kernels/mla_*.py), 'torch' (reference; CPU default), "
        "'flashinfer' (FlashInfer's MLA wrapper for prefill and decode; needs `pip install flashinfer-python`, "
        "bfloat16/float16 and a bf16 or fp8_e4m3 KV cache), 'flashinfer-decode' (FlashInfer for decode steps, "
        "triton for prefill / extend / speculative verification). 'auto': flashinfer-decode where FlashInfer is "
        "installed on a Hopper GPU and one GPU attends with all 128 heads over a 16-bit KV cache (its decode "
        "kernel 2-3x triton's there, docs/perf.md; DP attention: ask for it, not yet run on GPUs); triton "
        "elsewhere on CUDA.",
        choices=("auto", "triton", "torch", "flashinfer", "flashinfer-decode"),
    )
    enable_flashinfer_mla: bool = flag(False, "Same as --attention-backend flashinfer (SGLang's flag name).")
    prefill_attention_backend: str = flag(
        "auto", "The prefill (extend) attention of --attention-backend triton and flashinfer-decode, over per-head "
        "keys and values expanded from the latent (also --disable-mla's triton backend): 'triton' "
        "(kernels/mla_extend.py), 'flashinfer' (FlashInfer's batch prefill; needs `pip install flashinfer-python` "
        "and bfloat16/float16; extends of fewer than 512 new tokens still run triton), 'torch' (reference). "
        "'auto': flashinfer where FlashInfer is installed on a Hopper GPU (its fa3 kernel 1.6-2.3x triton's from "
        "1k tokens, docs/perf.md), triton elsewhere on CUDA.",
        choices=("auto", "triton", "torch", "flashinfer"),
    )
    disable_mla: bool = flag(
        False, "Attention without MLA weight absorption (for ablations): the KV cache keeps every head's "
        "expanded key and value (heads x (qk + v) values per token instead of the latent), so it holds far "
        "fewer tokens. torch and triton attention backends (not flashinfer).",
    )
    moe_backend: str = flag(
        "auto", "MoE expert kernels: 'triton' fused MoE (CUDA default) or 'torch' (reference; CPU default).",
        choices=("auto", "triton", "torch"),
    )
    gemm_backend: str = flag(
        "auto", "Block-FP8 linear layers (FP8 weights on CUDA): 'cublas' (the Triton GEMM, cuBLASLt's block-scaled "
        "FP8 GEMM where the tuned config says CUBLAS; CUDA default where cuBLASLt has it), 'triton' (Triton only), "
        "'torch' (dequantised reference).",
        choices=("auto", "cublas", "triton", "torch"),
    )
    rms_norm_backend: str = flag(
        "auto", "RMSNorm: 'triton' kernel (CUDA default; torch under torch.compile) or 'torch' (CPU default).",
        choices=("auto", "triton", "torch"),
    )
    norm_quant_backend: str = flag(
        "auto", "An RMSNorm that feeds a block-FP8 GEMM (FP8 weights): 'triton' fuses it with the GEMM's FP8 "
        "activation quantisation in one kernel (CUDA default), 'torch' (its reference), 'off' (norm, then the "
        "GEMM quantises; the default elsewhere and with --gemm-backend torch).",
        choices=("auto", "triton", "torch", "off"),
    )
    act_quant_backend: str = flag(
        "auto", "SwiGLU's SiLU(gate) * up before a block-FP8 down projection (dense MLPs, shared experts; FP8 "
        "weights): 'triton' fuses it with the GEMM's FP8 activation quantisation in one kernel (CUDA default), "
        "'torch' (its reference), 'off' (the torch form, then the GEMM quantises; the default elsewhere and with "
        "--gemm-backend torch).",
        choices=("auto", "triton", "torch", "off"),
    )
    moe_gate_backend: str = flag(
        "auto", "MoE router top-k: 'triton' fused gate (CUDA default) or 'torch' (reference; CPU default).",
        choices=("auto", "triton", "torch"),
    )
    rope_cache_backend: str = flag(
        "auto", "MLA's latent RMSNorm, the rotary embedding of the query's and key's rope parts and the KV-cache "
        "write: 'triton' in one kernel (CUDA default) or 'torch' (op by op, about thirty launches per layer; the "
        "reference, CPU default).",
        choices=("auto", "triton", "torch"),
    )
    shared_experts_backend: str = flag(
        "auto", "The MoE layers' shared experts: 'fused' runs them inside the routed experts' fused-MoE launch, as "
        "extra experts every token takes with weight 1 (CUDA default where the layout allows it: not with "
        "--ep-size, W4AFP8 experts, or a TP share of the expert width that is not whole 128-row FP8 blocks), "
        "'separate' as their own MLP (two GEMMs, the activation and an add).",
        choices=("auto", "fused", "separate"),
    )
    all_reduce_backend: str = flag(
        "auto", "Tensor-parallel all-reduce: 'torch' (torch.distributed: NCCL on CUDA, gloo on CPU; the default) "
        "or 'custom' (GPUs of one node with P2P: one-shot / two-shot kernels over peer memory for small messages, "
        "NCCL for large ones; falls back to 'torch' where P2P or 2/4/6/8 GPUs on one node are missing).",
        choices=("auto", "torch", "custom"),
    )
    pdl: str = flag(
        "auto", "Programmatic dependent launch of the decode step's Triton kernels: each may start while the "
        "kernel before it finishes, its programs waiting for that kernel's results before touching memory, which "
        "hides launch latency between the small kernels of a small batch. 'auto': on for CUDA GPUs of compute "
        "capability 9.0+ (Hopper) with a Triton that has it; 'on' refuses to start where it cannot run.",
        choices=("auto", "on", "off"),
    )
    disable_cuda_graph: bool = flag(False, "Run decode eagerly instead of replaying CUDA graphs.")
    cuda_graph_max_bs: Optional[int] = flag(
        None, "Largest decode batch captured in a CUDA graph (default: --max-running-requests, so that every "
        "decode batch replays a graph; a larger batch would run eagerly, several times slower).",
    )
    cuda_graph_bs: Optional[str] = flag(
        None, "Comma-separated decode batch sizes to capture (default: 1,2,4,8, steps of 8 up to 128, then steps of "
        "16 up to --cuda-graph-max-bs, which is itself captured). Batches are padded to the nearest captured "
        "size.",
    )
    piecewise_cuda_graph_max_tokens: Optional[int] = flag(
        None, "Extend (prefill and mixed prefill + decode) steps of up to this many tokens replay piecewise CUDA "
        "graphs: every layer's work but attention captured per token bucket, attention run eagerly between "
        "them (default: the prefill step budget, --chunked-prefill-size, at most 8192; 0: extend steps run "
        "eagerly); so do decode batches larger than the largest decode graph. Under DP attention every group "
        "replays the same bucket. Not with --disable-mla or --enable-two-batch-overlap.",
    )
    skip_compile_wait: bool = flag(
        False, "Report ready while the prefill steps' Triton kernels still compile in the background (on a "
        "cold Triton cache the first requests may then wait for a compile; by default start-up waits).",
    )
    enable_torch_compile: bool = flag(
        False, "torch.compile the captured decode paths (set TORCHINDUCTOR_CACHE_DIR to reuse compiles "
        "across restarts).",
    )
    torch_compile_max_bs: int = flag(32, "Largest decode batch that uses the torch.compile'd path.")
    triton_compile_workers: Optional[int] = flag(
        None, "Processes that compile Triton kernels in parallel on a start whose Triton cache lacks them: "
        "the decode path's before CUDA-graph capture, prefill steps' in the background (default: this rank's "
        "share of the node's CPUs; 0: compile each one in-process on first use).",
    )
    kernel_config_dir: Optional[str] = flag(
        None, "Directory of tuned kernel configs (from dsctl tune-moe / tune-fp8), searched before the shipped "
        f"ones (default: ${KERNEL_CONFIG_DIR_ENV}).",
    )

    @property
    def attention(self) -> str:
        """The attention backend asked for, with SGLang's --enable-flashinfer-mla folded in."""
        return "flashinfer" if self.enable_flashinfer_mla else self.attention_backend

    def requested_kernels(self) -> dict[str, str]:
        """The implementation asked for per op ('auto' or a name), keyed as engine/model/kernel_registry.py's ops."""
        return {"attention": self.attention, "moe": self.moe_backend, "gemm": self.gemm_backend,
                "rms_norm": self.rms_norm_backend, "moe_gate": self.moe_gate_backend,
                "norm_quant": self.norm_quant_backend, "act_quant": self.act_quant_backend,
                "all_reduce": self.all_reduce_backend, "rope_cache": self.rope_cache_backend,
                "shared_experts": self.shared_experts_backend, "prefill_attention": self.prefill_attention_backend}

    def config_dir(self) -> Optional[str]:
        """--kernel-config-dir, else $DSCTL_KERNEL_CONFIG_DIR, else None (the shipped configs only)."""
        return self.kernel_config_dir or os.environ.get(KERNEL_CONFIG_DIR_ENV) or None

    def validate(self) -> None:
        _check_choices(self)
        if self.kernel_config_dir is not None and not os.path.isdir(os.path.expanduser(self.kernel_config_dir)):
            raise UsageError(f"--kernel-config-dir {self.kernel_config_dir}: no such directory")
        if self.enable_flashinfer_mla and self.attention_backend not in ("auto", "flashinfer"):
            raise UsageError(f"--enable-flashinfer-mla selects the flashinfer attention backend, which contradicts "
                             f"--attention-backend {self.attention_backend}: give only one of them")
        if self.disable_mla and self.attention.startswith("flashinfer"):
            raise UsageError("--disable-mla keeps expanded per-head K/V, which FlashInfer's MLA wrapper cannot "
                             "read: use --attention-backend triton or torch with it")
        if self.piecewise_cuda_graph_max_tokens is not None and self.piecewise_cuda_graph_max_tokens < 0:
            raise UsageError("--piecewise-cuda-graph-max-tokens must be >= 0 (0: extend steps run eagerly; got "
                             f"{self.piecewise_cuda_graph_max_tokens})")
        if (self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1) or self.torch_compile_max_bs < 1:
            raise UsageError("--cuda-graph-max-bs and --torch-compile-max-bs must be >= 1")
        if self.triton_compile_workers is not None and self.triton_compile_workers < 0:
            raise UsageError("--triton-compile-workers must be >= 0 (0 compiles during capture)")
        if self.cuda_graph_bs is not None:
            sizes = self.cuda_graph_batch_sizes()
            if not sizes or min(sizes) < 1:
                raise UsageError(f"--cuda-graph-bs must list positive batch sizes (got {self.cuda_graph_bs!r})")
        if self.enable_torch_compile and self.disable_cuda_graph:
            raise UsageError("--enable-torch-compile compiles the CUDA-graph decode path; "
                             "it cannot be combined with --disable-cuda-graph")

    def cuda_graph_batch_sizes(self, default_max_bs: int = 256) -> list[int]:
        """The decode batch sizes to capture, ascending; default_max_bs stands for an unset
        --cuda-graph-max-bs (the engine passes --max-running-requests)."""
        if self.cuda_graph_bs:
            try:
                return sorted({int(x) for x in self.cuda_graph_bs.replace(" ", "").split(",") if x})
            except ValueError:
                raise UsageError(f"--cuda-graph-bs must be comma-separated integers "
                                 f"(got {self.cuda_graph_bs!r})") from None
        max_bs = self.cuda_graph_max_bs or default_max_bs
        # above 128 rows a padded row costs little of a step, and each size is a capture at start-up
        sizes = [1, 2, 4] + list(range(8, 129, 8)) + list(range(144, max_bs + 1, 16))
        return sorted({b for b in sizes if b < max_bs} | {max_bs})


@dataclass
class ParallelArgs:
    """One process per GPU rank: tensor parallel and multi-node (SGLang's flag names)."""

    tp_size: int = flag(1, "Tensor-parallel size: GPU ranks that split every layer (heads, MLP/MoE intermediate, "
                           "vocab).", aliases=("--tp",))
    dp_size: int = flag(1, "Data-parallel attention groups (with --enable-dp-attention; must divide --tp; default "
                           "--tp). Each group of --tp / --dp ranks runs attention TP-split on its own requests.",
                        aliases=("--dp",))
    enable_dp_attention: bool = flag(
        False, "DP attention: each DP rank keeps its own KV cache and batch; MoE layers gather every rank's tokens "
        "(or exchange them by all-to-all: --moe-a2a-backend).",
    )
    load_balance_method: Optional[str] = flag(
        None, "DP attention: how new requests are spread over the DP groups: 'total_tokens' (the default: the "
        "group with the least KV held + queued, counting prompt + max_new_tokens of what was sent since its last "
        "report), 'shortest_queue' (the fewest running + waiting requests) or 'round_robin'.",
        choices=("total_tokens", "shortest_queue", "round_robin"),
    )
    ep_size: int = flag(1, "Expert-parallel size: ranks that split the routed experts (must equal --tp).",
                        aliases=("--ep",))
    enable_ep_moe: bool = flag(False, "Expert parallel MoE over all TP ranks (same as --ep-size equal to --tp).")
    moe_a2a_backend: str = flag(
        "none", "Expert parallel token exchange: 'none' (every rank sees every token: gathered before each MoE "
        "layer, partial outputs all-reduced) or 'torch' (all-to-all through torch.distributed, NCCL / gloo: each "
        "token goes only to the ranks of its experts and back; shared experts whole on every rank). Needs "
        "--ep-size equal to --tp.",
        choices=("none", "torch"),
    )
    expert_placement: Optional[str] = flag(
        None, "Expert parallel: a placement file (written by dsctl place-experts from a server's routing counts) "
        "giving each MoE layer's expert slots per EP rank, redundant copies of hot experts included. Needs --ep-size "
        "equal to --tp.",
    )
    record_expert_load: bool = flag(
        False, "Count the tokens each MoE layer routes to each expert (on the GPU, inside CUDA graphs; a few small "
        "kernels per MoE layer and step): /metrics shows each EP rank's expert load, GET /expert_load the counts "
        "per layer and expert (what dsctl place-experts reads).",
    )
    enable_two_batch_overlap: bool = flag(
        False, "Two-batch overlap: run each large enough forward as two micro-batches, so that one's collectives "
        "(DP attention's gather, the MoE's all-reduce or all-to-all) run while the other computes. Each "
        "micro-batch reads the weights again: it pays at large batches on several GPUs (docs/parallelism.md).",
    )
    two_batch_overlap_min_tokens: int = flag(
        1024, "Two-batch overlap: the fewest tokens (over every DP group) a forward must hold to be split (decode "
        "batches below it: splitting one reads the weights twice, 1.2-1.6x its step on 2 x H200, docs/perf.md).",
    )
    nnodes: int = flag(1, "Nodes in the job; node 0 serves HTTP, the others run engine ranks only.")
    node_rank: int = flag(0, "This node's index, 0..--nnodes-1.")
    dist_init_addr: Optional[str] = flag(
        None, "HOST:PORT of node 0's rendezvous, the same on every node (needed with --nnodes > 1).",
    )
    base_gpu_id: int = flag(0, "First GPU index this node uses (ranks take GPUs base..base+ranks-1).")
    dist_timeout: float = flag(
        600.0, "Seconds before a stuck collective or rendezvous fails (a dead rank ends the server within it).",
    )

    def config(self) -> ParallelConfig:
        """The ParallelConfig these flags describe: --enable-ep-moe means ep = tp, and --dp defaults to --tp
        under DP attention (the one place that default is computed)."""
        ep = self.tp_size if self.enable_ep_moe and self.ep_size == 1 else self.ep_size
        dp = self.tp_size if self.enable_dp_attention and self.dp_size == 1 else self.dp_size
        return ParallelConfig(tp_size=self.tp_size, dp_size=dp, enable_dp_attention=self.enable_dp_attention,
                              ep_size=ep, moe_a2a_backend=self.moe_a2a_backend, nnodes=self.nnodes,
                              node_rank=self.node_rank, dist_init_addr=self.dist_init_addr, base_gpu_id=self.base_gpu_id,
                              dist_timeout=self.dist_timeout)

    def validate(self, device: str = "auto") -> None:
        _check_choices(self)
        self.config().validate(device_type="cuda" if device == "cuda" else "cpu")
        if self.enable_two_batch_overlap and self.tp_size == 1:
            raise UsageError("--enable-two-batch-overlap hides the collectives between GPUs behind compute, and "
                             "--tp 1 has none: drop it, or use --tp 2 or more")
        if self.two_batch_overlap_min_tokens < 2:
            raise UsageError(f"--two-batch-overlap-min-tokens must be >= 2 (got {self.two_batch_overlap_min_tokens}): "
                             "a split forward has a token in each micro-batch")
        if self.expert_placement is not None and self.config().ep_size <= 1:
            raise UsageError("--expert-placement places experts over expert-parallel ranks: add --ep-size equal to "
                             "--tp (or --enable-ep-moe), or drop it")
        if self.load_balance_method is not None and not self.enable_dp_attention:
            raise UsageError(f"--load-balance-method {self.load_balance_method} spreads requests over DP attention "
                             "groups: add --enable-dp-attention --dp N, or drop it")


@dataclass
class SpeculativeArgs:
    """NextN (MTP) speculative decoding, EAGLE-2 style (engine/speculative/, docs/speculative.md)."""

    speculative_algorithm: Optional[str] = flag(
        None, "Speculative decoding: 'NEXTN' (or 'EAGLE', the same here) drafts a token tree with the "
        "checkpoint's MTP/NextN layer and verifies it in one target forward. Off by default.",
        choices=("NEXTN", "EAGLE"), aliases=("--speculative-algo",),
    )
    speculative_draft: Optional[str] = flag(
        None, "A separate NextN draft checkpoint (directory, registry alias or cached hub id) whose MTP layer "
        "drafts (default: the target checkpoint's own MTP layer).",
        aliases=("--speculative-draft-model-path",),
    )
    # Defaults for batch 1: decode there is memory-bound, so verifying 8 tree nodes costs about what one
    # token does; 3 draft steps x top-4 gives the EAGLE-2 re-ranking enough candidates (4 + 2 x 16) to
    # fill 8 nodes with the likeliest paths (the acceptance setting, SGLang's DeepSeek example).
    speculative_num_steps: int = flag(3, "Draft steps: the deepest tree path (tokens gained per step: at most "
                                         "this + 1).")
    speculative_eagle_topk: int = flag(4, "Candidates kept per draft step and per expanded node.")
    speculative_num_draft_tokens: int = flag(
        8, "Tree nodes verified per request and step, the last accepted token included (at most "
        "1 + steps x topk).",
    )
    speculative_disable_by_batch_size: Optional[int] = flag(
        None, "Decode steps of this many requests or more run without speculation (at large batches a verify "
        "forward is compute-bound and costs more than the drafts gain); the draft layer's KV keeps up in "
        "batched catch-up forwards. Off by default: every decode step speculates.",
    )

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm is not None

    def validate(self) -> None:
        if self.speculative_algorithm is not None:
            self.speculative_algorithm = self.speculative_algorithm.upper()
        _check_choices(self)
        if not self.enabled:
            for name, value in (("--speculative-draft", self.speculative_draft),
                                ("--speculative-disable-by-batch-size", self.speculative_disable_by_batch_size)):
                if value is not None:
                    raise UsageError(f"{name} needs --speculative-algorithm NEXTN")
            return
        if self.speculative_disable_by_batch_size is not None and self.speculative_disable_by_batch_size < 1:
            raise UsageError(f"--speculative-disable-by-batch-size must be >= 1 "
                             f"(got {self.speculative_disable_by_batch_size})")
        s, k, n = self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens
        if s < 1 or k < 1:
            raise UsageError(f"--speculative-num-steps and --speculative-eagle-topk must be >= 1 (got {s}, {k})")
        if n < 2:
            raise UsageError(f"--speculative-num-draft-tokens must be >= 2: the last accepted token and at least "
                             f"one draft (got {n})")
        if n > 1 + s * k:
            raise UsageError(f"--speculative-num-draft-tokens {n} is more than the tree can hold: at most 1 + "
                             f"--speculative-num-steps x --speculative-eagle-topk = {1 + s * k}; lower it or raise "
                             "the steps / topk")


@dataclass
class ServerArgs:
    """The HTTP front end of `dsctl serve`."""

    host: str = flag("127.0.0.1", "Address to listen on (0.0.0.0 for every interface).")
    port: int = flag(30000, "TCP port to listen on.")
    api_key: Optional[str] = flag(
        None, "Require 'Authorization: Bearer KEY' on every route (/health without it says only ok / not ready). "
        "Default: $DSCTL_API_KEY, which keeps the key out of the process list.",
    )
    served_model_name: Optional[str] = flag(
        None, "Model name reported by /v1/models and expected in requests (default: --model).",
    )
    max_queued_requests: int = flag(
        1024, "Most sequences waiting for a place in the running batch; beyond it requests get 503 with "
        "Retry-After (0: unbounded).",
    )
    max_body_bytes: int = flag(
        8 * 2 ** 20, "Largest request body in bytes, checked while it is read; larger ones get 413 (0: no limit).",
    )
    max_json_depth: int = flag(64, "Deepest JSON nesting a request body may have; deeper ones get 400 (0: no limit).")
    max_sequences_per_request: int = flag(
        512, "Most sequences (prompts x n, or x best_of when larger) one request may ask for; more get 400 "
        "(0: no limit).",
    )
    max_request_prompt_tokens: int = flag(
        262144, "Most prompt tokens one request may carry over all its prompts; more get 400 (0: no limit).",
    )
    reasoning_parser: Optional[str] = flag(
        None, "Move the model's <think>...</think> section into reasoning_content (chat completions). "
        "deepseek-v3.1: only for requests that turn thinking on (chat_template_kwargs: {\"thinking\": true}).",
        choices=("deepseek-r1", "deepseek-v3.1"),
    )
    tool_call_parser: Optional[str] = flag(
        None, "The format the model writes tool calls in (chat completions with tools): deepseek-v3 (V3, R1 and "
        "their 0324 / 0528 updates) or deepseek-v3.1 (V3.1, V3.1-Terminus). Default: read from the chat template.",
        choices=("deepseek-v3", "deepseek-v3.1"),
    )
    graceful_shutdown_timeout: float = flag(
        10.0, "Seconds in-flight requests get to finish after SIGTERM / Ctrl-C; the rest then end with "
        "finish_reason abort (a second signal ends them at once).",
    )
    log_level: str = flag("info", "Server log level.", choices=("debug", "info", "warning", "error"))
    profile_dir: Optional[str] = flag(
        None, "Where POST /start_profile and POST /stop_profile write torch.profiler traces (one Chrome trace "
        "per rank, with its collectives' time and how much of it was exposed); unset: those routes answer 404.",
    )
    dry_run: bool = flag(
        False, "Print the memory plan (weights, KV pool, context limit per GPU and DP group) and exit, reading no "
        "weight and needing no GPU (--gpu-memory-gb): exit 0 when it fits, 2 with the reason and the fixes.",
    )

    def validate(self) -> None:
        _check_choices(self)
        if not 1 <= self.port <= 65535:
            raise UsageError(f"--port must be in 1..65535 (got {self.port})")
        for name in ("max_queued_requests", "max_body_bytes", "max_json_depth", "max_sequences_per_request",
                     "max_request_prompt_tokens"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{cli_name(name)} must be >= 0, 0 for no limit (got {getattr(self, name)})")
        if self.graceful_shutdown_timeout < 0:
            raise UsageError(f"--graceful-shutdown-timeout must be >= 0 (got {self.graceful_shutdown_timeout})")
        for name, value in (("--api-key", self.api_key), ("--served-model-name", self.served_model_name)):
            if value is not None and not value.strip():
                raise UsageError(f"{name} must not be empty")

    def key(self) -> Optional[str]:
        """--api-key, else $DSCTL_API_KEY, else None (no key: every route is open)."""
        return self.api_key or os.environ.get(API_KEY_ENV) or None


# Group attribute of EngineArgs -> (its dataclass, the --help panel its flags appear in), in CLI order.
GROUPS: dict[str, tuple[type, str]] = {
    "model": (ModelArgs, "Model options"),
    "cache": (CacheArgs, "KV cache options"),
    "scheduler": (SchedulerArgs, "Scheduling options"),
    "kernels": (KernelArgs, "Kernel and GPU options"),
    "parallel": (ParallelArgs, "Parallelism options"),
    "speculative": (SpeculativeArgs, "Speculative decoding options"),
    "server": (ServerArgs, "Server options"),
}
_GROUP_OF = {f.name: g for g, (cls, _) in GROUPS.items() for f in dataclasses.fields(cls)}


def group_of(flag_name: str) -> str:
    """The group a flag (field name, e.g. "tp_size") belongs to."""
    if flag_name not in _GROUP_OF:
        raise TypeError(f"unknown engine flag {flag_name!r}")
    return _GROUP_OF[flag_name]


def fields_in_groups(groups: tuple[str, ...]) -> list[tuple[str, dataclasses.Field]]:
    """(group, field) for every flag of `groups`, in GROUPS order."""
    return [(g, f) for g, (cls, _) in GROUPS.items() if g in groups for f in dataclasses.fields(cls)]


@dataclass
class EngineArgs:
    model: ModelArgs = field(default_factory=ModelArgs)
    cache: CacheArgs = field(default_factory=CacheArgs)
    scheduler: SchedulerArgs = field(default_factory=SchedulerArgs)
    kernels: KernelArgs = field(default_factory=KernelArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    speculative: SpeculativeArgs = field(default_factory=SpeculativeArgs)
    server: ServerArgs = field(default_factory=ServerArgs)

    @classmethod
    def of(cls, **flags: Any) -> "EngineArgs":
        """EngineArgs from flag names, e.g. `EngineArgs.of(model="tiny", tp_size=2)`."""
        return cls().replace(**flags)

    def replace(self, **flags: Any) -> "EngineArgs":
        """A copy with some flags changed (flag names, routed to their groups)."""
        by_group: dict[str, dict[str, Any]] = {}
        for name, value in flags.items():
            by_group.setdefault(group_of(name), {})[name] = value
        return dataclasses.replace(self, **{g: dataclasses.replace(getattr(self, g), **kw)
                                            for g, kw in by_group.items()})

    def attention_groups(self) -> int:
        """DP attention groups (1 without DP attention): they share the prefill step budget."""
        cfg = self.parallel.config()
        return cfg.dp_size if cfg.enable_dp_attention else 1

    def group_step_budget(self) -> int:
        """Most tokens one DP group's prefill step computes (the whole budget without DP attention)."""
        return self.scheduler.step_budget(self.attention_groups())

    def piecewise_max_tokens(self) -> int:
        """The largest extend step (per DP group) of the piecewise CUDA graphs (0: none):
        --piecewise-cuda-graph-max-tokens, or a group's prefill step budget (at most PIECEWISE_DEFAULT_MAX_TOKENS)."""
        if self.kernels.piecewise_cuda_graph_max_tokens is not None:
            return self.kernels.piecewise_cuda_graph_max_tokens
        return min(self.group_step_budget(), PIECEWISE_DEFAULT_MAX_TOKENS)

    def value(self, flag_name: str) -> Any:
        """One flag's value by its field name."""
        return getattr(getattr(self, group_of(flag_name)), flag_name)

    def validate(self) -> "EngineArgs":
        """Check every group, then combinations across groups; raise UsageError with a fix-it message."""
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.kernels.validate()
        self.parallel.validate(self.model.device)
        self.speculative.validate()
        self.server.validate()
        if self.kernels.disable_mla and self.speculative.enabled:
            raise UsageError("--disable-mla is an ablation of plain decoding, not built or tested with draft "
                             "trees: drop --speculative-algorithm or --disable-mla")
        if self.parallel.enable_two_batch_overlap and (self.kernels.attention.startswith("flashinfer")
                                                      or self.kernels.disable_mla):
            which = "--disable-mla" if self.kernels.disable_mla else "the FlashInfer attention backend"
            raise UsageError(f"--enable-two-batch-overlap plans each micro-batch's attention on its own, which "
                             f"{which} does not support: use --attention-backend triton (with MLA), or drop "
                             "--enable-two-batch-overlap")
        if self.scheduler.schedule_policy == "lpm" and self.cache.disable_radix_cache:
            raise UsageError("--schedule-policy lpm orders requests by their cached prefix and needs the radix "
                             "cache: drop --disable-radix-cache, or use --schedule-policy fcfs")
        if self.cache.gpu_memory_gb is not None and not self.server.dry_run:
            raise UsageError("--gpu-memory-gb is the card `dsctl serve --dry-run` plans for: add --dry-run, or drop "
                             "it (a real start uses the GPU's own memory)")
        if self.model.device == "cpu":
            gpu_only = [name for name, on in (("--enable-torch-compile", self.kernels.enable_torch_compile),
                                              (f"--kv-cache-dtype {self.cache.kv_cache_dtype}",
                                               self.cache.kv_cache_dtype != "auto")) if on]
            if gpu_only:
                raise UsageError(f"{', '.join(gpu_only)} need(s) a CUDA GPU; drop it with --device cpu")
        return self
