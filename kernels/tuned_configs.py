"""Tuned launch configs for the fused-MoE and block-FP8 GEMM kernels: file names, look-up, defaults.

Files (JSON: {"<batch size M>": {"BLOCK_SIZE_M": .., "BLOCK_SIZE_N": .., "BLOCK_SIZE_K": ..,
"GROUP_SIZE_M": .., "num_warps": .., "num_stages": ..}, ...}):
  fused MoE:   E={E},N={N},device_name={GPU},dtype={fp8_w8a8|w4afp8|bf16},block_shape=[128, 128].json
               (the block_shape part only for block-FP8 weights: a bf16 or w4afp8 file ends at dtype=...)
  block GEMM:  N={N},K={K},device_name={GPU},dtype=fp8_w8a8,block_shape=[128, 128].json
  MLA decode:  MLA_DECODE,H={query rows per request: heads x query tokens},kv_dtype={bf16|fp16|fp32|fp8_e4m3|
               fp8_e5m2},device_name={GPU}.json, keyed by requests per decode step, with the keys of
               `MLA_DECODE_KEYS` (kernels/mla_decode.py `DecodeConfig` as ints) and optionally FLASHINFER (1:
               FlashInfer's MLA decode measured faster at that batch size, where it is installed)
GPU names are torch's device name with spaces -> underscores (NVIDIA_H100_80GB_HBM3, NVIDIA_H200).
Optional keys: QUANT_A (the GEMM quantises its own activation tiles), <KEY>_DOWN (fused MoE:
<KEY> for the down-projection GEMM only), CUBLAS (block GEMM: cuBLASLt's block-scaled FP8
GEMM where available, the Triton tiles of the same dict otherwise), SPLIT_K (block GEMM: the Triton kernel's
K loop in that many parts, summed by the last program of each tile; without the key kernels/fp8.py picks one
for launches with too few tiles to fill the GPU).

Search order: the user directory (the `user_dir` argument, else the one registered with
`set_user_config_dir`, which the engine's ModelRunner does with --kernel-config-dir), then the
per-user directory `dsctl tune-*` writes to by default (`per_user_dir`, platformdirs' user
config dir + /configs), then kernels/configs/ shipped in the package. The first file found
wins. Nothing here reads DSCTL_KERNEL_CONFIG_DIR (ENV_DIR): it is only the documented default
of that flag, resolved by the engine (platformdirs itself honours XDG_CONFIG_HOME). A look-up picks
the tuned M nearest the actual one (ties: the smaller), except beyond twice the largest tuned M (a
search its time limit stopped early), where the default config is used: a small-M tile says little about a prefill-sized GEMM.
With no file, defaults are used and a warning naming the `dsctl tune-moe` /
`dsctl tune-fp8` / `dsctl tune-mla` command that would write it is logged once. `dsctl tune-*` (tuning/)
writes files with `save_configs`.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Optional, Union

import platformdirs
import torch

log = logging.getLogger("dsctl.kernels")

ENV_DIR = "DSCTL_KERNEL_CONFIG_DIR"  # the user-facing default of --kernel-config-dir (read by the engine, not here)
SHIPPED_DIR = Path(__file__).resolve().parent / "configs"
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
_warned: set[str] = set()
_memo: dict[tuple, Optional[dict]] = {}
_MISSING = object()  # a look-up not memoised yet (None is a memoised "no tuned entry")
_registered: dict[str, Optional[Path]] = {"user_dir": None}  # set_user_config_dir's directory

Device = Union[torch.device, str, None]
PathLike = Union[str, Path]


def set_user_config_dir(path: Optional[PathLike]) -> None:
    """Search `path` before the shipped configs in every later look-up of this process (None: shipped only)."""
    _registered["user_dir"] = Path(path).expanduser().absolute() if path else None


def user_config_dir() -> Optional[Path]:
    """The directory registered with set_user_config_dir (None when there is none)."""
    return _registered["user_dir"]


def normalize_device_name(name: str) -> str:
    return name.strip().replace(" ", "_")


def device_name(device: Device = None) -> str:
    """NVIDIA_H100_80GB_HBM3-style name of a CUDA device; 'cpu' when there is none."""
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        return normalize_device_name(torch.cuda.get_device_name(dev))
    return "cpu"


def _block_part(block_shape) -> str:
    return "" if block_shape is None else f",block_shape=[{int(block_shape[0])}, {int(block_shape[1])}]"


def moe_config_filename(E: int, N: int, device: str, dtype: str, block_shape=(128, 128)) -> str:
    """dtype 'fp8_w8a8' with block_shape (128, 128), or e.g. 'bf16' with block_shape None."""
    return f"E={E},N={N},device_name={normalize_device_name(device)},dtype={dtype}{_block_part(block_shape)}.json"


def fp8_gemm_config_filename(N: int, K: int, device: str, block_shape=(128, 128)) -> str:
    return f"N={N},K={K},device_name={normalize_device_name(device)},dtype=fp8_w8a8{_block_part(block_shape)}.json"


MLA_DECODE_KEYS = ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "KV_LOAD", "FP16_MATH", "MIN_SPLIT_TOKENS",
                   "PROGRAMS_PER_SM")
MLA_KV_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def mla_decode_config_filename(rows: int, kv_dtype: str, device: str) -> str:
    """rows: query rows per request (heads per rank x query tokens); kv_dtype: a name of MLA_KV_NAMES."""
    return f"MLA_DECODE,H={rows},kv_dtype={kv_dtype},device_name={normalize_device_name(device)}.json"


def per_user_dir() -> Path:
    """Where `dsctl tune-*` writes by default: this user's config directory (platformdirs:
    $XDG_CONFIG_HOME/dsctl/configs, by default ~/.config/dsctl/configs, on Linux)."""
    return Path(platformdirs.user_config_dir("dsctl")) / "configs"


def config_dirs(user_dir: Optional[PathLike] = None) -> list[Path]:
    """Directories searched, in order: user_dir (else the registered one), the per-user directory when it
    exists, then the shipped configs."""
    user = user_dir or user_config_dir()
    mine = per_user_dir()
    return ([Path(user).expanduser()] if user else []) + ([mine] if mine.is_dir() else []) + [SHIPPED_DIR]


def find_config_file(filename: str, user_dir: Optional[PathLike] = None) -> Optional[Path]:
    for d in config_dirs(user_dir):
        if (d / filename).is_file():
            return d / filename
    return None


@functools.lru_cache(maxsize=256)
def _read(path: str, mtime: float) -> dict[int, dict]:
    with open(path) as f:
        raw = json.load(f)
    return {int(m): {k: int(v) for k, v in cfg.items()} for m, cfg in raw.items()}


def load_configs(path: PathLike) -> dict[int, dict]:
    """{M: config} from a JSON file (keys back to ints); cached until the file changes."""
    p = Path(path)
    return dict(_read(str(p), p.stat().st_mtime))


def save_configs(path: PathLike, configs: dict[int, dict]) -> None:
    """Write {M: config} as JSON, sorted by M (the format load_configs reads)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = {str(m): {k: int(v) for k, v in configs[m].items()} for m in sorted(configs)}
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=4) + "\n")
    tmp.replace(p)


def nearest_config(configs: dict[int, dict], m: int) -> dict:
    """The config tuned for the batch size nearest m (ties: the smaller)."""
    best = min(configs, key=lambda k: (abs(k - m), k))
    return dict(configs[best])


BEYOND_TUNED = 2  # an M above this multiple of a file's largest tuned M gets the default config


def tuned_or_default(configs: dict[int, dict], m: int, default) -> dict:
    """nearest_config, unless m is beyond BEYOND_TUNED x the largest tuned M: then default() (a thunk)."""
    return default() if m > BEYOND_TUNED * max(configs) else nearest_config(configs, m)


def _warn_once(filename: str, command: str, user_dir) -> None:
    if filename in _warned:
        return
    _warned.add(filename)
    dirs = ", ".join(str(d) for d in config_dirs(user_dir))
    log.warning("no tuned kernel config %s (looked in %s); using defaults, which may be slower. "
                "`%s` writes it (then point --out-dir or %s at it).", filename, dirs, command, ENV_DIR)


def _cfg(bm, bn, bk, gm=1, warps=4, stages=3, **extra) -> dict:
    return dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm, num_warps=warps,
                num_stages=stages, **extra)


def default_moe_config(M: int, E: int, N: int, top_k: int, dtype: str) -> dict:
    """Launch config when no tuned file exists (from H100 measurements, docs/perf.md)."""
    per_expert = M * top_k / max(E, 1)  # average rows per expert
    if dtype == "fp8_w8a8":
        if per_expert <= 8:  # decode: weight streaming, many narrow tiles
            return _cfg(16, 32, 128, stages=4, BLOCK_SIZE_N_DOWN=64)
        if per_expert <= 64:
            return _cfg(32, 128, 128, stages=3)
        return _cfg(64, 128, 128, gm=16, stages=3)
    if dtype == "w4afp8":  # INT4 weights, FP8 activations (kernels/fused_moe_w4a8.py); BLOCK_SIZE_K >= 64 on a GPU
        # from `benchmarks/bench_w4afp8_moe.py` and `dsctl bench one-batch` on an H200 (docs/perf.md, fourteenth GPU
        # session): one or two tokens over 256 experts stream fastest through the row-major kernel's 32-row tiles
        # (and its down GEMM: 0.98x the step with the swapped one at batch 1); from there tiles of 64 weight rows (the
        # swapped kernel) stepping two INT4 groups (256 columns) at a time; prefill 32-token tiles
        if per_expert <= 0.1:
            return _cfg(16, 32, 128, warps=2, stages=8, BLOCK_SIZE_N_DOWN=128, num_stages_DOWN=4, SWAP_AB_DOWN=0)
        if per_expert <= 32:
            return _cfg(16, 64, 256, stages=3, BLOCK_SIZE_N_DOWN=128)
        return _cfg(32, 128, 128, stages=3)
    if dtype == "fp32":  # 4-byte operands: the 16-bit tiles would overflow shared memory (228 KB on H100)
        return _cfg(16, 64, 64, stages=2) if per_expert <= 4 else _cfg(32, 64, 32, gm=8, stages=2)
    if per_expert <= 4:
        return _cfg(16, 64, 128, stages=3)
    return _cfg(64, 128, 64, gm=16, stages=3)


def default_fp8_gemm_config(M: int, N: int, K: int) -> dict:
    """Triton tile sizes; from M = 16 up also CUBLAS=1 (cuBLASLt's block-scaled GEMM, used where
    it is available and K % 512 == 0; it beat the Triton kernel on every such H100 shape)."""
    if M < 16:
        return _cfg(16, 64, 128, stages=4)
    if M <= 16:
        return _cfg(16, 64, 128, stages=4, CUBLAS=1)
    if M <= 64:
        return _cfg(32, 64, 128, stages=4, CUBLAS=1)
    return _cfg(64, 128, 128, gm=8, stages=3, CUBLAS=1)


def moe_dtype_name(weight_dtype: torch.dtype) -> str:
    return "fp8_w8a8" if weight_dtype == torch.float8_e4m3fn else {
        torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[weight_dtype]


def clear_config_cache() -> None:
    """Forget memoised look-ups (after writing new files in the same process)."""
    _memo.clear()


def _memoised(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        key = (fn.__name__, args, tuple(sorted(kwargs.items())), user_config_dir())
        try:
            hit = _memo.get(key, _MISSING)
        except TypeError:  # unhashable argument: no memo
            return fn(*args, **kwargs)
        if hit is _MISSING:
            hit = _memo[key] = fn(*args, **kwargs)
        return None if hit is None else dict(hit)
    return wrapper


@_memoised
def get_moe_config(E: int, N: int, M: int, top_k: int, dtype: str, device: Device = None,
                   device_name_override: Optional[str] = None, user_dir=None,
                   block_shape=(128, 128)) -> dict:
    """Fused-MoE config for M tokens (N = per-rank moe intermediate size; dtype fp8_w8a8|bf16|...)."""
    name = device_name_override or device_name(device)
    fname = moe_config_filename(E, N, name, dtype, block_shape if dtype == "fp8_w8a8" else None)
    path = find_config_file(fname, user_dir)
    if path is not None:
        return tuned_or_default(load_configs(path), M, lambda: default_moe_config(M, E, N, top_k, dtype))
    if name != "cpu":
        _warn_once(fname, f"dsctl tune-moe --model <model> --tp <tp> --dtype {dtype}", user_dir)
    return default_moe_config(M, E, N, top_k, dtype)


@_memoised
def get_fp8_gemm_config(N: int, K: int, M: int, device: Device = None,
                        device_name_override: Optional[str] = None, user_dir=None,
                        block_shape=(128, 128)) -> dict:
    """Block-FP8 GEMM config for an [M, K] x [N, K]^T product."""
    name = device_name_override or device_name(device)
    fname = fp8_gemm_config_filename(N, K, name, block_shape)
    path = find_config_file(fname, user_dir)
    if path is not None:
        return tuned_or_default(load_configs(path), M, lambda: default_fp8_gemm_config(M, N, K))
    if name != "cpu":
        _warn_once(fname, "dsctl tune-fp8 --model <model> --tp <tp>", user_dir)
    return default_fp8_gemm_config(M, N, K)


@_memoised
def get_mla_decode_config(rows: int, kv_dtype: str, batch: int, device: Device = None,
                          device_name_override: Optional[str] = None, user_dir=None) -> Optional[dict]:
    """The MLA decode table's entry for `batch` requests (the nearest tuned batch size; None beyond twice the
    largest, or without a file: the kernel's built-in default then)."""
    name = device_name_override or device_name(device)
    fname = mla_decode_config_filename(rows, kv_dtype, name)
    path = find_config_file(fname, user_dir)
    if path is not None:
        return tuned_or_default(load_configs(path), batch, lambda: None)
    if name != "cpu":
        _warn_once(fname, "dsctl tune-mla --model <model> --tp <tp>", user_dir)
    return None
