"""Triton kernels for DeepSeek models, each with a pure-torch reference beside it."""
