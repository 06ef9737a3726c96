"""Checkpoint I/O: safetensors loading, FP8 blocks, dummy and built-in synthetic weights, completeness checks."""
