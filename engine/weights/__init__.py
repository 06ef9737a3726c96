"""Weights into modules: safetensors slices per rank, FP8 kept / dequantised / quantised, dummy weights."""
