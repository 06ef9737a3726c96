"""Every engine flag, defined once.

`EngineArgs` is the single source of truth for the engine's options: their
defaults, help text, the CLI group they belong to and their allowed values.
`dsctl` builds its command-line options from these fields (see
`dsctl/flags.py`); nothing else parses flags. `validate()` rejects bad values and
bad combinations with a message that says why and what to use instead.

This module must stay importable without torch so that `dsctl --help` is fast.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.errors import UsageError

# Flag groups: each CLI command picks the groups it needs.
MODEL = "model"
SERVER = "server"
GPU = "gpu"


def flag(default: Any, help: str, group: str = MODEL, choices: tuple | None = None, **extra) -> Any:
    """A dataclass field carrying its CLI metadata."""
    meta = {"help": help, "group": group, "choices": choices, **extra}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class EngineArgs:
    # ---- model and weights -------------------------------------------------
    model: str = flag(
        "tiny",
        "Model: a registry alias (see `dsctl models`), a local checkpoint directory, "
        "or a hub repo id already in the local cache.",
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
        "'none' dequantises an FP8 checkpoint to --dtype.",
        choices=("none", "fp8"),
    )
    seed: int = flag(0, "Seed for dummy weights and for sampling when a request gives none.")
    max_model_len: Optional[int] = flag(
        None, "Context length limit (prompt + output). Default: the model's max_position_embeddings."
    )
    max_total_tokens: Optional[int] = flag(
        None, "Size of the KV cache pool in tokens. Default: 32768 on CPU; half the free GPU memory on CUDA."
    )
    max_running_requests: int = flag(256, "Most requests in the running batch at once.")

    # ---- scheduling (engine/scheduler): prefix cache, chunked prefill, overlap ----------
    max_prefill_tokens: int = flag(
        16384, "Most new prompt tokens computed in one prefill step; a longer prompt is still admitted "
        "(alone, or in chunks).",
    )
    chunked_prefill_size: int = flag(
        8192, "Prefill long prompts in chunks of at most this many tokens, with decode steps of the running "
        "requests in between (-1 disables chunking).",
    )
    disable_radix_cache: bool = flag(
        False, "Turn off the radix prefix cache (prompt prefixes shared between requests, or turns of a "
        "conversation, are then recomputed every time).",
    )
    schedule_policy: str = flag(
        "fcfs", "Order of waiting requests: 'fcfs' (arrival order) or 'lpm' (longest cached prefix first; "
        "needs the radix cache).", choices=("fcfs", "lpm"),
    )
    disable_overlap_schedule: bool = flag(
        False, "Process each step's results before launching the next forward (by default the host work of "
        "step N overlaps the device work of step N+1).",
    )

    # ---- kernels and GPU execution ----------------------------------------------
    attention_backend: str = flag(
        "auto", "MLA attention kernels: 'triton' (CUDA default), 'torch' (reference; CPU default), "
        "'flashinfer' (FlashInfer's MLA wrapper for prefill and decode; needs `pip install flashinfer-python`, "
        "bfloat16/float16 and a bf16 or fp8_e4m3 KV cache).",
        group=GPU, choices=("auto", "triton", "torch", "flashinfer"),
    )
    enable_flashinfer_mla: bool = flag(
        False, "Same as --attention-backend flashinfer (SGLang's flag name).", group=GPU,
    )
    moe_backend: str = flag(
        "auto", "MoE expert kernels: 'triton' fused MoE (CUDA default) or 'torch' (reference; CPU default).",
        group=GPU, choices=("auto", "triton", "torch"),
    )
    kv_cache_dtype: str = flag(
        "auto", "KV cache dtype: 'auto' = the model dtype; 'fp8_e4m3' / 'fp8_e5m2' halve the latent cache's "
        "bytes (e4m3: more mantissa, the usual choice; e5m2: more range).",
        group=GPU, choices=("auto", "fp8_e4m3", "fp8_e5m2"),
    )
    mem_fraction_static: float = flag(
        0.85, "Fraction of GPU memory for weights + KV cache (the rest: activations, CUDA graphs).", group=GPU,
    )
    disable_cuda_graph: bool = flag(False, "Run decode eagerly instead of replaying CUDA graphs.", group=GPU)
    cuda_graph_max_bs: int = flag(160, "Largest decode batch captured in a CUDA graph.", group=GPU)
    cuda_graph_bs: Optional[str] = flag(
        None, "Comma-separated decode batch sizes to capture (default: 1,2,4,8 then steps of 8 up to "
        "--cuda-graph-max-bs). Batches are padded to the nearest captured size.", group=GPU,
    )
    enable_torch_compile: bool = flag(
        False, "torch.compile the captured decode paths (set TORCHINDUCTOR_CACHE_DIR to reuse compiles "
        "across restarts).", group=GPU,
    )
    torch_compile_max_bs: int = flag(32, "Largest decode batch that uses the torch.compile'd path.", group=GPU)
    kernel_config_dir: Optional[str] = flag(
        None, "Directory of tuned kernel configs (from dsctl tune-moe / tune-fp8), searched before the shipped "
        "ones (default: $DSCTL_KERNEL_CONFIG_DIR).", group=GPU,
    )

    # ---- HTTP server (dsctl serve) ----------------------------------------------
    host: str = flag("127.0.0.1", "Address to listen on (0.0.0.0 for every interface).", group=SERVER)
    port: int = flag(30000, "TCP port to listen on.", group=SERVER)
    api_key: Optional[str] = flag(
        None, "Require 'Authorization: Bearer KEY' on every route except /health.", group=SERVER,
    )
    served_model_name: Optional[str] = flag(
        None, "Model name reported by /v1/models and expected in requests (default: --model).", group=SERVER,
    )
    max_queued_requests: Optional[int] = flag(
        None, "Most sequences waiting for a place in the running batch; beyond it requests get 503 with "
        "Retry-After (default: unbounded).", group=SERVER,
    )
    reasoning_parser: Optional[str] = flag(
        None, "Move the model's <think>...</think> section into reasoning_content (chat completions).",
        group=SERVER, choices=("deepseek-r1",),
    )
    shutdown_timeout: float = flag(
        30.0, "Seconds in-flight requests get to finish after SIGTERM before they are aborted.", group=SERVER,
    )
    log_level: str = flag("info", "Server log level.", group=SERVER, choices=("debug", "info", "warning", "error"))

    # ------------------------------------------------------------------------
    def validate(self) -> "EngineArgs":
        """Check values and combinations; raise UsageError with a fix-it message."""
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise UsageError(
                    f"--{cli_name(f.name)} must be one of {', '.join(choices)} (got {value!r})"
                )
        if self.num_layers is not None and self.num_layers < 1:
            raise UsageError(f"--num-layers must be >= 1 (got {self.num_layers})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise UsageError(f"--max-model-len must be >= 2 (got {self.max_model_len})")
        if self.max_running_requests < 1:
            raise UsageError(f"--max-running-requests must be >= 1 (got {self.max_running_requests})")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise UsageError(f"--max-total-tokens must be >= 1 (got {self.max_total_tokens})")
        self._validate_scheduling()
        self._validate_gpu()
        self._validate_server()
        if self.device == "cpu" and self.dtype == "float16":
            raise UsageError("--dtype float16 is not supported on CPU; use float32 or bfloat16")
        return self

    def _validate_scheduling(self) -> None:
        if self.max_prefill_tokens < 1:
            raise UsageError(f"--max-prefill-tokens must be >= 1 (got {self.max_prefill_tokens})")
        if self.chunked_prefill_size is not None and (self.chunked_prefill_size == 0
                                                      or self.chunked_prefill_size < -1):
            raise UsageError("--chunked-prefill-size must be a positive number of tokens, or -1 to disable "
                             f"chunking (got {self.chunked_prefill_size})")
        if self.schedule_policy == "lpm" and self.disable_radix_cache:
            raise UsageError("--schedule-policy lpm orders requests by their cached prefix and needs the radix "
                             "cache: drop --disable-radix-cache, or use --schedule-policy fcfs")

    def _validate_server(self) -> None:
        if not 1 <= self.port <= 65535:
            raise UsageError(f"--port must be in 1..65535 (got {self.port})")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise UsageError(f"--max-queued-requests must be >= 1 (got {self.max_queued_requests}); "
                             "leave it out for an unbounded queue")
        if self.shutdown_timeout < 0:
            raise UsageError(f"--shutdown-timeout must be >= 0 (got {self.shutdown_timeout})")
        for name, value in (("--api-key", self.api_key), ("--served-model-name", self.served_model_name)):
            if value is not None and not value.strip():
                raise UsageError(f"{name} must not be empty")

    def _validate_gpu(self) -> None:
        if self.kernel_config_dir is not None and not os.path.isdir(os.path.expanduser(self.kernel_config_dir)):
            raise UsageError(f"--kernel-config-dir {self.kernel_config_dir}: no such directory")
        if self.enable_flashinfer_mla and self.attention_backend not in ("auto", "flashinfer"):
            raise UsageError(f"--enable-flashinfer-mla selects the flashinfer attention backend, which contradicts "
                             f"--attention-backend {self.attention_backend}: give only one of them")
        if not 0 < self.mem_fraction_static < 1:
            raise UsageError(f"--mem-fraction-static must be in (0, 1) (got {self.mem_fraction_static})")
        if self.cuda_graph_max_bs < 1 or self.torch_compile_max_bs < 1:
            raise UsageError("--cuda-graph-max-bs and --torch-compile-max-bs must be >= 1")
        if self.cuda_graph_bs is not None:
            sizes = self.cuda_graph_batch_sizes()
            if not sizes or min(sizes) < 1:
                raise UsageError(f"--cuda-graph-bs must list positive batch sizes (got {self.cuda_graph_bs!r})")
        if self.device == "cpu":
            gpu_only = [name for name, on in (("--enable-torch-compile", self.enable_torch_compile),
                                              (f"--kv-cache-dtype {self.kv_cache_dtype}", self.kv_cache_dtype != "auto")) if on]
            if gpu_only:
                raise UsageError(f"{', '.join(gpu_only)} need(s) a CUDA GPU; drop it with --device cpu")
        if self.enable_torch_compile and self.disable_cuda_graph:
            raise UsageError("--enable-torch-compile compiles the CUDA-graph decode path; "
                             "it cannot be combined with --disable-cuda-graph")

    def cuda_graph_batch_sizes(self) -> list[int]:
        """The decode batch sizes to capture, ascending."""
        if self.cuda_graph_bs:
            try:
                sizes = sorted({int(x) for x in self.cuda_graph_bs.replace(" ", "").split(",") if x})
            except ValueError:
                raise UsageError(f"--cuda-graph-bs must be comma-separated integers (got {self.cuda_graph_bs!r})") from None
            return sizes
        sizes = [b for b in (1, 2, 4) if b < self.cuda_graph_max_bs] + list(range(8, self.cuda_graph_max_bs + 1, 8))
        return sorted(set(sizes + [self.cuda_graph_max_bs]))

    def replace(self, **changes) -> "EngineArgs":
        return dataclasses.replace(self, **changes)


def cli_name(field_name: str) -> str:
    return field_name.replace("_", "-")


def fields_in_groups(groups: tuple[str, ...]) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineArgs) if f.metadata.get("group") in groups]
