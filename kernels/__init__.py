"""Triton kernels for DeepSeek models, each with a pure-torch reference beside it.

Shared helpers: `fp8_math.py` (block-FP8 scale shapes, quantisation and dequantisation in plain
torch), `interpret.py` (whether Triton runs its CPU interpreter), `tuned_configs.py` (launch
configs). Nothing here imports engine/.
"""
