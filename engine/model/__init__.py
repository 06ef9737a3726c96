"""The DeepSeek model in plain torch modules, with pluggable attention/MoE backends.

Backends are registered by name in `backends.py`; a forward's layers find theirs, with the
KV cache and rope tables, in the `ForwardContext` of `context.py`.
"""
