"""dsctl's inference engine for DeepSeek-V2/V3/R1 (config, weights, model, runtime).

Import submodules directly; this package imports nothing heavy on its own.
"""
