"""Shared test setup: built-in checkpoints in a per-session cache dir, quiet transformers, and
Triton kernels in the interpreter when there is no CUDA GPU.

TRITON_INTERPRET must be set before anything imports triton (`triton.jit` picks the
interpreter when a kernel is decorated), so it is set here, at the root, not per test area.
"""

import os
import tempfile

import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DSCTL_CACHE_DIR", os.path.join(tempfile.gettempdir(), "dsctl-test-cache"))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
