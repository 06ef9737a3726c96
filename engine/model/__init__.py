"""The DeepSeek model in plain torch modules, with pluggable kernels per op.

Every op's implementations are registered by name in `kernel_registry.py` (attention, MoE, block-FP8
GEMM, RMSNorm, MoE gate, all-reduce). A forward's layers find their attention / MoE backends, with the
KV cache and rope tables, in the `ForwardContext` of `context.py`; the per-call kernels are the
`Kernels` (`kernel_set.py`) each module is given at construction.
"""
