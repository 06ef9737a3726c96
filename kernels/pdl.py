"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels of a decode step.

At batch 1 a decode layer is about twenty small kernels in a row, and each one pays its launch and ramp-up
after the previous one has drained. Launched with PDL (Triton's `launch_pdl`), a kernel may start while the
kernel before it in the stream is still running: its programs wait at `griddepcontrol.wait` (Triton's
`gdc_wait`) until that kernel has finished and its writes are visible, and then let the next kernel start in
turn (`gdc_launch_dependents`). Waiting first, before any load or store, keeps every kernel's reads and
writes ordered exactly as without PDL; only launch latency overlaps. Kernels launched without PDL (torch's,
NCCL's) are ordered by the stream as always, and CUDA-graph capture records the programmatic edges.

Each kernel that takes part has a `PDL: tl.constexpr` parameter and calls `pdl_enter(PDL)` first; its
launch passes `**launch_options()`, which is empty unless PDL is on for this process. The engine turns it on
at start-up (`set_enabled`, from --pdl, as tuned_configs' `set_user_config_dir`); it is off by default, on
CPU and under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # Triton before 3.4: `supported` says so, and no kernel is compiled with PDL
    gdc_launch_dependents = gdc_wait = None

_state = {"enabled": False}


def supported(device) -> str:
    """'' when PDL can run on `device` (a torch.device), else why not."""
    if device.type != "cuda":
        return "PDL is a CUDA feature"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "PDL needs a GPU of compute capability 9.0 or later (Hopper)"
    if gdc_wait is None:
        return f"Triton {triton.__version__} has no gdc_wait (PDL needs Triton 3.4 or later)"
    return ""


def set_enabled(flag: bool) -> None:
    """Launch the kernels of this module's users with PDL from now on in this process (or not)."""
    _state["enabled"] = bool(flag)


def enabled() -> bool:
    return _state["enabled"]


def launch_options() -> dict:
    """Keyword arguments for a PDL-aware kernel's launch: the kernel's PDL constexpr and Triton's launch_pdl."""
    return {"PDL": True, "launch_pdl": True} if _state["enabled"] else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a PDL-aware kernel: wait for the previous kernel, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
